"""Work in a forked process beside this one: a run traced while another is (a folded stack's
second run, :mod:`memsim.tracer.trace`), or a point traced before it is asked for
(:meth:`memsim.analysis.explore.Retracer.beside`). Linux only; ``MEMSIM_PARALLEL=0`` turns it
off."""

from __future__ import annotations

import os
import pickle
import signal
import sys
from typing import Callable

from . import progress

__all__ = ["parallel", "forked", "joined", "abandon"]


def parallel() -> bool:
    """Whether a run may be traced in a forked process beside this one: Linux (fork is the
    platform's own way there; macOS and Windows have none that is safe with torch), a CPU for
    this process and one for each child running (:func:`forked`), and not turned off
    (``MEMSIM_PARALLEL=0``)."""
    if os.environ.get("MEMSIM_PARALLEL", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        return len(os.sched_getaffinity(0)) >= 2 + len(_CHILDREN)
    except (AttributeError, OSError):  # pragma: no cover
        return False


_CHILDREN: set[int] = set()   # the forked children running, by pid


def forked(fn: Callable[[], object]):
    """Start ``fn()`` in a forked child (its own copy of every object), which sends its
    result back pickled: ``(pid, pipe)`` for :func:`joined` (or :func:`abandon`), or None
    where that is not possible here (:func:`parallel`). The child forks no children of its
    own (``MEMSIM_PARALLEL=0`` there) and prints no progress."""
    if not parallel():
        return None
    try:
        r, w = os.pipe()
        pid = os.fork()
    except OSError:  # pragma: no cover - out of processes or memory
        return None
    if pid:
        os.close(w)
        _CHILDREN.add(pid)
        return pid, r
    status = 1
    try:  # the child: never returns
        os.close(r)
        _die_with_parent()
        os.environ["MEMSIM_PARALLEL"] = "0"
        with progress.listening(None):
            data = pickle.dumps(fn(), protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(w, "wb") as f:
            f.write(data)
        status = 0
    except BaseException:  # noqa: BLE001 - the parent computes it again and raises there
        pass
    finally:
        os._exit(status)


def _die_with_parent() -> None:
    """Linux: this (forked) process is killed when its parent ends, so that a child whose
    answer is no longer wanted never outlives the command that started it."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def joined(child):
    """What a :func:`forked` child sent, or None (none started, or it failed)."""
    if child is None:
        return None
    pid, r = child
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    _CHILDREN.discard(pid)
    if status != 0 or not data:
        return None
    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001 - a truncated answer: the run is traced here instead
        return None


def abandon(child) -> None:
    """Stop and reap a :func:`forked` child whose result is no longer wanted (run A failed;
    a point traced beside an analysis and never asked for): it would otherwise block on its
    full pipe for the rest of this process."""
    if child is None:
        return
    pid, r = child
    os.close(r)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # pragma: no cover - it had already exited
        pass
    os.waitpid(pid, 0)
    _CHILDREN.discard(pid)

"""Progress of a trace, for whoever listens (the command line shows it on stderr).

The tracer never prints: it calls :func:`report` when a phase of the step starts and when a
block of a repeated stack (an item of a ``ModuleList`` or ``Sequential`` of several) starts its
forward; :func:`listening` installs a listener for the duration of a call.

The runs are counted: :func:`started` and :func:`finished` bracket each symbolic run, and a
caller that knows how many runs an answer needs says so ahead (:func:`expect`: the ranks of a
strategy, the options of a verdict, the configurations of a comparison), so that a listener
can say "trace k of n" and, from the runs finished, estimate the time left. A run nobody
announced (a retrace at pinned sizes) raises the count as it starts.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

_listener: Callable | None = None
_about: list[str] = []   # what is being traced, outermost first (a rank of a strategy)
_traces = 0              # symbolic runs started in this process
_expected = 0            # the runs known to be needed, those started included
_began: list[float] = []            # when each run in progress started (nested runs stack)
_took: list[tuple[int, float]] = []   # (run number, seconds) of each finished run


def started() -> None:
    """A symbolic run of the step starts (:func:`traces` counts them)."""
    global _traces, _expected
    _traces += 1
    _expected = max(_expected, _traces)
    _began.append(time.monotonic())


def finished() -> None:
    """The symbolic run last started has finished (its time feeds :func:`estimate`)."""
    if _began:
        _took.append((_traces, time.monotonic() - _began.pop()))


def expect(runs: int) -> None:
    """At least ``runs`` more symbolic runs start from now for the answer being made (a floor:
    announcing the same runs again at a lower level adds nothing)."""
    global _expected
    _expected = max(_expected, _traces + runs)


def expected() -> int:
    """The runs known to be needed so far, those started included."""
    return _expected


def estimate(since: int) -> float | None:
    """Seconds left for the runs expected after run number ``since`` (a command's first run
    is ``since + 1``), from the mean time of those of its runs that finished; None before one
    has."""
    took = [s for n, s in _took if n > since]
    if not took:
        return None
    mean = sum(took) / len(took)
    running = time.monotonic() - _began[-1] if _began else mean
    return max(0.0, (_expected - _traces) * mean + max(0.0, mean - running))


def traces() -> int:
    """Symbolic runs started in this process so far (a forked child's are its own)."""
    return _traces


@contextlib.contextmanager
def listening(fn: Callable[..., None] | None):
    """Call ``fn(phase, module, index, count, traced)`` on progress while inside (None:
    nobody)."""
    global _listener
    was, _listener = _listener, fn
    try:
        yield
    finally:
        _listener = was


@contextlib.contextmanager
def about(text: str):
    """Inside, the trace is of ``text`` (``rank 2 of 4``): :func:`context` says so."""
    _about.append(text)
    try:
        yield
    finally:
        _about.pop()


def context() -> str | None:
    """What is being traced, where a caller said (:func:`about`), else None."""
    return ", ".join(_about) if _about else None


def report(phase: str, module: str | None = None, index: int | None = None,
           count: int | None = None, traced: int | None = None) -> None:
    """``count``: the stack's blocks; ``traced``: those this run traces, where it is a cut run
    of a folded stack (:mod:`memsim.tracer.fold`: the rest are derived), else None."""
    if _listener is not None:
        _listener(phase, module, index, count, traced)


def blocks(model) -> dict[int, tuple[str, int, int, int | None]]:
    """The items of the model's repeated stacks: ``{id(module): (path, index, count,
    traced)}``, ``count`` the whole stack's and ``traced`` the blocks of a cut run (None where
    the stack is whole)."""
    import torch

    out: dict[int, tuple[str, int, int, int | None]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) and len(mod) > 1:
            whole = mod.__dict__.get("_memsim_whole")
            for i, child in enumerate(mod):
                out.setdefault(id(child), (f"{name}.{i}" if name else str(i), i,
                                           whole or len(mod), len(mod) if whole else None))
    return out

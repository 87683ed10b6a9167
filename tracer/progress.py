"""Progress of a trace, for whoever listens (the command line shows it on stderr).

The tracer never prints: it calls :func:`report` when a phase of the step starts and when a
block of a repeated stack (an item of a ``ModuleList`` or ``Sequential`` of several) starts its
forward; :func:`listening` installs a listener for the duration of a call.
"""

from __future__ import annotations

import contextlib
from typing import Callable

_listener: Callable | None = None
_about: list[str] = []   # what is being traced, outermost first (a rank of a strategy)
_traces = 0              # symbolic runs started in this process


def started() -> None:
    """A symbolic run of the step starts (:func:`traces` counts them)."""
    global _traces
    _traces += 1


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

"""Progress of a trace, for whoever listens (the command line shows it on stderr).

The tracer never prints: it calls :func:`report` when a phase of the step starts and when a
block of a repeated stack (an item of a ``ModuleList`` or ``Sequential`` of several) starts its
forward; :func:`listening` installs a listener for the duration of a call.
"""

from __future__ import annotations

import contextlib
from typing import Callable

_listener: Callable | None = None


@contextlib.contextmanager
def listening(fn: Callable[[str, str | None, int | None, int | None], None] | None):
    """Call ``fn(phase, module, index, count)`` on progress while inside (None: nobody)."""
    global _listener
    was, _listener = _listener, fn
    try:
        yield
    finally:
        _listener = was


def report(phase: str, module: str | None = None, index: int | None = None,
           count: int | None = None) -> None:
    if _listener is not None:
        _listener(phase, module, index, count)


def blocks(model) -> dict[int, tuple[str, int, int]]:
    """The items of the model's repeated stacks: ``{id(module): (path, index, count)}``."""
    import torch

    out: dict[int, tuple[str, int, int]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) and len(mod) > 1:
            for i, child in enumerate(mod):
                out.setdefault(id(child), (f"{name}.{i}" if name else str(i), i, len(mod)))
    return out

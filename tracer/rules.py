"""Per-op memory rules: where the fake kernel is not what the modelled device would run.

Tracing runs every op's fake (meta) kernel, which gives the exact output storages of most ops on
any device. A few ops differ by device: the kernel the real device would pick, or workspaces the
real kernel keeps alive. A rule replaces the op's execution inside the recorder for one device
type. One way to register (the decorator), duplicates rejected, and every rule listed by
:func:`registered_rules` so that a test can reach each one.

A rule is ``rule(recorder, func, args, kwargs) -> output``; it usually calls ``func`` itself.
"""

from __future__ import annotations

from typing import Callable

import torch

from .errors import MemsimError

Rule = Callable[..., object]
_RULES: dict[tuple[torch._ops.OpOverload, str], Rule] = {}
ANY = "*"


def register_rule(op: torch._ops.OpOverload, device: str = ANY, *, doc: str = ""):
    """Register ``rule`` for ``op`` on ``device`` (``"cuda"``, ``"cpu"`` or ``"*"``)."""
    if not isinstance(op, torch._ops.OpOverload):
        raise MemsimError(f"register_rule needs an OpOverload such as torch.ops.aten.mm.default, "
                          f"got {op!r}")

    def deco(fn: Rule) -> Rule:
        key = (op, device)
        if key in _RULES:
            raise MemsimError(f"a memory rule for {op} on {device} is already registered")
        fn.__memsim_doc__ = doc or (fn.__doc__ or "").strip().splitlines()[0]
        _RULES[key] = fn
        return fn

    return deco


def lookup_rule(op, device: str) -> Rule | None:
    return _RULES.get((op, device)) or _RULES.get((op, ANY))


def registered_rules() -> dict[tuple[str, str], str]:
    """``{(op name, device): one-line description}`` of every rule."""
    return {(str(op), dev): fn.__memsim_doc__ for (op, dev), fn in _RULES.items()}

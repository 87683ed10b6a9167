"""Every per-op decision memsim makes, in one registry.

Tracing runs every op's fake (meta) kernel, which gives the exact output storages of most ops on
any device. Where that is not what the modelled device (or mode) runs, a rule says so. The kinds:

- ``aten`` (:class:`Kind.ATEN`): a dispatch-level memory rule for one ATen op on one device,
  ``rule(recorder, func, args, kwargs) -> output``; it usually calls ``func`` itself
  (:mod:`memsim.tracer.kernels`).
- ``function``: the kernel a device picks for a Python-level function (``F.scaled_dot_product
  _attention`` runs a fused kernel on CUDA): ``rule(*args, **kwargs) -> output``, or None to
  leave the call as it is (:mod:`memsim.tracer.cuda`).
- ``autocast``: where CUDA's autocast policy differs from the CPU's: ``"fp32"`` (low-precision
  inputs are cast to fp32) or ``"fp32_out"`` (the result is fp32) (:mod:`memsim.tracer.precision`).
- ``inductor``: how Inductor lowers an ATen op by name, beyond its tags: ``"pointwise"``,
  ``"reduction"`` or ``"concat"`` (:mod:`memsim.tracer.compiled`).
- ``namespace``: op namespaces whose memory the tests check against real runs; ops elsewhere
  are listed in the report as unchecked.

One way to register (:func:`register`, or :func:`rule` as a decorator), duplicates rejected,
every entry listed by :func:`registered` and counted when it is applied (:func:`hits`), so that
a test can reach each one (``tests/test_rules.py``).

>>> sorted({r.kind.value for r in registered()})
['aten', 'autocast', 'function', 'inductor', 'namespace']
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch

from .errors import MemsimError

ANY = "*"


class Kind(str, Enum):
    """What a registry entry decides (see the module docstring)."""

    ATEN = "aten"
    FUNCTION = "function"
    AUTOCAST = "autocast"
    INDUCTOR = "inductor"
    NAMESPACE = "namespace"


@dataclass(frozen=True)
class Rule:
    """One entry: for ``key`` (an ATen overload, a Python function, an op or namespace name)
    on ``device`` (``"cuda"``, ``"cpu"`` or ``"*"``), ``value`` (a callable or a word)."""

    kind: Kind
    key: Any
    device: str
    value: Any
    doc: str

    @property
    def name(self) -> str:
        k = self.key
        return getattr(k, "__qualname__", None) if callable(k) and not isinstance(
            k, torch._ops.OpOverload) else str(k)


_RULES: dict[tuple[Kind, Any, str], Rule] = {}
_HITS: Counter = Counter()
_VALUES = {Kind.AUTOCAST: ("fp32", "fp32_out"), Kind.INDUCTOR: ("pointwise", "reduction", "concat")}


def register(kind: Kind, key, value, *, device: str = ANY, doc: str = "") -> Rule:
    """Add one entry; a second entry for the same ``(kind, key, device)`` is an error."""
    kind = Kind(kind)
    if kind is Kind.ATEN and not isinstance(key, torch._ops.OpOverload):
        raise MemsimError(f"an aten rule needs an OpOverload such as torch.ops.aten.mm.default, "
                          f"got {key!r}")
    if device not in (ANY, "cuda", "cpu"):
        raise MemsimError(f"rule for {key!r}: device {device!r} is not cuda, cpu or '*'")
    allowed = _VALUES.get(kind)
    if allowed is not None and value not in allowed:
        raise MemsimError(f"{kind.value} rule for {key!r}: {value!r} is not one of "
                          f"{', '.join(allowed)}")
    if kind in (Kind.ATEN, Kind.FUNCTION) and not callable(value):
        raise MemsimError(f"{kind.value} rule for {key!r} must be callable")
    full = (kind, key, device)
    if full in _RULES:
        raise MemsimError(f"a {kind.value} rule for {key!r} on {device} is already registered")
    if not doc and callable(value):
        doc = (value.__doc__ or "").strip().splitlines()[0] if value.__doc__ else ""
    r = Rule(kind, key, device, value, doc)
    _RULES[full] = r
    return r


def rule(kind: Kind, key, *, device: str = ANY, doc: str = ""):
    """Decorator form of :func:`register` for callable rules."""
    def deco(fn: Callable) -> Callable:
        register(kind, key, fn, device=device, doc=doc)
        return fn
    return deco


def lookup(kind: Kind, key, device: str) -> Rule | None:
    """The entry for ``key`` on ``device`` (a device's own entry before one for any device);
    counted as applied."""
    r = _RULES.get((kind, key, device)) or _RULES.get((kind, key, ANY))
    if r is not None:
        _HITS[(kind, key, r.device)] += 1
    return r


def keys(kind: Kind, device: str = ANY) -> frozenset:
    """The keys with an entry of ``kind`` for ``device`` (or for any device)."""
    return frozenset(k for (kd, k, dev) in _RULES if kd is kind and dev in (device, ANY))


def registered(kind: Kind | None = None) -> list[Rule]:
    """Every entry (of ``kind``), in registration order, the built-in ones included."""
    import importlib
    for mod in _BUILTIN:
        importlib.import_module(mod, __package__)
    return [r for r in _RULES.values() if kind is None or r.kind is kind]


# the modules that register the built-in entries, each next to the code that applies them
_BUILTIN = (".kernels", ".data_dependent", ".rnn_cpu", ".cuda", ".rnn_cuda", ".functions", ".precision",
            ".compiled", ".recorder")


def hits() -> Counter:
    """How often each ``(kind, key, device)`` entry was applied in this process."""
    return Counter(_HITS)

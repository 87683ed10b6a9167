"""What a strategy is: a value that says what it needs, behind one interface.

A strategy (LoRA, activation checkpointing, tensor parallelism, FSDP2, DeepSpeed ZeRO, DDP) is a
frozen dataclass with three methods:

- ``validate(given, config)``: raise :class:`~memsim.tracer.StrategyError` naming the setting
  when it cannot combine with the other strategies ``given`` (by key) or the step config;
- ``describe()``: its settings as plain data (the JSON ``"strategy"`` section);
- ``apply(plan) -> plan``: what it needs from the analysis, added to a :class:`Plan`: a
  transform of the model before tracing, a transform of the run's copy inside the symbolic run
  (per rank), a :class:`~memsim.tracer.Driver` that owns the training loop, how the ranks are
  chosen, or an edit of the traced timeline (:class:`Edit`).

:func:`memsim.strategies.analyze` applies the strategies in registration order (model
transforms first), traces the plan once per rank it selects, applies the edits and returns a
:class:`StrategyReport`, which wraps the plain :class:`~memsim.analysis.Report` of each rank
without changing it. A new strategy is one file: the dataclass, its class attributes
(``key``, ``order``, ``axis``, ``flags``), its command-line options (``add_options``,
``from_options``), its text summary (``summary``) and ``register_strategy(MyStrategy)``; the
command line, the renderer, :func:`memsim.strategies.analyze`'s keywords and ``memsim compare``
loop over the registered strategies (docs/architecture.md lists the steps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Mapping

import sympy
import torch

from memsim.analysis import Report, StepMemory
from memsim.tracer import Driver, StepConfig, StrategyError, UsageError

__all__ = ["Strategy", "Plan", "Ranks", "RankInfo", "Edit", "RankClass", "StrategyReport",
           "register_strategy", "registered_strategies", "summary_order", "exclusive", "AXES",
           "data_parallel"]

_STRATEGIES: dict[str, type] = {}


def register_strategy(cls: type) -> type:
    """Register a strategy class under its ``key``; strategies apply in registration order.
    A second class with the same key is an error."""
    key = getattr(cls, "key", None)
    if not isinstance(key, str) or not key:
        raise StrategyError(f"strategy {cls.__name__} has no key (a class attribute naming it)")
    if key in _STRATEGIES:
        raise StrategyError(f"a strategy with key {key!r} is already registered "
                            f"({_STRATEGIES[key].__name__})")
    _STRATEGIES[key] = cls
    return cls


def registered_strategies() -> dict[str, type]:
    """``{key: class}`` in application order (each class's ``order``, then registration)."""
    ordered = sorted(enumerate(_STRATEGIES.items()), key=lambda e: (e[1][1].order, e[0]))
    return {k: cls for _, (k, cls) in ordered}


# the device mesh's dimensions, outermost first: the order a strategy summary names them in
AXES = ("pp", "dp", "tp")


def summary_order() -> list[type]:
    """The registered classes in the order a summary names them: the mesh dimensions they
    span, outermost first (:data:`AXES`), then the rest in application order."""
    rank = {a: i for i, a in enumerate(AXES)}
    return sorted(registered_strategies().values(),
                  key=lambda c: rank.get(c.axis, len(AXES)))


class Strategy:
    """The interface of a strategy (see the module docstring). Subclasses are frozen
    dataclasses with a ``key``.

    Class attributes: ``key`` (its keyword in :func:`memsim.strategies.analyze` and its JSON
    section), ``order`` (strategies apply in increasing order: transforms of the model first),
    ``axis`` (the dimension of the device mesh it spans, one of :data:`AXES`, read as the
    field of that name: ``dp=8``; None for none) and ``flags`` (the command-line options that
    turn it on, for messages).
    """

    key: ClassVar[str] = ""
    order: ClassVar[int] = 100
    axis: ClassVar[str | None] = None
    flags: ClassVar[tuple[str, ...]] = ()

    @property
    def degree(self) -> int:
        """Ranks along its mesh dimension (1 where it spans none)."""
        return getattr(self, self.axis) if self.axis else 1

    @classmethod
    def coerce(cls, value):
        """The strategy a keyword argument gives (``checkpoint="blocks"``): ``value`` itself
        by default."""
        return value

    @classmethod
    def add_options(cls, group) -> None:
        """Add its command-line options to ``group`` (an argparse argument group)."""

    @classmethod
    def from_options(cls, opts, step: dict) -> "Strategy | None":
        """The strategy the parsed command-line options ``opts`` ask for, or None; raise a
        :class:`~memsim.tracer.UsageError` naming an option given without what it needs.
        ``step``: the step options (:class:`~memsim.tracer.StepConfig` fields by name) the
        command line gives, which a strategy may complete (a DeepSpeed config's precision)."""
        return None

    @classmethod
    def summary(cls, described) -> str:
        """One phrase for the text report, from :meth:`describe`'s output."""
        return f"{cls.__name__} {described}"

    def for_inputs(self, config: StepConfig, inputs: Mapping) -> StepConfig:
        """The step config this strategy needs for ``inputs`` (sizes traced at multiples of a
        step, example sizes): ``config`` itself by default."""
        return config

    def validate(self, given: Mapping[str, "Strategy"], config: StepConfig) -> None:
        """Raise a StrategyError when ``self`` cannot combine with ``given`` or ``config``."""

    def describe(self):
        """The settings as plain data (a dict of the dataclass fields, tuples as lists)."""
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}

    def apply(self, plan: "Plan") -> "Plan":
        """``plan`` with what this strategy needs added."""
        raise NotImplementedError


def data_parallel(flag: str, opts) -> int:
    """``--dp``, which the data-parallel strategy that ``flag`` turned on needs."""
    dp = getattr(opts, "dp", None)
    if dp is None:
        raise UsageError(f"{flag} needs --dp N", hint="the number of data-parallel ranks")
    return dp


def exclusive(given: Mapping[str, Strategy], key: str, group: tuple[str, ...], hint: str
              ) -> None:
    """At most one strategy of ``group`` (those that shard or replicate the same thing)."""
    both = [k for k in group if k in given]
    if key in both and len(both) > 1:
        raise StrategyError(f"{' and '.join(both)} both shard or replicate over the data-"
                            "parallel ranks; give one", hint=hint)


@dataclass(frozen=True)
class Ranks:
    """Which ranks are traced, and how they group into ranks with equal memory.

    ``classes``: groups known before tracing (equal local shapes), each traced as its first
    rank, rank 0's shown. ``by_sizes``: where activations split too (sequence parallelism),
    ``fn(sizes) -> classes`` from the sizes rank 0's trace ran at (the example size of every
    symbol, the fixed ones, the inputs' integer dimensions); each class is traced, and classes
    whose figures are the same formulas merge. ``sampled``: ranks traced and then grouped by
    their peak formula, the largest peak at the example sizes shown (DeepSpeed's partitions);
    with ``classes`` too, each sampled rank stands for the class it heads (DeepSpeed's stage 3).
    """

    world: int = 1
    classes: tuple[tuple[int, ...], ...] = ((0,),)
    sampled: tuple[int, ...] | None = None
    by_sizes: Callable | None = None


@dataclass(frozen=True)
class RankInfo:
    """What tracing the ranks found, for the notes strategies write after it."""

    world: int
    classes: tuple[tuple[int, ...], ...]
    traced: tuple[int, ...]
    shown: int
    report: Report          # the shown rank's plain report


@dataclass(frozen=True)
class Edit:
    """A strategy's edit of one rank's traced step: the step's new figures, what it adds."""

    train: StepMemory
    notes: tuple[str, ...] = ()
    buffers: Mapping[str, sympy.Expr] = field(default_factory=dict)
    modelled: str = ""      # what the edit models rather than traces, e.g. "DDP buckets"


@dataclass(frozen=True)
class Plan:
    """What the strategies ask of the analysis, built by their ``apply`` in turn.

    Attributes
    ----------
    model : the model to trace (after transforms of the model itself, e.g. LoRA adapters).
    config : the step (a strategy may change it, e.g. ZeRO's optimizer on CUDA).
    given : the strategies, by key.
    inside : ``{name: fn(model, rank)}`` applied in order to the run's copy of the model,
        inside the symbolic run (checkpointing, then sharding).
    driver : ``fn(rank) -> Driver`` when a library owns the training loop.
    ranks : which ranks are traced (:class:`Ranks`).
    edits : ``fn(report, model) -> Edit`` applied to each traced rank's report.
    notes : plain notes, or ``fn(RankInfo) -> iterable of str`` written after tracing.
    host : ``fn(report) -> sympy.Expr`` of host memory, or None.
    """

    model: torch.nn.Module
    config: StepConfig
    given: Mapping[str, Strategy]
    inside: Mapping[str, Callable] = field(default_factory=dict)
    driver: Callable[[int], Driver] | None = None
    ranks: Ranks = Ranks()
    edits: tuple[Callable, ...] = ()
    notes: tuple = ()
    host: Callable | None = None

    def but(self, **changes) -> "Plan":
        """A copy with ``changes``; ``inside`` entries and ``edits``/``notes`` are added to."""
        if "inside" in changes:
            changes["inside"] = {**self.inside, **changes["inside"]}
        for k in ("edits", "notes"):
            if k in changes:
                changes[k] = tuple(getattr(self, k)) + tuple(changes[k])
        return dataclasses.replace(self, **changes)

    def transform(self, rank: int) -> Callable | None:
        """``transform(model)`` for :func:`memsim.analysis.analyze`: every ``inside`` entry as
        ``rank`` sees it."""
        fns = list(self.inside.values())
        if not fns:
            return None

        def apply(model: torch.nn.Module) -> None:
            for fn in fns:
                fn(model, rank)
        # the module paths the entries treat one by one (None: unknown), so that a stack of
        # blocks is folded only where they treat every block alike (memsim.tracer.fold)
        paths = [getattr(fn, "paths", ()) for fn in fns]
        apply.paths = None if any(p is None for p in paths) else tuple(
            x for p in paths for x in p)
        return apply


@dataclass(frozen=True)
class RankClass:
    """Ranks whose shards have the same sizes, hence the same memory; ``report`` is traced as
    the first of them."""

    ranks: tuple[int, ...]
    report: Report = field(repr=False)


@dataclass(frozen=True)
class StrategyReport(Report):
    """One rank's figures under strategies: the plain :class:`Report` of that rank (``base``),
    wrapped, with the strategies' edits (``train``), notes, buffers and the other ranks.

    Attributes (beyond :class:`~memsim.analysis.Report`'s)
    ----------
    base : Report
        The traced report of this rank, as the analysis made it.
    strategies : tuple of Strategy
    world_size : int
    rank : int
        The rank whose figures these are (the first of its group).
    rank_classes : tuple of RankClass
        Every group of ranks with equal memory, where ranks differ (``ranks`` reads it).
    buffers : dict of str to sympy.Expr
        Communication buffers a strategy adds to the trace (DDP buckets), bytes.
    host_bytes : sympy.Expr or None
        Peak of host memory (ZeRO-Offload modelling a GPU), bytes.
    """

    base: Report | None = field(default=None, repr=False, compare=False)
    strategies: tuple = ()
    world_size: int = 1
    rank: int = 0
    rank_classes: tuple = ()
    buffers: Mapping[str, sympy.Expr] = field(default_factory=dict)
    host_bytes: sympy.Expr | None = None
    modelled: tuple[str, ...] = ()

    @property
    def ranks(self) -> tuple:
        return self.rank_classes

    @property
    def basis(self) -> str:
        """``"exact"``, or ``"traced; X modelled"`` where an edit models part of it."""
        return "traced; " + ", ".join(f"{m} modelled" for m in self.modelled) \
            if self.modelled else "exact"

    @property
    def strategy(self) -> dict:
        """The strategy as plain data (the JSON ``"strategy"`` section): each strategy's
        settings by key, the world size, buffers and host bytes as formulas."""
        out = {s.key: s.describe() for s in self.strategies}
        out["world_size"] = self.world_size
        if self.buffers:
            out["buffers"] = {k: str(v) for k, v in self.buffers.items()}
        if self.host_bytes is not None:
            out["host_bytes"] = str(self.host_bytes)
        return out

    def counterpart(self, other: Report) -> Report:
        """A retrace analyses every rank again (one cached analysis): this rank's group."""
        if getattr(other, "rank", self.rank) != self.rank:
            return next((rc.report for rc in other.ranks if self.rank in rc.ranks), other)
        return other

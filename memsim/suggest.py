"""What would make a step fit that does not: each option traced at the point, not guessed.

When the verdict is DOES NOT FIT, the front door analyses the same model at the same point
with one change at a time, among those the configuration does not use yet:

- ``--precision bf16-mixed`` (from ``32-true``): activations in bf16 under autocast;
- ``--checkpoint blocks``: every repeated block recomputed in backward;
- both together;
- ``--fsdp --dp N``: FSDP2 at the least power of two ``N`` at which the model states, sharded,
  leave room for the rest of the step (estimated from the traced states, then traced at ``N``,
  and at ``2N`` where ``N`` does not fit).

Each option's total is the budget of that analysis (the same allocator replay and overheads as
the verdict's), on the rank with the largest peak. The options are listed best first: those
that fit before those that do not; among those that fit, the order of what each costs in a
real run (a lower precision costs no extra work, checkpointing recomputes the forward of each
block, sharding adds communication), then the larger headroom; those that do not fit by their
total. Offloading is not computed (none of the options moves memory to the host).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Option", "fit_options"]

# the cost order among options that fit: a precision, then recomputation, then communication
_COST = {"precision": 0, "checkpoint": 1, "precision+checkpoint": 2, "fsdp": 3}


@dataclass(frozen=True)
class Option:
    """One change and what the step needs with it at the point."""

    kind: str               # "precision", "checkpoint", "precision+checkpoint", "fsdp"
    flags: str              # the command-line options that make it
    total: int | None       # the budget's total with it (bytes); None where it failed
    fits: bool
    headroom: float | None
    error: str | None = None

    def as_dict(self) -> dict:
        return {"change": self.flags, "kind": self.kind, "total": self.total, "fits": self.fits,
                "headroom": None if self.headroom is None else round(self.headroom, 6),
                **({"error": self.error} if self.error else {})}


def fit_options(analyze, model, inputs, config, strategy: dict, point: dict, budget_of,
                states: int, usable: int, progress=None) -> list[Option]:
    """The options (module docstring) for ``model`` at ``point``: ``analyze(model, inputs,
    config, **strategy)`` is the analysis under strategies, ``budget_of(report)`` the budget
    of a report at the point (on its worst rank), ``states`` the model states' bytes per rank
    now, ``usable`` the bytes the verdict allows. ``progress(text)`` says which option is
    traced."""
    from memsim.strategies import FSDP
    from memsim.tracer import Precision

    given = set(strategy)
    tries: list[tuple[str, str, dict, dict]] = []
    low = config.precision is Precision.TRUE32
    if low:
        tries.append(("precision", "--precision bf16-mixed",
                      {"precision": Precision.BF16_MIXED}, {}))
    if "checkpoint" not in given:
        tries.append(("checkpoint", "--checkpoint blocks", {}, {"checkpoint": "blocks"}))
        if low:
            tries.append(("precision+checkpoint", "--precision bf16-mixed --checkpoint blocks",
                          {"precision": Precision.BF16_MIXED}, {"checkpoint": "blocks"}))
    from memsim.tracer import progress as runs
    sharded = not given & {"fsdp", "zero", "ddp", "pp", "tp"}
    runs.expect(len(tries) + sharded)   # at least one run each (a sharded one traces ranks)
    out = []
    for kind, flags, step, extra in tries:
        out.append(_tried(analyze, model, inputs, config, strategy, kind, flags, step, extra,
                          budget_of, progress))
    if sharded:
        out += _sharded(analyze, model, inputs, config, strategy, budget_of, states, usable,
                        FSDP, progress)
    ok = [o for o in out if o.fits]
    ok.sort(key=lambda o: (_COST[o.kind], -(o.headroom or 0)))
    rest = [o for o in out if not o.fits]
    rest.sort(key=lambda o: (o.total is None, o.total or 0))
    return ok + rest


def _tried(analyze, model, inputs, config, strategy, kind, flags, step, extra, budget_of,
           progress) -> Option:
    from memsim.tracer import MemsimError

    if progress is not None:
        progress(flags)
    try:
        report = analyze(model, inputs, config.replace(**step) if step else config,
                         **{**strategy, **extra})
        b = budget_of(report)
    except MemsimError as e:   # the option does not apply to this model (no repeated blocks)
        return Option(kind, flags, None, False, None, error=e.message)
    return Option(kind, flags, b.total, b.fits, b.headroom)


def _sharded(analyze, model, inputs, config, strategy, budget_of, states, usable, FSDP,
             progress):
    """FSDP2 at the least power of two that the states' estimate allows, traced (and at twice
    that where it does not fit); nothing where even the whole device for the states alone
    leaves no room."""
    first = _tried(analyze, model, inputs, config, strategy, "fsdp", "--fsdp --dp 2", {},
                   {"fsdp": FSDP(dp=2)}, budget_of, progress)
    if first.fits or first.total is None:
        return [first]
    # the states shard; the rest of the step stays: the degree at which the states fit beside it
    rest = first.total - states / 2
    if rest >= usable:
        return [first]
    need = states / (usable - rest)
    dp = 2
    while dp < need and dp < 1024:
        dp *= 2
    if dp == 2:
        return [first]
    got = _tried(analyze, model, inputs, config, strategy, "fsdp", f"--fsdp --dp {dp}", {},
                 {"fsdp": FSDP(dp=dp)}, budget_of, progress)
    if not got.fits and got.total is not None and dp < 1024:
        got = _tried(analyze, model, inputs, config, strategy, "fsdp", f"--fsdp --dp {2 * dp}",
                     {}, {"fsdp": FSDP(dp=2 * dp)}, budget_of, progress)
    return [got]

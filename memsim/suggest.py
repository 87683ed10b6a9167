"""What would make a step fit that does not: each option traced at the point, not guessed.

When the verdict is DOES NOT FIT, the front door analyses the same model at the same point
with one change at a time, among those the configuration does not use yet:

- ``--precision bf16-mixed`` (from ``32-true``): activations in bf16 under autocast;
- ``--checkpoint blocks``: every repeated block recomputed in backward;
- both together;
- ``--fsdp --dp N``: FSDP2 at the least power of two ``N`` at which the model states, sharded,
  leave room for the rest of the step (estimated from the traced states, then traced at ``N``,
  and at ``2N`` where ``N`` does not fit);
- offload, on a CUDA device: ZeRO-Offload through DeepSpeed's engine (memsim.strategies.zero),
  the optimizer states, fp32 master partitions and gradient partitions in host memory:
  ``--zero 2 --dp 1 --offload optimizer`` on one device where no data parallelism is given
  (with ``--precision bf16-master``, DeepSpeed's bf16, in place of ``bf16-mixed``, which
  DeepSpeed does not run), ``--offload optimizer`` (stage 3: ``optimizer+params``) added to a
  ZeRO given without it. Not tried beside FSDP2, DDP, tensor or pipeline parallelism: FSDP2's
  ``CPUOffloadPolicy`` is not modelled, and ZeRO-Offload with tensor parallelism is not either.

Each option's total is the budget of that analysis (the same allocator replay and overheads as
the verdict's), on the rank with the largest peak. The options are listed best first: those
that fit before those that do not; among those that fit, the order of what each costs in a
real run (a lower precision costs no extra work, checkpointing recomputes the forward of each
block, sharding adds communication, offload moves every step's gradients and updated
parameters between host and device and steps the optimizer on the CPU), then the larger
headroom; those that do not fit by their total. On ``--device cpu`` host and device are one
memory, so offload is not listed there.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Option", "fit_options"]

# the cost order among options that fit: a precision, then recomputation, then communication
_COST = {"precision": 0, "checkpoint": 1, "precision+checkpoint": 2, "fsdp": 3, "offload": 4}


@dataclass(frozen=True)
class Option:
    """One change and what the step needs with it at the point."""

    kind: str               # "precision", "checkpoint", "precision+checkpoint", "fsdp",
    #                         "offload"
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
    offload = _offload(config, strategy)
    runs.expect(len(tries) + sharded + bool(offload))   # at least one run each
    out = []
    for kind, flags, step, extra in tries:
        out.append(_tried(analyze, model, inputs, config, strategy, kind, flags, step, extra,
                          budget_of, progress))
    if sharded:
        out += _sharded(analyze, model, inputs, config, strategy, budget_of, states, usable,
                        FSDP, progress)
    if offload:
        out.append(_tried(analyze, model, inputs, config, strategy, "offload", *offload,
                          budget_of, progress))
    ok = [o for o in out if o.fits]
    ok.sort(key=lambda o: (_COST[o.kind], -(o.headroom or 0)))
    rest = [o for o in out if not o.fits]
    rest.sort(key=lambda o: (o.total is None, o.total or 0))
    return ok + rest


def _offload(config, strategy: dict) -> tuple[str, dict, dict] | None:
    """ZeRO-Offload's ``(flags, step changes, strategies)`` for this configuration (module
    docstring), or None where it is not tried."""
    from dataclasses import replace

    from memsim.strategies import ZeRO
    from memsim.tracer import Precision

    if config.device != "cuda":
        return None
    zero = strategy.get("zero")
    if zero is not None:
        if zero.offloaded:
            return None
        params = zero.stage == 3
        return ("--offload optimizer+params" if params else "--offload optimizer", {},
                {"zero": replace(zero, offload_optimizer="cpu",
                                 offload_param="cpu" if params else None)})
    if set(strategy) & {"fsdp", "ddp", "tp", "pp"}:
        return None
    flags, step = "--zero 2 --dp 1 --offload optimizer", {}
    if config.precision is Precision.BF16_MIXED:
        flags, step = flags + " --precision bf16-master", {"precision": Precision.BF16_MASTER}
    return flags, step, {"zero": ZeRO(stage=2, dp=1, offload_optimizer="cpu")}


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

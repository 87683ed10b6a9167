"""What step is modelled: one frozen :class:`StepConfig`, validated once, passed down.

Everything that describes the *step* (not the model, not a parallel strategy) lives here: the
device whose kernels and allocator are modelled, the precision mode, the optimizer, the loss,
what the loop keeps referenced, gradient accumulation, ``torch.compile``, and the sizes the
symbolic run uses (example sizes) or may not exceed (the model's limits). Modes are Enums.

>>> cfg = StepConfig(device="cpu", precision="bf16-mixed", hints={"B": 4})
>>> cfg.device, cfg.precision, cfg.loop
(<Device.CPU: 'cpu'>, <Precision.BF16_MIXED: 'bf16-mixed'>, <Loop.KEEP: 'kept'>)
>>> cfg.keep_outputs, dict(cfg.hints)
(True, {'B': 4})
>>> StepConfig(device="tpu")
Traceback (most recent call last):
...
memsim.tracer.errors.InputError: unknown device 'tpu' (did you mean 'cpu'?)
  hint: use one of cuda, cpu
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .data_dependent import Bound, parse_assumptions
from .errors import InputError, did_you_mean
from .precision import Precision
from .records import Word


class Device(Word):
    """The device whose kernels and allocator are modelled (every run uses fake CPU tensors)."""

    CUDA = "cuda"
    CPU = "cpu"


class CpuIsa(Word):
    """The modelled CPU's instruction set, where PyTorch's CPU kernels differ by it (device
    ``"cpu"`` only; the machine memsim runs on never decides).

    ``avx512``: x86 with AVX-512 (BW, VL, DQ), or Arm with BF16: oneDNN runs bf16 kernels
    (``nn.LSTM`` in bf16 takes oneDNN's kernel). ``avx2``: x86 without AVX-512: no bf16 kernel
    in oneDNN (``nn.LSTM`` in bf16 takes PyTorch's native one, a loop over time steps)."""

    AVX512 = "avx512"
    AVX2 = "avx2"

    @classmethod
    def host(cls) -> "CpuIsa":
        """The instruction set PyTorch's kernels see on this machine (for comparisons with a
        real run here; ``ONEDNN_MAX_CPU_ISA=AVX2`` makes an AVX-512 machine answer ``avx2``)."""
        import torch

        return cls.AVX512 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else cls.AVX2


class Loop(Word):
    """What the training loop keeps referenced once the loss exists.

    ``kept``: the forward output stays referenced through ``backward()`` and ``optimizer.step()``
    (a plain ``out = model(x); loss = ...`` loop). ``dropped``: only the loss survives (Hugging
    Face's Trainer, TRL, Lightning, torchtune, torchtitan)."""

    KEEP = "kept"
    DROP = "dropped"


def _enum(cls, value, what: str):
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value))
    except ValueError:
        names = [m.value for m in cls]
        raise InputError(f"unknown {what} {value!r}" + did_you_mean(str(value), names),
                         hint=f"use one of {', '.join(names)}") from None


def _assignments(text: str, option: str) -> dict[str, int]:
    from .spec import parse_assignments
    return parse_assignments(text, option)


def _sizes(value, what: str) -> dict[str, int]:
    out = dict(value or {})
    for k, v in out.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"{what} {k}={v!r}: expected a symbol name and an int",
                             hint=f"e.g. {what}={{'S': 64}}")
    return out


@dataclass(frozen=True)
class CliOption:
    """How a :class:`StepConfig` field is given on the command line (the field's metadata
    ``"cli"``): the flag, its help, argparse keywords, and ``value``, which turns the parsed
    option into the field's value (identity by default). The command line adds one option per
    field that has it; the flag's default is the field's default."""

    flag: str
    help: str
    argparse: Mapping[str, Any] = field(default_factory=dict)
    value: Callable[[Any], Any] | None = None


def _cli(flag: str, help: str, *, value=None, **argparse) -> dict:
    return {"cli": CliOption(flag, help, argparse, value)}


def _hashable(value):
    return tuple(sorted(value.items())) if isinstance(value, Mapping) else value


@dataclass(frozen=True)
class StepConfig:
    """One training step (or inference forward) as the user runs it.

    Attributes
    ----------
    device : Device
        Whose kernels and allocator are modelled (``"cuda"`` default, ``"cpu"``).
    cpu_isa : CpuIsa
        With ``device="cpu"``, the CPU's instruction set (``"avx512"`` default, ``"avx2"``):
        where kernels differ by it, the modelled one decides, never the host's.
    precision : Precision
        A mode of :mod:`memsim.tracer.precision` (``"32-true"`` default).
    optimizer : str, callable or None
        A name of :mod:`memsim.tracer.optimizers` (checked here), or ``factory(params)``;
        None: AdamW with torch's defaults.
    loss_fn : callable or None
        ``loss_fn(output) -> scalar``; None: ``output.loss``, a scalar output, or the sum of the
        first floating-point tensor of the output.
    loop : Loop
        What the loop keeps referenced once the loss exists (``"kept"`` default).
    accumulate : int
        Micro-batches per optimizer step (gradient accumulation), >= 1.
    compiled : bool
        The step under ``torch.compile(model, fullgraph=True)`` (:mod:`memsim.tracer.compiled`).
    hints : mapping of str to int
        Example sizes for the symbolic run (distinct, >= 2; checked against the inputs' symbols
        when the trace starts).
    limits : mapping of str to int
        Upper bounds the model imposes on symbols (Hugging Face limits are found on their own).
    multiples : mapping of str to int
        Symbols traced at multiples of a step (``{"H": 32}``: an image of whole windows, where
        the model pads other sizes): the formulas hold at multiples of it, and a size that is
        not one is traced at that size when asked for. Swin's step is found on its own.
    fold : bool
        Trace a few blocks of a repeated stack and derive the rest, proven on the model itself
        (:mod:`memsim.tracer.fold`); False traces every block.
    data_dependent : Bound
        The value sizes that depend on tensor values are answered at
        (:mod:`memsim.tracer.data_dependent`): ``"max"`` (default: every element of a mask
        true), ``"balanced"``, or a fraction such as ``0.15``.
    assume : mapping of str to bool, int or float
        The value a tensor value the model reads in Python control flow takes, by the model's
        ``"file.py:LINE"`` (:mod:`memsim.tracer.data_dependent`); a truth value not given is
        tried both ways.
    """

    device: Device = field(default=Device.CUDA, metadata=_cli(
        "--device", "whose kernels to model (default cuda)",
        choices=tuple(d.value for d in Device)))
    cpu_isa: CpuIsa = field(default=CpuIsa.AVX512, metadata=_cli(
        "--cpu-isa", "with --device cpu, the modelled CPU's instruction set where kernels "
        "differ by it (bf16 nn.LSTM: oneDNN with AVX-512, PyTorch's native kernel without); "
        "default avx512, whatever the machine memsim runs on",
        choices=tuple(i.value for i in CpuIsa)))
    precision: Precision = field(default=Precision.TRUE32, metadata=_cli(
        "--precision", "32-true, bf16-mixed, 16-mixed, bf16-true, 16-true or bf16-master "
        "(default 32-true)"))
    optimizer: str | Callable | None = field(default=None, metadata=_cli(
        "--optimizer", "a torch.optim class, with its options as Python writes them "
        "('AdamW(foreach=False)', 'Adam(amsgrad=True)'), or lion, adamw8bit, paged_adamw8bit, "
        "lion8bit, sgd-momentum... (default AdamW; under --zero on --device cuda, DeepSpeed's "
        "FusedAdam)"))
    loss_fn: Callable | None = None
    loop: Loop = field(default=Loop.KEEP, metadata=_cli(
        "--drop-outputs", "the loop releases the forward output once the loss exists (Hugging "
        "Face's Trainer, Lightning, TRL, torchtune, torchtitan); default: kept through backward "
        "and the optimizer step, as a plain loop keeps it",
        value=lambda drop: Loop.DROP if drop else Loop.KEEP, action="store_true"))
    accumulate: int = field(default=1, metadata=_cli(
        "--accumulate", "micro-batches per optimizer step (gradient accumulation, default 1)",
        type=int, metavar="K"))
    compiled: bool = field(default=False, metadata=_cli(
        "--compiled", "the step under torch.compile(model, fullgraph=True): what Inductor's "
        "partitioner saves for backward, and its fusion (see docs/compiled.md)",
        action="store_true"))
    hints: Mapping[str, int] = field(default_factory=dict, metadata=_cli(
        "--hint", "example sizes for the symbolic run", metavar="S=64",
        value=lambda text: _assignments(text, "--hint")))
    limits: Mapping[str, int] = field(default_factory=dict)
    multiples: Mapping[str, int] = field(default_factory=dict, metadata=_cli(
        "--multiple-of", "trace a symbol at multiples of a step (an image of whole windows "
        "or patches, where the model pads other sizes): the formulas hold at its multiples, "
        "other sizes are traced when asked for", metavar="H=32",
        value=lambda text: _assignments(text, "--multiple-of")))
    fold: bool = field(default=True, metadata=_cli(
        "--no-fold", "trace every block of a repeated stack (by default a few are traced and "
        "the rest derived, proven on the model itself; see docs/performance.md)",
        value=lambda every: not every, action="store_true"))
    data_dependent: Bound = field(default=Bound(), metadata=_cli(
        "--data-dependent", "what a size that depends on tensor values (x[mask], nonzero, "
        "masked_select, unique) is answered at: max (default: every element of the mask true, "
        "an upper bound), balanced, or a fraction of the most such as 0.15",
        value=Bound.parse, metavar="max|balanced|F"))
    assume: Mapping[str, Any] = field(default_factory=dict, metadata=_cli(
        "--assume", "the value a tensor value read in Python control flow takes, at the "
        "model's line a note or an error names (by default a truth value is tried both ways)",
        metavar="FILE:LINE=VALUE", value=parse_assumptions))

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen)
        put("device", _enum(Device, self.device, "device"))
        put("cpu_isa", _enum(CpuIsa, self.cpu_isa, "cpu_isa"))
        put("precision", Precision.parse(self.precision))
        put("loop", _enum(Loop, self.loop, "loop"))
        if isinstance(self.optimizer, str):
            from .optimizers import lookup
            lookup(self.optimizer)  # an unknown name fails here, before any trace
        elif self.optimizer is not None and not callable(self.optimizer):
            raise InputError(f"optimizer={self.optimizer!r} is neither a name nor a factory",
                             hint="e.g. optimizer='adamw8bit' or optimizer=lambda ps: SGD(ps)")
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) \
                or self.accumulate < 1:
            raise InputError(f"accumulate={self.accumulate!r} must be an int >= 1",
                             hint="micro-batches per optimizer step")
        put("compiled", bool(self.compiled))
        put("fold", bool(self.fold))
        put("data_dependent", Bound.parse(self.data_dependent))
        put("assume", parse_assumptions(self.assume) if isinstance(self.assume, str)
            else dict(self.assume or {}))
        put("hints", _sizes(self.hints, "hints"))
        put("limits", _sizes(self.limits, "limits"))
        put("multiples", _sizes(self.multiples, "multiples"))
        for k, v in self.multiples.items():
            if v < 2:
                raise InputError(f"multiples {k}={v}: a step must be >= 2",
                                 hint=f"drop {k} to trace every size of it")

    def __hash__(self) -> int:
        # every field, mappings as sorted pairs: a new field is hashed without a change here
        return hash(tuple(_hashable(getattr(self, f.name)) for f in dataclasses.fields(self)))

    @classmethod
    def cli_options(cls) -> list[tuple[str, CliOption, Any]]:
        """``(field name, CliOption, default)`` of every field given on the command line,
        the default as the command line writes it (an enum's word, ``None`` for an empty
        mapping)."""
        out = []
        for f in dataclasses.fields(cls):
            opt = f.metadata.get("cli")
            if opt is None:
                continue
            default = f.default if f.default is not dataclasses.MISSING else None
            if opt.argparse.get("action") == "store_true":
                default = False
            out.append((f.name, opt, getattr(default, "value", default)))
        return out

    @classmethod
    def from_options(cls, opts) -> dict[str, Any]:
        """The fields the parsed command-line options ``opts`` give, by name (attributes named
        as argparse names each flag), not validated yet: a strategy may complete them."""
        out = {}
        for name, opt, _ in cls.cli_options():
            got = getattr(opts, opt.flag[2:].replace("-", "_"))
            if got is None:
                continue
            out[name] = opt.value(got) if opt.value else got
        return out

    @property
    def keep_outputs(self) -> bool:
        return self.loop is Loop.KEEP

    def replace(self, **changes: Any) -> "StepConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def fixing(self, fixed: Mapping[str, int]) -> "StepConfig":
        """The config for a trace with the symbols in ``fixed`` given as integers: their example
        sizes and limits no longer apply."""
        return self.replace(hints={k: v for k, v in self.hints.items() if k not in fixed},
                            limits={k: v for k, v in self.limits.items() if k not in fixed},
                            multiples={k: v for k, v in self.multiples.items()
                                       if k not in fixed})

    @classmethod
    def option_names(cls) -> list[str]:
        """The keyword options :meth:`of` takes: the fields and ``keep_outputs``."""
        return sorted({f.name for f in dataclasses.fields(cls)} | {"keep_outputs"})

    @classmethod
    def of(cls, config: "StepConfig | None" = None, **options: Any) -> "StepConfig":
        """``config`` (or the defaults) with keyword ``options``: the fields above, plus
        ``keep_outputs=True|False`` for ``loop``. Unknown names are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        if "keep_outputs" in options:
            keep = options.pop("keep_outputs")
            options["loop"] = Loop.KEEP if keep else Loop.DROP
        if config is not None and not isinstance(config, cls):
            raise InputError(f"config must be a StepConfig, got {type(config).__name__}",
                             hint="StepConfig(device='cpu', precision='bf16-mixed', ...)")
        unknown = [k for k in options if k not in names]
        if unknown:
            raise InputError(f"unknown option {unknown[0]!r}" + did_you_mean(
                unknown[0], sorted(names | {"keep_outputs"})),
                hint=f"step options: {', '.join(sorted(names | {'keep_outputs'}))}")
        options = {k: v for k, v in options.items() if v is not None or k in
                   ("optimizer", "loss_fn")}
        return (config or cls()).replace(**options) if options else (config or cls())

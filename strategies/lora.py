"""LoRA: low-rank adapters on frozen base weights, applied to the model before it is traced.

:func:`apply_lora` returns a copy of the model (on the meta device, nothing materialized) in
which every target layer ``y = base(x)`` becomes ``y = base(x) + B(A(dropout(x))) * alpha / r``
as Hugging Face peft computes it, and every parameter except the adapters is frozen
(``requires_grad=False``; peft's default ``bias="none"``). The memory then follows from the
trace, not from a rule: frozen weights get no gradient and no optimizer state, a frozen layer
whose input needs no gradient saves nothing for a weight gradient, and the adapters save their
own (B, S, r) intermediates.

Targets (``LoRA.targets``) are module-name patterns matched against the end of each module's
path (``"q_proj"`` matches ``model.layers.0.self_attn.q_proj``; ``"re:..."`` is a regular
expression on the whole path). The default ``"attention"`` takes every linear layer inside an
attention module (a module whose own name contains ``attn`` or ``attention``): q/k/v/o in
Llama, ``c_attn`` and ``c_proj`` in GPT-2. ``"all-linear"`` takes every linear layer except the
output head (peft's ``all-linear``).

>>> import torch
>>> class Attn(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.q_proj, self.o_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
...     def forward(self, x):
...         return self.o_proj(self.q_proj(x))
>>> net = torch.nn.Sequential(Attn(), torch.nn.Linear(8, 2))
>>> with torch.device("meta"):
...     m = apply_lora(net, LoRA(r=4))
>>> sorted(n for n, p in m.named_parameters() if p.requires_grad)
['0.o_proj.lora_A.weight', '0.o_proj.lora_B.weight', '0.q_proj.lora_A.weight', '0.q_proj.lora_B.weight']
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from memsim.tracer import StrategyError, UsageError

from .base import Strategy, register_strategy

__all__ = ["LoRA", "QLoRA", "LoRALayer", "LoRA4bitLayer", "NF4Linear", "apply_lora",
           "apply_qlora", "lora_targets", "parse_lora"]


@register_strategy
@dataclass(frozen=True)
class LoRA(Strategy):
    """LoRA settings (peft's ``LoraConfig`` names).

    r : int
        Rank of the adapters.
    alpha : float
        Scaling numerator (the update is scaled by ``alpha / r``); default ``2 * r``.
    dropout : float
        Dropout on the adapter's input (peft's ``lora_dropout``); > 0 keeps a mask.
    targets : tuple of str or str
        ``"attention"`` (default), ``"all-linear"``, or module-name patterns.
    """

    key: ClassVar[str] = "lora"
    order: ClassVar[int] = 10
    flags: ClassVar[tuple[str, ...]] = ("--lora", "--qlora")
    r: int = 8
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] | str = "attention"

    @classmethod
    def add_options(cls, group) -> None:
        group.add_argument("--lora", metavar="r=16,...", help="LoRA: r, alpha, dropout, targets")
        group.add_argument("--qlora", metavar="r=16,...",
                           help="QLoRA (NF4 base, bitsandbytes): r, alpha, dropout, targets, "
                                "compute (default bfloat16)")

    @classmethod
    def from_options(cls, opts, step):
        if opts.lora and opts.qlora:
            raise UsageError("--lora and --qlora both given", hint="QLoRA is LoRA on a 4-bit base")
        if opts.lora:
            return parse_lora(opts.lora)
        return parse_lora(opts.qlora, QLoRA) if opts.qlora else None

    @classmethod
    def summary(cls, d) -> str:
        return ("QLoRA (NF4)" if "compute_dtype" in d else "LoRA") + f" r={d['r']}"

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r < 1:
            raise StrategyError(f"LoRA rank r={self.r!r} must be an int >= 1",
                                hint="e.g. LoRA(r=16) or --lora r=16")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise StrategyError(f"LoRA dropout={self.dropout!r} must be in [0, 1)")
        if isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else 2 * self.r) / self.r

    def apply(self, plan):
        """Adapters on a copy of the model before tracing (frozen base, trainable adapters)."""
        return plan.but(model=apply_lora(plan.model, self))


def _in_out(mod: torch.nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a linear layer: ``nn.Linear`` or HF's GPT-2 ``Conv1D``
    (weight stored as (in, out))."""
    if isinstance(mod, torch.nn.Linear):
        return mod.in_features, mod.out_features
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "weight"):
        return mod.weight.shape[0], mod.nf
    return None


class LoRALayer(torch.nn.Module):
    """``base(x) + lora_B(lora_A(dropout(x))) * scaling``, with ``base`` frozen."""

    def __init__(self, base: torch.nn.Module, r: int, scaling: float, dropout: float,
                 like: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        w = base.weight if like is None else like
        fan_in, fan_out = w.shape[1], w.shape[0]
        if type(base).__name__ == "Conv1D":
            fan_in, fan_out = fan_out, fan_in
        dtype = dtype or w.dtype
        self.base_layer = base
        self.lora_A = torch.nn.Linear(fan_in, r, bias=False, device=w.device, dtype=dtype)
        self.lora_B = torch.nn.Linear(r, fan_out, bias=False, device=w.device, dtype=dtype)
        self.lora_dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.scaling = scaling

    def forward(self, x):
        out = self.base_layer(x)
        dt = self.lora_A.weight.dtype
        if x.dtype == dt:
            return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        # peft casts the input to the adapters' dtype (fp32 adapters on a 16-bit or 4-bit
        # base) and the sum back to the base output's dtype
        res = out + self.lora_B(self.lora_A(self.lora_dropout(x.to(dt)))) * self.scaling
        return res.to(out.dtype)


class LoRAReadLayer(LoRALayer):
    """An adapter on a layer its parent reads by its weight and bias instead of calling it
    (``nn.MultiheadAttention`` passes ``out_proj.weight`` to its functional form: SigLIP's
    pooling head): they are the base's, as peft's tuner layers give them, so the parent runs
    on the base and the adapter gets no gradient. Only there: DeepSpeed's AutoTP replaces any
    module with a 2-D ``weight`` whole, adapters and all."""

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias


class LoRA4bitLayer(LoRALayer):
    """peft's ``lora.Linear4bit`` forward on a 4-bit base: the base output cloned (peft clones
    it "defensively" before adding to it), the adapters' output cast to its dtype, then added."""

    def forward(self, x):
        result = self.base_layer(x).clone()
        dt = self.lora_A.weight.dtype
        x = x if x.dtype == dt else x.to(dt)
        # one expression: the adapter's unscaled output is freed before the sum, as in peft
        return result + (self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling).to(
            result.dtype)


def _head_names(model: torch.nn.Module) -> set[str]:
    """The output head(s): a linear layer whose weight is tied to an embedding, or whose output
    size is an embedding's vocabulary (``lm_head``)."""
    emb = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    vocab = {m.num_embeddings for m in emb}
    tied = {id(m.weight) for m in emb}
    out = set()
    for name, mod in model.named_modules():
        io = _in_out(mod)
        if io and (id(mod.weight) in tied or io[1] in vocab):
            out.add(name)
    return out


def lora_targets(model: torch.nn.Module, targets) -> list[str]:
    """Paths of the modules ``targets`` selects (see the module docstring)."""
    linear = [n for n, m in model.named_modules() if _in_out(m) is not None and n]
    if targets == "attention":
        mods = dict(model.named_modules())

        def is_attn(path: str) -> bool:
            words = (path.rsplit(".", 1)[-1], type(mods[path]).__name__)
            return any("attn" in w.lower() or "attention" in w.lower() for w in words)

        parts = lambda n: [".".join(n.split(".")[:i]) for i in range(1, n.count(".") + 1)]
        found = [n for n in linear if any(is_attn(a) for a in parts(n))]
        if not found:
            raise StrategyError(
                "LoRA targets 'attention': no linear layer inside a module named (or of a "
                "class named) *attn* or *attention*", hint="name the target modules, e.g. targets=('q_proj', 'v_proj')"
                " or --lora r=8,targets=q_proj+v_proj, or use 'all-linear'")
        return found
    if targets == "all-linear":
        heads = _head_names(model)
        return [n for n in linear if n not in heads]
    if isinstance(targets, str):
        targets = (targets,)
    out = []
    for pat in targets:
        if pat.startswith("re:"):
            rx = re.compile(pat[3:])
            hit = [n for n in linear if rx.fullmatch(n)]
        else:
            hit = [n for n in linear if n == pat or n.endswith("." + pat)]
        if not hit:
            near = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise StrategyError(f"LoRA target {pat!r} matches no linear layer of the model",
                                hint=f"linear layer names: {', '.join(near[:20])}")
        out.extend(h for h in hit if h not in out)
    return out


def apply_lora(model: torch.nn.Module, lora: LoRA) -> torch.nn.Module:
    """A copy of ``model`` with LoRA adapters on the targets and everything else frozen.

    The copy shares nothing with ``model``; on the meta device it costs no memory.
    """
    m = copy.deepcopy(model)
    names = lora_targets(m, lora.targets)
    for p in m.parameters():
        p.requires_grad_(False)
    mods = dict(m.named_modules())
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = mods[parent_name] if parent_name else m
        layer = LoRAReadLayer if isinstance(parent, torch.nn.MultiheadAttention) else LoRALayer
        setattr(parent, child, layer(mods[name], lora.r, lora.scaling, lora.dropout))
    return m


def parse_lora(text: str, cls=None) -> LoRA:
    """``r=16,alpha=32,dropout=0.05,targets=q_proj+v_proj`` (``--lora`` on the command line);
    with ``cls=QLoRA`` (``--qlora``) also ``compute=bfloat16``."""
    cls = cls or LoRA
    flag = "--qlora" if cls is not LoRA else "--lora"
    kw: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, val = part.partition("=")
        if not eq:
            raise UsageError(f"{flag} {text!r}: expected key=value, got {part!r}",
                             hint="e.g. --lora r=16,alpha=32,targets=q_proj+v_proj")
        key = key.strip()
        keys = ("r", "alpha", "dropout", "targets") + (("compute",) if cls is not LoRA else ())
        if key not in keys:
            raise UsageError(f"{flag}: unknown key {key!r}", hint=f"keys: {', '.join(keys)}")
        if key == "compute":
            if not isinstance(getattr(torch, val, None), torch.dtype):
                raise UsageError(f"{flag} compute={val!r}: not a torch dtype",
                                 hint="e.g. compute=bfloat16")
            kw["compute_dtype"] = val
            continue
        if key == "targets":
            kw[key] = val if val in ("attention", "all-linear") else tuple(val.split("+"))
            continue
        try:
            kw[key] = int(val) if key == "r" else float(val)
        except ValueError as e:
            raise UsageError(f"{flag} {key}={val!r}: not a number") from e
    return cls(**kw)


# -- QLoRA ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QLoRA(LoRA):
    """LoRA on a base model whose linear layers (all but the output head) are stored in 4-bit
    NF4 as bitsandbytes stores them (``Linear4bit``, ``quant_type="nf4"``): packed weights
    (one byte per two weights), an absmax per ``blocksize`` weights (uint8 with double
    quantization, whose own absmax per 256 blocks, 256-entry code and offset are fp32), a
    16-entry NF4 code; the forward computes in ``compute_dtype`` through bitsandbytes'
    ``matmul_4bit`` (its fake kernels give the dequantized weight and output sizes).
    """

    compute_dtype: str = "bfloat16"
    blocksize: int = 64
    double_quant: bool = True

    def apply(self, plan):
        """The base in NF4, adapters on the targets, on a copy of the model before tracing."""
        return plan.but(model=apply_qlora(plan.model, self))


class NF4Linear(torch.nn.Module):
    """A frozen linear layer held as bitsandbytes NF4 tensors (buffers, so they are counted).

    Its forward is ``bitsandbytes.nn.Linear4bit``'s training path: cast the input to
    ``compute_dtype``, ``bnb.matmul_4bit(x, weight, bias, quant_state)``, cast back.
    """

    def __init__(self, base: torch.nn.Module, q: QLoRA):
        super().__init__()
        fan_in, fan_out = _in_out(base)
        n = fan_in * fan_out
        dev = base.weight.device
        blocks = -(-n // q.blocksize)
        self.in_features, self.out_features = fan_in, fan_out
        self.blocksize, self.double_quant = q.blocksize, q.double_quant
        self.compute_dtype = getattr(torch, q.compute_dtype)
        self.orig_dtype = base.weight.dtype
        u8, f32 = torch.uint8, torch.float32
        # the packed weight is a frozen parameter, as bitsandbytes' Params4bit; the
        # quantization state is buffers (bitsandbytes keeps them in a QuantState object)
        self.weight = torch.nn.Parameter(torch.empty(((n + 1) // 2, 1), dtype=u8, device=dev),
                                         requires_grad=False)
        self.register_buffer("code", torch.empty(16, dtype=f32, device=dev))
        if q.double_quant:
            self.register_buffer("absmax", torch.empty(blocks, dtype=u8, device=dev))
            self.register_buffer("absmax2", torch.empty(-(-blocks // 256), dtype=f32,
                                                        device=dev))
            self.register_buffer("code2", torch.empty(256, dtype=f32, device=dev))
            self.register_buffer("offset", torch.empty((), dtype=f32, device=dev))
        else:
            self.register_buffer("absmax", torch.empty(blocks, dtype=f32, device=dev))
        # bitsandbytes casts the bias to compute_dtype in place on the first forward
        # (``bias.data = bias.data.to(x.dtype)``): from then on it is held in that dtype
        bias = getattr(base, "bias", None)
        self.bias = None if bias is None else torch.nn.Parameter(
            bias.detach().to(self.compute_dtype), requires_grad=False)

    def quant_state(self):
        import bitsandbytes.functional as bf

        state2 = None
        if self.double_quant:
            state2 = bf.QuantState(absmax=self.absmax2, code=self.code2, blocksize=256,
                                   dtype=torch.float32)
        return bf.QuantState(
            absmax=self.absmax, shape=torch.Size((self.out_features, self.in_features)),
            code=self.code, blocksize=self.blocksize, quant_type="nf4", dtype=self.orig_dtype,
            offset=self.offset if self.double_quant else None, state2=state2)

    def forward(self, x):
        import bitsandbytes as bnb

        inp = x.dtype
        x = x.to(self.compute_dtype)
        return bnb.matmul_4bit(x, self.weight, bias=self.bias,
                               quant_state=self.quant_state()).to(inp)


def apply_qlora(model: torch.nn.Module, q: QLoRA) -> torch.nn.Module:
    """A copy of ``model``: every linear layer but the head in NF4 (:class:`NF4Linear`), LoRA
    adapters (in ``compute_dtype``) on the targets, everything else frozen."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise StrategyError("QLoRA needs bitsandbytes", hint="pip install bitsandbytes") from e
    m = copy.deepcopy(model)
    targets = set(lora_targets(m, q.targets))
    heads = _head_names(m)
    for p in m.parameters():
        p.requires_grad_(False)
    mods = dict(m.named_modules())
    for name, mod in list(mods.items()):
        if not name or _in_out(mod) is None or name in heads:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = mods[parent_name] if parent_name else m
        layer: torch.nn.Module = NF4Linear(mod, q)
        if name in targets:
            # adapters in fp32, peft's default (autocast_adapter_dtype=True)
            layer = LoRA4bitLayer(layer, q.r, q.scaling, q.dropout, like=mod.weight,
                                  dtype=torch.float32)
        setattr(parent, child, layer)
    return m

"""Precision modes, traced (not assumed): the names PyTorch Lightning users know, plus one.

========================  =================================================================
``32-true``               fp32 parameters, activations, gradients, optimizer states
``bf16-mixed``            fp32 parameters; forward and loss under ``torch.autocast`` (bf16):
                          the casted weight copies and bf16 activations autocast creates
``16-mixed``              as ``bf16-mixed`` with fp16, plus ``torch.amp.GradScaler``
``bf16-true``             parameters (and floating inputs) in bf16: gradients and optimizer
                          states follow (torch.optim keeps states in the parameter dtype)
``16-true``               the same in fp16
``bf16-master``           bf16 parameters and gradients, fp32 master weights, fp32 gradient
                          copies and fp32 optimizer states: the Megatron / DeepSpeed bf16
                          layout (2 + 2 + 4 + 4 + 8 bytes per parameter with AdamW)
========================  =================================================================

Every run is on fake CPU tensors (a CPU build cannot run autograd on fake CUDA tensors), so
autocast runs as CPU autocast. Where CUDA's autocast policy differs from the CPU's in a way that
changes memory, :class:`CudaAutocastPolicy` applies CUDA's rule when ``--device cuda``: norms
(``layer_norm``, ``group_norm``, ``rms_norm``) and the fp32-list math ops (``exp``, ``log``,
``pow``, ``rsqrt``, ``logsumexp``...) get fp32 copies of low-precision inputs and return fp32;
``softmax``, ``log_softmax``, ``sum``, ``cumsum``, ``prod``, ``norm`` return fp32 (CUDA's
"fp32 with output dtype" rule). Known difference: CUDA's fp16 softmax reads half and writes float
without a copy; the CPU kernel makes a transient fp32 copy of the input, which is counted here.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .errors import InputError, did_you_mean
from .records import Word
from .rules import Kind, keys, lookup, register

_ALIASES = {"32": "32-true", "fp32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed",
            "fp16-mixed": "16-mixed", "amp": "16-mixed", "fp16-true": "16-true",
            "bf16-true-master": "bf16-master"}


class Precision(Word):
    """A precision mode (see the module docstring); its value is the Lightning-style name.

    >>> Precision.parse("bf16"), Precision.BF16_MASTER.param_dtype
    (<Precision.BF16_MIXED: 'bf16-mixed'>, torch.bfloat16)
    """

    TRUE32 = "32-true"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "16-mixed"
    BF16_TRUE = "bf16-true"
    FP16_TRUE = "16-true"
    BF16_MASTER = "bf16-master"

    @classmethod
    def parse(cls, name: "str | Precision | None") -> "Precision":
        """The mode for a name or alias (``None``: ``32-true``); unknown names are an error."""
        if isinstance(name, cls):
            return name
        key = _ALIASES.get(str(name or "32-true"), str(name or "32-true"))
        try:
            return cls(key)
        except ValueError:
            names = [m.value for m in cls]
            raise InputError(f"unknown precision {name!r}" + did_you_mean(str(name), names),
                             hint=f"use one of {', '.join(names)}") from None

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the model's floating parameters."""
        return {Precision.BF16_TRUE: torch.bfloat16, Precision.FP16_TRUE: torch.float16,
                Precision.BF16_MASTER: torch.bfloat16}.get(self, torch.float32)

    @property
    def autocast(self) -> torch.dtype | None:
        """autocast dtype for forward + loss, or None."""
        return {Precision.BF16_MIXED: torch.bfloat16,
                Precision.FP16_MIXED: torch.float16}.get(self)

    @property
    def scaler(self) -> bool:
        """``torch.amp.GradScaler`` around backward and step."""
        return self is Precision.FP16_MIXED

    @property
    def master(self) -> bool:
        """fp32 master weights in the optimizer."""
        return self is Precision.BF16_MASTER

    @property
    def low(self) -> torch.dtype | None:
        return self.autocast or (self.param_dtype if self.param_dtype != torch.float32 else None)


class MasterWeights(torch.optim.Optimizer):
    """An optimizer over fp32 master copies of low-precision parameters.

    ``step``: each parameter's gradient is copied into a persistent fp32 gradient buffer, the
    inner optimizer (built by ``inner(masters)``) steps the fp32 masters, and the result is
    copied back into the parameter in place. The masters and the fp32 gradient buffers exist
    from construction on, as in DeepSpeed's BF16 optimizer and Megatron's distributed optimizer
    (their fp32 ``main_grad`` buffers).
    """

    def __init__(self, params, inner):
        params = list(params)
        super().__init__(params, {})
        self.masters = [p.detach().to(torch.float32) for p in params]
        self.main_grads = [torch.zeros_like(m) for m in self.masters]
        self._pairs = list(zip(params, self.masters, self.main_grads))
        self.inner = inner([torch.nn.Parameter(m, requires_grad=False) for m in self.masters])
        self._inner_params = [p for g in self.inner.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        for (p, _m, g), ip in zip(self._pairs, self._inner_params):
            if p.grad is None:
                continue
            g.copy_(p.grad)
            ip.grad = g
        self.inner.step()
        for (p, _m, _g), ip in zip(self._pairs, self._inner_params):
            p.copy_(ip)
        for ip in self._inner_params:
            ip.grad = None

    def state_tensors(self):
        """Every tensor this optimizer holds: masters, fp32 gradients, the inner state."""
        yield from self._inner_params
        yield from self.main_grads
        for st in self.inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    yield v


def wrap_optimizer(prec: Precision, factory):
    """The optimizer factory for ``prec``: ``factory`` itself, or wrapped in master weights."""
    if not prec.master:
        return factory
    return lambda params: MasterWeights(params, factory)


# CUDA's autocast policy where it differs from the CPU's (c10's autocast_mode.cpp lists):
# "fp32": low-precision inputs are cast to fp32 first; "fp32_out": the result is fp32.
_FP32 = [F.layer_norm, F.group_norm, torch.layer_norm, torch.group_norm, torch.exp,
         torch.Tensor.exp, torch.log, torch.Tensor.log, torch.pow, torch.Tensor.pow,
         torch.Tensor.__pow__, torch.rsqrt, torch.Tensor.rsqrt, torch.logsumexp,
         torch.Tensor.logsumexp, torch.expm1, torch.log1p, torch.reciprocal, F.softplus,
         F.kl_div, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.mse_loss, F.cosine_similarity]
if hasattr(F, "rms_norm"):
    _FP32.append(F.rms_norm)
_FP32_OUT = [F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
             torch.Tensor.log_softmax, torch.sum, torch.Tensor.sum, torch.cumsum,
             torch.Tensor.cumsum, torch.prod, torch.Tensor.prod]
for _f in _FP32:
    register(Kind.AUTOCAST, _f, "fp32", device="cuda",
             doc="CUDA autocast's fp32 list: low-precision inputs cast to fp32")
for _f in _FP32_OUT:
    register(Kind.AUTOCAST, _f, "fp32_out", device="cuda",
             doc="CUDA autocast's fp32-with-output-dtype rule: the result is fp32")
_LOW = (torch.bfloat16, torch.float16)


def _is_low(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _LOW


class CudaAutocastPolicy(TorchFunctionMode):
    """Inside CPU autocast: the ops whose CUDA autocast rule differs (``autocast`` entries of
    :mod:`memsim.tracer.rules`) run by CUDA's rule."""

    def __init__(self):
        super().__init__()
        self._keys = keys(Kind.AUTOCAST, "cuda")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cpu") or func not in self._keys:
            return func(*args, **kwargs)
        policy = lookup(Kind.AUTOCAST, func, "cuda").value
        if policy == "fp32" and any(_is_low(a) for a in (*args, *kwargs.values())):
            cast = lambda a: a.float() if _is_low(a) else a  # noqa: E731
            with torch.autocast("cpu", enabled=False):
                return func(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})
        if (policy == "fp32_out" and args and _is_low(args[0]) and len(args) <= 2
                and kwargs.get("dtype") is None):
            with torch.autocast("cpu", enabled=False):
                return func(*args, **{**kwargs, "dtype": torch.float32})
        return func(*args, **kwargs)


@contextlib.contextmanager
def forward_context(prec: Precision):
    """Autocast for forward + loss, or nothing."""
    if prec.autocast is None:
        yield
        return
    with torch.autocast("cpu", dtype=prec.autocast):
        yield


@contextlib.contextmanager
def step_context(prec: Precision, device: str):
    """For the whole step: CUDA's autocast policy wherever CPU autocast is on (forward, and
    the forward that activation checkpointing recomputes during backward)."""
    if prec.autocast is None or device != "cuda":
        yield
        return
    with CudaAutocastPolicy():
        yield

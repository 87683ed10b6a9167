"""The optimizer in the symbolic step: which one is built (:func:`optimizer_factory`), the
implementation torch picks for the modelled device, the state a previous step made
(:func:`warm_up`), and none for a parameter the step gives no gradient.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor

from .records import Category
from .recorder import Recorder

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def default_optimizer(device: str) -> OptimizerFactory:
    """AdamW with torch's defaults (torch picks for-loop on CPU, foreach on CUDA)."""
    return lambda params: torch.optim.AdamW(params)


def optimizer_factory(config) -> OptimizerFactory:
    """The optimizer ``config`` names (:mod:`memsim.tracer.optimizers`) or gives, AdamW with
    torch's defaults when none."""
    opt = config.optimizer
    if opt is None:
        return default_optimizer(config.device)
    if not isinstance(opt, str):
        return opt
    from .optimizers import lookup
    entry = lookup(opt)

    def make(params):
        made = entry.factory(params)
        made._memsim_host_state = entry.host_state
        return made

    return make


@contextlib.contextmanager
def optimizer_defaults_for(device: str):
    """Make torch.optim pick its implementation as it would on ``device``.

    torch picks foreach kernels only for ``type(p) in (Tensor, Parameter)`` on CUDA-like
    devices; the fake parameters are ``FakeTensor`` on the CPU. Both checks are widened for the
    run (and restored after), so that the choice is torch's own for the modelled device.
    """
    from torch.optim import optimizer as _opt

    types = _opt._foreach_supported_types
    types.append(FakeTensor)
    orig = _opt._get_foreach_kernels_supported_devices
    if device == "cuda":
        _opt._get_foreach_kernels_supported_devices = lambda: [*orig(), "cpu"]
    try:
        yield
    finally:
        types.remove(FakeTensor)
        _opt._get_foreach_kernels_supported_devices = orig


def warm_up(recorder: Recorder, opt: torch.optim.Optimizer, trainable: list,
            device: str, scaler=None, names: dict | None = None) -> dict[int, list[int]]:
    """Create the optimizer state as a previous step would have, and that step's gradients;
    returns the storage ids of each parameter's (``id(parameter) ->``) gradient and state.

    On CUDA, torch.optim keeps scalar ``step`` counters on the host unless the optimizer is
    ``capturable`` or ``fused``: those are marked as host memory. Master-weight optimizers
    (:class:`memsim.tracer.precision.MasterWeights`) hold fp32 masters (optimizer state) and fp32
    gradient buffers (gradients). A GradScaler's scale and growth tracker are optimizer state.
    ``names`` (``id(parameter) -> name``) records whose state and gradients they are
    (:attr:`memsim.tracer.RunRecord.owners`).
    """
    from .precision import MasterWeights

    if scaler is not None:
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        for name in ("_scale", "_growth_tracker"):
            t = getattr(scaler, name)
            recorder.register(t, f"<grad_scaler.{name}>", Category.OPTIMIZER_STATE)
            recorder.set_category(t, Category.OPTIMIZER_STATE)
    if isinstance(opt, MasterWeights):
        for i, m in enumerate(opt.masters):
            recorder.register(m, f"<master.{i}>", Category.OPTIMIZER_STATE)
            recorder.own(m, (names or {}).get(id(trainable[i])))
        for i, g in enumerate(opt.main_grads):
            recorder.register(g, f"<main_grad.{i}>", Category.GRADIENT)
            recorder.own(g, (names or {}).get(id(trainable[i])))
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    owned: dict[int, list[int]] = {}  # id(parameter) -> its warm-up gradient and state
    for p in trainable:
        recorder.set_category(p.grad, Category.GRADIENT)
        recorder.own(p.grad, (names or {}).get(id(p)))
        owned[id(p)] = [recorder.sid_of(p.grad)]
    inner = opt.inner if isinstance(opt, MasterWeights) else opt
    # master weights: the inner optimizer's parameters stand for the model's (masters and
    # fp32 gradient buffers exist for every parameter from construction on)
    of = ({id(ip): p for (p, _m, _g), ip in zip(opt._pairs, opt._inner_params)}
          if isinstance(opt, MasterWeights) else {})
    on_device_steps = any(g.get("capturable") or g.get("fused") for g in inner.param_groups)
    paged = getattr(inner, "_memsim_host_state", None) if device == "cuda" else None
    for p, state in inner.state.items():
        mine = owned.setdefault(id(of.get(id(p), p)), [])
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                recorder.set_category(v, Category.OPTIMIZER_STATE)
                recorder.own(v, (names or {}).get(id(p)))
                mine.append(recorder.sid_of(v))
                if (paged is not None and paged(p, k)) or (
                        device == "cuda" and k == "step" and v.dim() == 0
                        and not on_device_steps):
                    recorder.set_host(v)
    return owned


def never_stepped(recorder: Recorder, trainable: list, owned: dict) -> None:
    """A trainable parameter that gets no gradient in the step (a module the forward never
    calls: wav2vec2's ``masked_spec_embed`` without SpecAugment) never has one in a real loop:
    ``zero_grad`` leaves it None, and the optimizer never makes its state. The synthetic
    warm-up (:func:`warm_up`) gave it a gradient and state; they are zero bytes."""
    unused = {id(p) for p in trainable if p.grad is None and id(p) not in recorder.accumulated}
    if not unused:
        return
    kept = {sid for p in trainable if id(p) not in unused for sid in owned.get(id(p), ())}
    for i in unused:
        for sid in owned.get(i, ()):
            if sid is not None and sid not in kept:
                recorder.run.storages[sid].nbytes = sympy.Integer(0)

"""What a symbolic run enters around the step (:mod:`memsim.tracer.step`): the fake mode, the
model's fake parameters, the fake symbolic inputs, the device's kernel and optimizer choices, and
the recording (the recorder, the module stack, the model's own autocast and warnings).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from . import fake_cache, known, progress
from .data_dependent import bounded, decisions
from .errors import InputError
from .functions import function_rules
from .optimizer_state import optimizer_defaults_for
from .precision import step_context
from .recompute import modes_in_recompute
from .records import Category
from .recorder import Recorder, patched
from .spec import TensorSpec


@dataclass
class SymbolTable:
    """The input symbols of one run: user name -> raw ShapeEnv symbol, and the example hints."""

    raw: dict[str, sympy.Symbol]
    hints: dict[str, int]
    steps: dict[str, int] = field(default_factory=dict)   # the run's symbol counts steps


def enter_run(stack: contextlib.ExitStack, recorder: Recorder, model, specs, config, hints,
              train: bool, transform, driver, patches):
    """Enter the run's modes (the fake mode, fake parameters, the device's kernel choices) and
    build the fake symbolic inputs; returns ``(inputs, symbols)``."""
    prec = config.precision
    low = prec.param_dtype if prec.param_dtype != torch.float32 else None  # *-true: cast
    if driver is not None:
        driver.prepare(model, recorder)
        stack.enter_context(driver.context())
        recorder.scalar_hook = driver.scalar
        # host memory is apart from the device's only on a GPU (on the CPU it is all one)
        recorder.host_device = driver.host_device if config.device == "cuda" else None
    mode = FakeTensorMode(shape_env=recorder.shape_env, allow_non_fake_inputs=True)
    fake_cache.apply_policy(stack, mode, driven=driver is not None)
    stack.enter_context(mode)
    stack.enter_context(_quiet_fake_kernels())
    stack.enter_context(_module_to_in_place())
    # with a driver the engine casts the model itself (float inputs are made in its dtype)
    stack.enter_context(fake_module(model, "cpu", None if driver is not None
                                    and not driver.precision_ok else low))
    stack.enter_context(optimizer_defaults_for(config.device))
    stack.enter_context(modes_in_recompute(recorder))
    stack.enter_context(function_rules(config.device, config.cpu_isa))
    stack.enter_context(bounded(config.data_dependent))
    stack.enter_context(decisions(config.assume))
    if patches is not None:
        stack.enter_context(patches(model))
    if transform is not None:
        transform(model)
    return make_inputs(specs, recorder.shape_env, hints,
                       driver.device if driver is not None else "cpu", low, config.multiples)


def make_inputs(specs: list[TensorSpec], shape_env: ShapeEnv, hints: dict[str, int],
                device: str, float_dtype: torch.dtype | None = None,
                multiples: dict[str, int] | None = None
                ) -> tuple[dict[str, torch.Tensor], SymbolTable]:
    """Create fake input tensors with one ShapeEnv symbol per user symbol name (floating
    inputs in ``float_dtype`` when given, as Lightning's ``*-true`` precisions convert them).
    A symbol with a step in ``multiples`` is that step times the run's symbol (its number of
    steps): the model's padding to whole steps is then zero for the run, not a remainder."""
    from torch._dynamo.source import ConstantSource

    raw: dict[str, sympy.Symbol] = {}
    symints: dict[str, torch.SymInt] = {}
    for spec in specs:
        for name in spec.symbols:
            if name in symints:
                continue
            src = ConstantSource(f"memsim_{name}")
            step = (multiples or {}).get(name, 1)
            hint = hints[name] // step
            expr = shape_env.create_symbol(hint, src, dynamic_dim=DimDynamic.DYNAMIC)
            raw[name] = expr
            symints[name] = shape_env.create_symintnode(expr, hint=hint, source=src)
            if step > 1:
                symints[name] = symints[name] * step
    tensors = {}
    for spec in specs:
        shape = [symints[d] if isinstance(d, str) else d for d in spec.shape]
        dt = float_dtype if float_dtype is not None and spec.dtype.is_floating_point else spec.dtype
        tensors[spec.name] = torch.empty(shape, dtype=dt, device=device)
        if spec.fill == "ones":
            known.mark(tensors[spec.name])
    return tensors, SymbolTable(raw, dict(hints), dict(multiples or {}))


@contextlib.contextmanager
def fake_module(model: torch.nn.Module, device: str, dtype: torch.dtype | None = None):
    """Swap every parameter and buffer of ``model`` for a fake one on ``device``; restore after.

    Must be entered inside the ``FakeTensorMode``. Tied parameters stay tied. ``dtype`` casts
    the floating ones, as ``model.to(dtype)`` would.
    """
    saved: list[tuple[dict, str, Any]] = []
    memo: dict[int, torch.Tensor] = {}
    try:
        for mod in model.modules():
            for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    saved.append((table, name, t))
                    if id(t) not in memo:
                        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
                        new = torch.empty(t.shape, dtype=dt, device=device)
                        if is_param:
                            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                        memo[id(t)] = new
                    table[name] = memo[id(t)]
        # the module holds its fake tensors; nothing else may keep them alive (not this frame,
        # suspended while the run goes on: a strategy that replaces the parameters in the run,
        # a pipeline rank's FSDP2, frees the old ones)
        memo.clear()
        new = t = None
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t


def _module_to_in_place():
    """``module.to(...)`` that changes no parameter or buffer returns the module, as eager
    PyTorch's ``_apply`` leaves such tensors as they are (``param.data = param``). On fake
    parameters PyTorch swaps every tensor instead, which fails where the run holds a weak
    reference to it (memsim's recorder does): Switch Transformers' router calls
    ``self.classifier.to(self.dtype)`` in its forward."""
    def in_place(orig):
        def to(self, *args, **kwargs):
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            if memory_format is None and all(
                    (dtype is None or not (t.is_floating_point() or t.is_complex())
                     or t.dtype == dtype) and (device is None or t.device == device)
                    for t in list(self.parameters()) + list(self.buffers())):
                return self
            return orig(self, *args, **kwargs)
        return to

    return patched(torch.nn.Module, "to", in_place)


@contextlib.contextmanager
def _quiet_fake_kernels():
    """PyTorch logs every failing meta kernel with its traceback at ERROR level
    (``torch._subclasses.fake_tensor``); the failure itself comes back as memsim's typed error
    (or the run is retried at other sizes), so the log stays quiet during the run."""
    import logging
    log = logging.getLogger("torch._subclasses.fake_tensor")
    was = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = was


def start_recording(stack: contextlib.ExitStack, recorder: Recorder, model, inputs: dict,
                    config) -> None:
    """Start recording: the recorder and its helpers, then the tensors that exist already."""
    stack.enter_context(recorder)
    stack.enter_context(recorder.watch_resizes())
    stack.enter_context(recorder.sorted_cache_frees())
    stack.enter_context(recorder.skip_sharding_propagation())
    stack.enter_context(module_tracking(model, recorder))
    stack.enter_context(_no_cuda_autocast())
    stack.enter_context(step_context(config.precision, config.device))
    _register(recorder, model, inputs)


def _register(recorder: Recorder, model: torch.nn.Module, inputs: dict) -> None:
    for name, p in model.named_parameters():
        recorder.register(p, name, Category.PARAMETER)
    for name, b in model.named_buffers():
        recorder.register(b, name, Category.BUFFER)
    for name, t in inputs.items():
        recorder.register(t, name, Category.INPUT)


@contextlib.contextmanager
def module_tracking(model: torch.nn.Module, recorder: Recorder):
    """Keep ``recorder.module_stack`` as the dotted paths of the modules whose forward is open."""
    names, mods = {}, {}
    for name, mod in model.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), name)
        mods.setdefault(name, mod)
    stacked = progress.blocks(model)

    def adopted(mod) -> str | None:
        """The path of ``mod`` where the step set it on the open module (BigBird replaces its
        attention modules in its forward), its submodules named with it; None elsewhere."""
        owner = mods.get(recorder.module_stack[-1]) if recorder.module_stack else None
        if owner is None:
            return None
        for path, sub in owner.named_modules(prefix=recorder.module_stack[-1]):
            if sub is mod:
                for p, s in mod.named_modules(prefix=path):
                    names.setdefault(id(s), p)
                    mods.setdefault(p, s)
                return path
        return None

    def pre(mod, args):
        got = stacked.get(id(mod))
        if got is not None:
            progress.report(recorder.phase.value, *got)
        # a module outside the model (a wrapper built inside forward, such as transformers'
        # hub-kernel ``Func``) is charged to the model's module that called it
        name = names.get(id(mod))
        if name is None:
            name = adopted(mod)
        if name is None:
            name = recorder.module_stack[-1] if recorder.module_stack else type(mod).__name__
        recorder.module_stack.append(name)

    def post(mod, args, out):  # not called on an exception: the stack then names the culprit
        if recorder.module_stack:
            recorder.module_stack.pop()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


@contextlib.contextmanager
def _no_cuda_autocast():
    """Model code that enables ``torch.autocast("cuda")`` would silently run in fp32 here (a
    CPU build disables it with a warning): that is an error, not a wrong number."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        text = str(w.message)
        if "autocast" in text.lower() and "cuda" in text.lower() and "not available" in text:
            raise InputError(
                "the model's code enables torch.autocast('cuda'), which a symbolic run on the "
                "CPU cannot apply (it would silently trace fp32)",
                hint="remove autocast from forward and pass precision='bf16-mixed' or "
                     "'16-mixed' (--precision), which traces autocast with CUDA's policy")
    for w in caught:
        key = (str(w.message), w.category, w.filename, w.lineno)
        if "autocast" not in key[0].lower() and key not in _SHOWN:
            # once per process, as Python's default filter shows a warning once per place:
            # every trace records its warnings anew (a 70B analysis under TP x FSDP traces
            # 13 times and showed FSDP2's warning about a returned view 15 times)
            _SHOWN.add(key)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


# the model's warnings shown so far (_no_cuda_autocast)
_SHOWN: set = set()

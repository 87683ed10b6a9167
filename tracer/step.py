"""Run one training step (or one inference forward) of a module symbolically, recording memory.

The step is the plain eager loop, in steady state (optimizer state already exists)::

    optimizer.zero_grad(set_to_none=True)
    out = model(**inputs)
    loss = loss_fn(out)
    loss.backward()
    optimizer.step()
    # `out` and `loss` are still referenced here, as in a plain training loop

It runs on fake tensors under ``FakeTensorMode`` with a ``ShapeEnv``: parameters and inputs have
no data and symbolic sizes, so one run gives every storage's size as a formula. The module is
never materialized: its parameters and buffers are swapped for fake ones for the duration of the
run and restored afterwards.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    GuardOnDataDependentSymNode,
    ShapeEnv,
)

from . import kernels  # noqa: F401  (registers the built-in rules)
from . import known, progress
from .errors import (
    DataDependentError,
    InputError,
    MemsimError,
    StrategyError,
    TraceError,
    UnsupportedOpError,
    did_you_mean,
)
from .config import StepConfig
from .driver import Driver
from .functions import function_rules
from .module_state import changed_note, kept
from .precision import forward_context, step_context, wrap_optimizer
from .previous import mark_held, storage_ids
from .records import Category, LeafRecord, OpRecord, Phase, RunRecord
from .recorder import Recorder, as_expr, patched
from .sources import model_source
from .spec import TensorSpec
from .symcache import remembered

LossFn = Callable[[Any], torch.Tensor]
OptimizerFactory = Callable[[list], torch.optim.Optimizer]


@dataclass
class SymbolTable:
    """The input symbols of one run: user name -> raw ShapeEnv symbol, and the example hints."""

    raw: dict[str, sympy.Symbol]
    hints: dict[str, int]


def default_loss(out) -> torch.Tensor:
    """``out.loss`` when present, ``out`` when it is a scalar, else the sum of its first tensor."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.sum()
    flat = torch.utils._pytree.tree_flatten(
        out.to_tuple() if hasattr(out, "to_tuple") else out)[0]
    for t in flat:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.sum()
    raise InputError("the model's output holds no floating-point tensor to take a loss from",
                     hint="pass loss_fn=... (a function of the output returning a scalar)")


def default_optimizer(device: str) -> OptimizerFactory:
    """AdamW with torch's defaults (torch picks for-loop on CPU, foreach on CUDA)."""
    return lambda params: torch.optim.AdamW(params)


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
            progress.report(recorder.phase.value, got[0], got[1], got[2])
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
        memo.clear()  # the module holds its fake tensors; nothing else may keep them alive
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t


def check_inputs(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Raise an InputError naming an input that ``forward`` does not take, or a parameter it
    needs that no input gives. Returns the inputs that ``forward`` only takes through
    ``**kwargs`` (:func:`check_read` checks after the run that something read them)."""
    sig = inspect.signature(model.forward)
    params = [p for p in sig.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    known = {p.name for p in params}
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return [n for n in names if n not in known]
    for n in names:
        if n not in known:
            raise InputError(
                f"{type(model).__name__}.forward has no parameter {n!r}" + did_you_mean(n, known),
                hint=f"forward takes: {', '.join(p.name for p in params) or '(nothing)'}")
    missing = [p.name for p in params if p.default is p.empty and p.name not in names]
    if missing:
        raise InputError(
            f"{type(model).__name__}.forward needs {', '.join(map(repr, missing))}, "
            "which no input gives",
            hint=f"forward takes: {', '.join(p.name for p in params)}")
    return []


def check_read(model: torch.nn.Module, record: RunRecord, swallowed: list[str]) -> None:
    """An input that ``forward`` took only through ``**kwargs`` and that no op read is an
    error: a misspelled name (``lables``) that the model silently ignores would change the step
    traced (no loss on labels) without a word."""
    if not swallowed:
        return
    read = {i for rec in record.ops if isinstance(rec, OpRecord) for i in rec.inputs}
    unread = [rec.name for rec in record.ops if isinstance(rec, LeafRecord)
              and rec.category is Category.INPUT and rec.name in swallowed
              and rec.index not in read]
    if unread:
        sig = inspect.signature(model.forward)
        known = [p.name for p in sig.parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        raise InputError(
            f"input {unread[0]!r} is not a parameter of {type(model).__name__}.forward, which "
            "takes it through **kwargs and never reads it" + did_you_mean(unread[0], known),
            hint=f"forward takes: {', '.join(known)}; fix the name, or leave the input out")


def make_inputs(specs: list[TensorSpec], shape_env: ShapeEnv, hints: dict[str, int],
                device: str, float_dtype: torch.dtype | None = None
                ) -> tuple[dict[str, torch.Tensor], SymbolTable]:
    """Create fake input tensors with one ShapeEnv symbol per user symbol name (floating
    inputs in ``float_dtype`` when given, as Lightning's ``*-true`` precisions convert them)."""
    from torch._dynamo.source import ConstantSource

    raw: dict[str, sympy.Symbol] = {}
    symints: dict[str, torch.SymInt] = {}
    for spec in specs:
        for name in spec.symbols:
            if name in symints:
                continue
            src = ConstantSource(f"memsim_{name}")
            expr = shape_env.create_symbol(hints[name], src, dynamic_dim=DimDynamic.DYNAMIC)
            raw[name] = expr
            symints[name] = shape_env.create_symintnode(expr, hint=hints[name], source=src)
    tensors = {}
    for spec in specs:
        shape = [symints[d] if isinstance(d, str) else d for d in spec.shape]
        dt = float_dtype if float_dtype is not None and spec.dtype.is_floating_point else spec.dtype
        tensors[spec.name] = torch.empty(shape, dtype=dt, device=device)
        if spec.fill == "ones":
            known.mark(tensors[spec.name])
    return tensors, SymbolTable(raw, dict(hints))


def translate(err: BaseException, recorder: Recorder | None,
              hints: dict[str, int] | None = None) -> MemsimError:
    """Turn an exception raised inside the symbolic run into a typed memsim error
    (``hints``: the example sizes it ran at, named in a model's own failure)."""
    module = recorder.module if recorder is not None else None
    op = recorder.current_op if recorder is not None else None
    source = model_source(err.__traceback__)
    if isinstance(err, TraceError):
        err.locate(source)
        return err
    if isinstance(err, MemsimError):
        return err
    if isinstance(err, UnsupportedOperatorException):
        return UnsupportedOpError(
            f"op {err.func} has no fake (meta) kernel, so its memory is unknown",
            module=module, op=str(err.func), source=source,
            hint="register one with torch.library.register_fake, or exclude this module")
    if isinstance(err, (DataDependentOutputException, DynamicOutputShapeException,
                        GuardOnDataDependentSymNode)):
        return DataDependentError(
            "the model's sizes or control flow depend on tensor values, which a symbolic run "
            f"does not have ({type(err).__name__})", module=module, op=op, source=source,
            hint="make the branch depend on shapes only, or pass that value as a constant")
    text = str(err).strip().splitlines()
    msg = str(err)
    if ("no fake impl" in msg or "fake impl" in msg and "registered" in msg
            or "from the 'Meta' backend" in msg or "meta kernel" in msg.lower()):
        return UnsupportedOpError(
            f"op {op} has no fake (meta) kernel, so its memory is unknown", module=module,
            op=op, source=source,
            hint="register one with torch.library.register_fake (its output shapes are "
                 "enough), or exclude this module")
    at = sizes = ""
    if hints:
        sizes = ", ".join(f"{k}={v}" for k, v in hints.items())
        k = list(hints)[-1]
        at = f" at the example sizes {sizes}"
    failed = TraceError(f"the model failed when run symbolically{at}: {type(err).__name__}: "
                      f"{text[0] if text else ''}", module=module, op=op, source=source,
                      hint="check that the model runs eagerly with these input shapes"
                           + (f" at {sizes}; if it needs other sizes, give them (--hint "
                              f"{k}=N, Python hints={{'{k}': N}})" if hints else "")
                           + "; if it runs, report the op and module above")
    failed.sizes = dict(hints or {})  # a model's own failure there (trace() tries larger ones)
    return failed


def run_step(model: torch.nn.Module, specs: list[TensorSpec], constants: dict,
             config: StepConfig, *, hints: dict[str, int], train: bool,
             transform: Callable | None = None, driver: Driver | None = None,
             patches: Callable | None = None) -> tuple[RunRecord, ShapeEnv, SymbolTable]:
    """Run one training step (``train=True``) or one inference forward symbolically, as
    ``config`` describes it (:class:`~memsim.tracer.config.StepConfig`).

    ``hints``: the example size of every symbol. ``transform(model)``: applied to a copy of the
    model inside the run, before the optimizer is built (strategies). ``driver``: a
    :class:`~memsim.tracer.driver.Driver` that owns the training loop (DeepSpeed's engine).
    ``patches(model)``: a context-manager factory entered for the run, given the run's model
    (Hugging Face's scoped patches).
    With ``config.accumulate >= 2``, micro-steps after the second repeat the second exactly
    (the gradients exist, the previous output is released when the next forward returns), so
    two are run.
    """
    driven = driver is not None and train
    if driven and (config.precision.autocast is not None or config.accumulate != 1
                   or config.compiled):
        what = (f"precision {config.precision.value!r}" if config.precision.autocast
                else "accumulate" if config.accumulate != 1 else "compiled")
        raise InputError(f"{what} is not supported with {type(driver).__name__}",
                         hint="the engine owns the training loop and its precision")
    _room_for_deep_graphs()
    swallowed = check_inputs(model, [s.name for s in specs] + list(constants))
    copied = transform is not None or driver is not None
    if copied:  # a strategy changes the model (or the engine wraps it): a copy for this run
        import copy
        model = copy.deepcopy(model)
    shape_env = ShapeEnv()
    recorder = Recorder(config.device)
    recorder.shape_env = shape_env
    recorder.device_queries_unrecorded = driven   # a library's loop is traced whole
    was_training = model.training
    try:
        with contextlib.ExitStack() as stack:
            # the model as given for every trace: what this run changes is undone after it
            # (a copy is thrown away after its run)
            changed = [] if copied else stack.enter_context(kept(model))
            stack.enter_context(remembered())
            tracker = stack.enter_context(known.tracking())
            inputs, symbols = _enter_run(stack, recorder, model, specs, config, hints, train,
                                         transform, driver if driven else None, patches)
            model.train(train)
            step = _driven if driven else _plain if train else _inference
            # what the step holds (its output, the loss, the optimizer) lives past the end of
            # the recording, as a training loop holds it to the end of the step
            try:
                held = step(stack, recorder, model, inputs, constants, config, driver)
            except RuntimeError as e:   # named while the parameters are the run's
                raise _mixed_dtensors(e, model) or _outside_unit(e, model, recorder) or e
            record = recorder.finish()
            if train and not driven:
                # what the loop's names hold at the end: the next step's previous output and
                # loss (memsim.tracer.trace adds them to the finished run)
                mark_held(record, recorder.sid_of, held[0], held[1])
            elif not train and config.keep_outputs:
                # an inference loop rebinds `out` too: the previous forward's output is alive
                # until the next forward returns
                mark_held(record, recorder.sid_of, held[0], None)
            record.specialized = list(recorder.specialized)
            record.assumed = list(tracker.assumed)
            del held
        if changed:
            record.assumed.append(changed_note(changed))
        check_read(model, record, swallowed)
    except BaseException as e:  # noqa: BLE001 - re-raised as a typed error
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise translate(e, recorder, hints) from e
    finally:
        model.train(was_training)
    return record, shape_env, symbols


def _mixed_dtensors(err: BaseException, model) -> MemsimError | None:
    """The optimizer's foreach update over parameters a tensor-parallel plan left unsharded
    (DTensor refuses a list mixing both): a real CUDA run fails the same way. None for any
    other error, and for this one raised outside ``torch.optim`` (a model's own op)."""
    import traceback

    if "got mixed torch.Tensor and DTensor" not in str(err) or not any(
            "torch/optim/" in f.filename.replace(os.sep, "/")
            for f in traceback.extract_tb(err.__traceback__)):
        return None
    from torch.distributed.tensor import DTensor
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if not plain:
        return None
    op = str(err).split(" got mixed", 1)[0].strip()
    names = ", ".join(repr(n) for n in plain[:3]) + (f" and {len(plain) - 3} more"
                                                     if len(plain) > 3 else "")
    return StrategyError(
        f"{op} fails in the optimizer step: it updates its parameters with foreach ops, and "
        f"the tensor-parallel plan leaves {names} plain tensors beside its DTensors; a real "
        "run fails the same way (torch picks the foreach update on CUDA, and DTensor refuses "
        "a list that mixes both)",
        hint="give the optimizer foreach=False (--optimizer 'AdamW(foreach=False)', "
             "optimizer='AdamW(foreach=False)'), or make every parameter a DTensor (FSDP "
             "with TP: --fsdp)")


def _outside_unit(err: BaseException, model, recorder: Recorder) -> MemsimError | None:
    """A module of an FSDP2 unit that the model calls outside the unit's forward (DiT's
    top level calls ``transformer_blocks[0].norm1.emb`` for its conditioning): the unit's
    parameters are still sharded there, and a real run fails the same way. None for any other
    error."""
    if "got mixed torch.Tensor and DTensor" not in str(err) or not recorder.module_stack:
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    units = [n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)]
    inner = recorder.module_stack[-1]
    owner = max((u for u in units if inner == u or inner.startswith(u + ".")),
                key=len, default=None)
    if owner is None or owner in recorder.module_stack:
        return None  # the unit's forward runs: not this case
    called = next((m for m in recorder.module_stack if m.startswith(owner + ".")), inner)
    return StrategyError(
        f"the model calls {called!r} outside the forward of its FSDP unit {owner!r}, where "
        f"the unit's parameters are still sharded (DTensors): {inner!r} fails on them, and a "
        "real FSDP2 run fails the same way (torch: 'got mixed torch.Tensor and DTensor')",
        hint=f"make {called!r} a unit of its own (FSDP(units=[..., {called!r}, {owner!r}, "
             f"...]): its own hooks then gather it), or leave {owner!r} out of the units")


# PyTorch's cache of fake kernels' results (on by default in FakeTensorMode). Each miss builds
# an entry and checks it with a second fake output, so the cache pays only where most ops hit
# it (about 70% or more, by the timings below). Over a model's symbolic sizes most miss
# (Qwen3-Next: 37% hits, 2.9-3.7 s without against 5.4-6.0 s with; Llama under FSDP2: 60%) and
# a plain run is traced without it. A library's loop hits it (DeepSpeed's ZeRO-3 over its flat
# buffers at Llama-2-7B's widths: 84%, 26.4 s with against 32.7 s without) and a driven run
# keeps it. A loop over time steps at fixed sizes hits it too (a fitted GRU: 78%, 12-13 s with
# against 14-16 s without), which this rule does not see. ``True``/``False`` force it either way;
# ``python -m benchmarks.fake_cache [--deepspeed]`` times them. Where it is on, an output whose
# remade storage is not the kernel's to the expression is not cached (:func:`_faithful_fake_cache`)
# and the run is the same event for event; the cache's keys add guards of their own
# (tests/test_symcache.py).
FAKE_CACHE: bool | None = None


def _enter_run(stack: contextlib.ExitStack, recorder: Recorder, model, specs, config, hints,
               train: bool, transform, driver, patches):
    """Enter the run's modes (the fake mode, fake parameters, the device's kernel choices) and
    build the fake symbolic inputs; returns ``(inputs, symbols)``."""
    prec = config.precision
    low = prec.param_dtype if prec.param_dtype != torch.float32 else None  # *-true: cast
    if driver is not None:
        stack.enter_context(driver.context())
        recorder.scalar_hook = driver.scalar
        # host memory is apart from the device's only on a GPU (on the CPU it is all one)
        recorder.host_device = driver.host_device if config.device == "cuda" else None
    mode = FakeTensorMode(shape_env=recorder.shape_env, allow_non_fake_inputs=True)
    mode.cache_enabled = FAKE_CACHE if FAKE_CACHE is not None else driver is not None
    if mode.cache_enabled:
        stack.enter_context(_faithful_fake_cache())
    stack.enter_context(mode)
    stack.enter_context(_quiet_fake_kernels())
    stack.enter_context(_module_to_in_place())
    # with a driver the engine casts the model itself (float inputs are made in its dtype)
    stack.enter_context(fake_module(model, "cpu", None if driver is not None else low))
    stack.enter_context(optimizer_defaults_for(config.device))
    stack.enter_context(_modes_in_recompute(recorder))
    stack.enter_context(function_rules(config.device, config.cpu_isa))
    if patches is not None:
        stack.enter_context(patches(model))
    if transform is not None:
        transform(model)
    return make_inputs(specs, recorder.shape_env, hints,
                       driver.device if driver is not None else "cpu", low)


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
def _faithful_fake_cache():
    """PyTorch's cache of fake kernels' results remakes an op's output as ``empty_strided`` of
    its sizes and strides, whose storage is the span of those: by PyTorch's formula, not the
    kernel's. An entry is made only where the remade storage's size and offset are the
    kernel's (the same expressions once expanded), so that a cached run is the uncached one,
    event for event. Where they are not (CUDA attention's sliding-window mask in Mistral, padded
    to a multiple of 8 and sliced: ``Max(1, S - Mod(S, 8) + 8)`` in the span, equal for every
    S >= 1 but not provably so here; and any kernel whose output would not span its storage),
    the op runs each time."""
    from torch._subclasses.fake_tensor import _BypassDispatchCache
    last: list = []    # while an entry is made: the output PyTorch remakes from it

    def remaking(remade):
        def remake(self, *args, **kwargs):
            out = remade(self, *args, **kwargs)
            if last:
                last[0] = out
            return out
        return remake

    def checking(made):
        def checked(self, state, key, func, args, kwargs, output):
            # PyTorch checks a new entry by remaking the output from it once (``remake``); a
            # hit's output is not kept here (holding it would delay its release)
            last.append(None)
            try:
                info = made(self, state, key, func, args, kwargs, output)
                again = last[0]
            finally:
                last.clear()
            if info.metadata is not None and info.view_idx is None and not (
                    isinstance(again, torch.Tensor)
                    and _same_size(again.untyped_storage().nbytes(),
                                   output.untyped_storage().nbytes())
                    and _same_size(again.storage_offset(), output.storage_offset())):
                raise _BypassDispatchCache("remade storage is not the kernel's")
            return info
        return checked

    with patched(FakeTensorMode, "_output_from_cache_entry", remaking), \
            patched(FakeTensorMode, "_get_output_info_for_cache_entry", checking):
        yield


def _same_size(a, b) -> bool:
    """Whether two sizes are the same expression as the recorder records them
    (:func:`~memsim.tracer.recorder.as_expr`), or once expanded; no guard is added."""
    a, b = as_expr(a), as_expr(b)
    return a == b or sympy.expand(a - b) == 0


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


def _record(stack: contextlib.ExitStack, recorder: Recorder, model, inputs: dict, config
            ) -> None:
    """Start recording: the recorder and its helpers, then the tensors that exist already."""
    stack.enter_context(recorder)
    stack.enter_context(recorder.watch_resizes())
    stack.enter_context(recorder.sorted_cache_frees())
    stack.enter_context(recorder.skip_sharding_propagation())
    stack.enter_context(module_tracking(model, recorder))
    stack.enter_context(_no_cuda_autocast())
    stack.enter_context(step_context(config.precision, config.device))
    _register(recorder, model, inputs)


def _forward(model, recorder: Recorder, config):
    """What runs the forward: the model, or its ``torch.compile`` partition."""
    if config.compiled:
        from .compiled import CompiledForward
        return CompiledForward(model, recorder)
    return model


def _saving(recorder: Recorder):
    """Autograd's saved-tensor hooks, marking what forward keeps for backward."""
    return torch.autograd.graph.saved_tensors_hooks(
        recorder.pack_saved, lambda t: t)


def _plain(stack, recorder: Recorder, model, inputs: dict, constants: dict, config,
           driver=None) -> tuple:
    """The plain eager training loop (module docstring), after a warm-up step."""
    prec = config.precision
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    _check_precision(prec, model, trainable)
    opt = wrap_optimizer(prec, optimizer_factory(config))(trainable)
    scaler = torch.amp.GradScaler("cpu") if prec.scaler else None
    loss_fn = config.loss_fn or default_loss
    _record(stack, recorder, model, inputs, config)
    call = _forward(model, recorder, config)
    owned = _warm_up(recorder, opt, trainable, config.device, scaler,
                     names={id(p): n for n, p in model.named_parameters()})
    recorder.run.start = len(recorder.run.events)
    for p in trainable:
        stack.callback(p.register_post_accumulate_grad_hook(recorder.grad_ready).remove)
    recorder.mark(Phase.ZERO_GRAD)
    opt.zero_grad(set_to_none=True)
    for _ in range(min(config.accumulate, 2)):
        recorder.mark(Phase.FORWARD)
        with _saving(recorder), forward_context(prec):
            out = call(**inputs, **constants)
            recorder.mark(Phase.LOSS)
            loss = loss_fn(out)
            _check_loss(loss)
            if config.accumulate > 1:
                loss = loss / config.accumulate
        if not config.keep_outputs:
            out = None  # only the loss is kept, as Hugging Face's Trainer does
        recorder.mark(Phase.BACKWARD)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        for p in trainable:
            if p.grad is not None:
                recorder.set_category(p.grad, Category.GRADIENT)
    recorder.mark(Phase.OPTIMIZER)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    _parameters_made_in_the_step(recorder, model)
    _never_stepped(recorder, trainable, owned)
    return out, loss, opt, scaler, call  # all held to the end of the step


def _never_stepped(recorder: Recorder, trainable: list, owned: dict) -> None:
    """A trainable parameter that gets no gradient in the step (a module the forward never
    calls: wav2vec2's ``masked_spec_embed`` without SpecAugment) never has one in a real loop:
    ``zero_grad`` leaves it None, and the optimizer never makes its state. The synthetic
    warm-up (:func:`_warm_up`) gave it a gradient and state; they are zero bytes."""
    unused = {id(p) for p in trainable if p.grad is None and id(p) not in recorder.accumulated}
    if not unused:
        return
    kept = {sid for p in trainable if id(p) not in unused for sid in owned.get(id(p), ())}
    for i in unused:
        for sid in owned.get(i, ()):
            if sid is not None and sid not in kept:
                recorder.run.storages[sid].nbytes = sympy.Integer(0)


def _parameters_made_in_the_step(recorder: Recorder, model) -> None:
    """A storage made during the step that a parameter holds at its end is parameter memory
    from then on, not an activation or temporary: FSDP2 re-pads a rank's uneven shards in a
    fresh storage (``new_zeros``) in forward, which the parameter keeps (rank 1 of a 65-wide
    MLP: 272,448 B that the activation peak counted)."""
    for p in dict.fromkeys(model.parameters()):
        sid = recorder.sid_of(p)
        if sid is not None and recorder.run.storages[sid].category in (Category.ACTIVATION,
                                                                       Category.TEMPORARY):
            recorder.run.storages[sid].category = Category.PARAMETER


def _inference(stack, recorder: Recorder, model, inputs: dict, constants: dict, config,
               driver=None):
    """``model.eval()`` and one forward under ``torch.no_grad()`` (the previous forward's
    output, which a loop holds until this one returns, is added to the finished run:
    :mod:`memsim.tracer.previous`)."""
    _record(stack, recorder, model, inputs, config)
    call = _forward(model, recorder, config)
    recorder.run.start = len(recorder.run.events)
    recorder.mark(Phase.FORWARD)
    with torch.no_grad(), forward_context(config.precision):
        return call(**inputs, **constants), call


def _driven(stack, recorder: Recorder, model, inputs: dict, constants: dict, config,
            driver: Driver) -> tuple:
    """A library's loop (:class:`Driver`): its setup and warm-up steps, then one step."""
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    loss_fn = config.loss_fn or default_loss
    _record(stack, recorder, model, inputs, config)
    call = driver.setup(model, trainable, optimizer_factory(config))
    # the loop the measured step runs (_driven_step): the previous step's output and loss are
    # held until the loop rebinds the names (memsim.tracer.previous)
    held = [None, None]
    for _ in range(driver.warmup):
        out, loss = held
        held.clear()
        out = call(**inputs, **constants)
        loss = loss_fn(out)
        if not config.keep_outputs:
            out = None
        driver.backward(loss)
        driver.step()
        held[:] = [out, loss]
        del out, loss
    driver.label(recorder)
    # what the warm-up's output and loss hold is the step's kind of memory: activations, as a
    # plain loop's previous output is, not the setup's temporaries (storage ids only: a loop
    # variable here would keep a tensor alive into the step)
    for sid in set(storage_ids(held, recorder.sid_of)):
        if recorder.run.storages[sid].category is Category.TEMPORARY:
            recorder.run.storages[sid].category = Category.ACTIVATION
    # what the warm-up left in reference cycles is collected before the step, and the
    # collector does not run inside it (as the oracle measures it)
    gc.collect()
    if gc.isenabled():
        gc.disable()
        stack.callback(gc.enable)
    recorder.run.start = len(recorder.run.events)
    recorder.run.warmed = driver.warmup > 0
    recorder.run.replays = driver.replays if driver.warmup > 0 else 0
    held = _driven_step(recorder, driver, call, inputs, constants, loss_fn,
                        config.keep_outputs, held)
    # DeepSpeed's stage 3 gathers its persistent (small) parameters again after the optimizer
    # step, in fresh storages they keep
    _parameters_made_in_the_step(recorder, model)
    return held, call


# the main thread's stack may grow to this (the soft limit raised within the hard one)
DEEP_STACK = 1 << 30


def _room_for_deep_graphs() -> None:
    """Let the main thread's stack grow where a long Python loop's autograd graph is freed.

    A loop over 16,384 time steps (``tests/support/zoo.py``'s ``Scan``) makes a chain of as many
    autograd nodes; under the symbolic run, releasing the step's output frees that chain
    recursively in C, which overflowed Linux's default 8 MiB stack: a segmentation fault at
    S = 16,384 where a real eager run frees the same graph. Linux checks a growing main-thread
    stack against the soft limit at the time, so raising it here gives the room (the memory is
    only used if the recursion reaches it). Nothing happens where ``resource`` is missing, the
    limit is already higher, or the call is refused."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
        want = DEEP_STACK if hard == resource.RLIM_INFINITY else min(DEEP_STACK, hard)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_STACK, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


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


def _driven_step(recorder, driver, call, inputs, constants, loss_fn, keep_outputs, previous):
    """The measured step; ``previous``: a list of the last step's output and loss, emptied
    here so that the rebinding of ``out`` and ``loss`` releases them."""
    out, loss = previous
    previous.clear()
    recorder.mark(Phase.ZERO_GRAD)
    recorder.mark(Phase.FORWARD)
    with _saving(recorder):
        out = call(**inputs, **constants)
        recorder.mark(Phase.LOSS)
        loss = loss_fn(out)
        _check_loss(loss)
    if not keep_outputs:
        out = None
    recorder.mark(Phase.BACKWARD)
    driver.backward(loss)
    driver.label_gradients(recorder)
    recorder.mark(Phase.OPTIMIZER)
    driver.step()
    return out, loss  # held to the end of the step, as in a plain loop


def _check_precision(prec, model: torch.nn.Module, trainable: list) -> None:
    """Combinations that cannot run get an error naming the setting."""
    if not prec.scaler:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    half = [names.get(id(p), "?") for p in trainable if p.dtype == torch.float16]
    if half:
        raise InputError(
            f"precision {prec.value!r} needs fp32 parameters, but {half[0]!r}"
            + (f" and {len(half) - 1} more" if len(half) > 1 else "") + " are fp16: "
            "GradScaler cannot unscale fp16 gradients",
            hint="use precision='16-true' for an fp16 model, or build the model in fp32")


def _check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else (
            f"tensor of shape {tuple(loss.shape)}" if loss.dim() else "tensor without grad")
        raise InputError(f"the loss must be a scalar tensor that requires grad; got a {what}",
                         hint="pass loss_fn=... returning a scalar, or check that some "
                              "parameter requires grad")


def _register(recorder: Recorder, model: torch.nn.Module, inputs: dict) -> None:
    for name, p in model.named_parameters():
        recorder.register(p, name, Category.PARAMETER)
    for name, b in model.named_buffers():
        recorder.register(b, name, Category.BUFFER)
    for name, t in inputs.items():
        recorder.register(t, name, Category.INPUT)


@contextlib.contextmanager
def _modes_in_recompute(recorder: Recorder | None = None):
    """Keep memsim's torch-function modes (CUDA kernel choices, CUDA autocast policy) on in the
    forward that non-reentrant activation checkpointing recomputes during backward.

    The autograd engine does not carry torch-function modes into backward, so the recomputed
    forward would otherwise pick CPU kernels (e.g. SDPA's math path) and fail checkpoint's
    metadata check. The modes active when a checkpointed region runs forward are entered again
    around its recomputation; a real run has no modes, and its kernel choice is the same both
    times. The recomputation stops early (an exception, once the tensors backward needs are
    back), which skips the forward hooks that pop ``recorder.module_stack``: the stack is cut
    back to its depth at the start of the recomputation when it ends.
    """
    import torch.utils.checkpoint as ckpt
    from torch.overrides import _get_current_function_mode_stack

    orig = ckpt._checkpoint_without_reentrant_generator

    def generator(fn, preserve_rng_state=True, context_fn=ckpt.noop_context_fn, *rest,
                  **kwargs):
        if torch.compiler.is_compiling():
            # --compiled: checkpoint as Dynamo rewrites it (nothing runs again eagerly).
            from .compiled import compiled_checkpoint
            return compiled_checkpoint(orig, fn, context_fn, rest, kwargs)
        modes = list(_get_current_function_mode_stack())

        def context():
            fwd, rec = context_fn()
            return fwd, _Recompute(rec, modes, recorder)

        return orig(fn, preserve_rng_state, context, *rest, **kwargs)

    ckpt._checkpoint_without_reentrant_generator = generator
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = orig


class _Recompute:
    """The recomputation context of one checkpointed region: the context ``context_fn`` gave
    (``rec``) with memsim's torch-function modes ``modes`` entered inside it, and
    ``recorder.module_stack`` cut back to its depth at the start when it ends.

    It holds ``rec`` as long as checkpoint holds it, as a real run does: ``recompute_fn``'s
    closure keeps its context, so for as long as the region's ``_CheckpointFrame`` lives (until
    backward has released every tensor the region saved). For selective checkpointing ``rec``
    is ``_CachedTorchDispatchMode``, whose ``storage`` keeps the outputs the policy saved; the
    recomputation stops early and never consumes the cached outputs backward does not need (a
    region's last matmul, say), which stay until the frame dies. A generator context manager
    (``contextlib.contextmanager``) would let go of ``rec`` when its generator finishes, right
    after the recomputation, and free those outputs too soon. Reusable, as ``rec`` is: a second
    backward (``retain_graph=True``) recomputes again."""

    def __init__(self, rec, modes: list, recorder: Recorder | None):
        self.rec = rec
        self.modes = modes
        self.recorder = recorder
        self._open: list[tuple[contextlib.ExitStack, int]] = []

    def __enter__(self):
        depth = len(self.recorder.module_stack) if self.recorder is not None else 0
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self.rec)
            for m in self.modes:
                stack.enter_context(m)
        except BaseException:
            stack.close()
            raise
        self._open.append((stack, depth))

    def __exit__(self, *exc):
        stack, depth = self._open.pop()
        try:
            return stack.__exit__(*exc)
        finally:
            if self.recorder is not None:
                del self.recorder.module_stack[depth:]


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


def _warm_up(recorder: Recorder, opt: torch.optim.Optimizer, trainable: list,
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

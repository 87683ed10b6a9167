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
import traceback
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
from .errors import (
    DataDependentError,
    InputError,
    MemsimError,
    TraceError,
    UnsupportedOpError,
)
from .records import Category, Phase, RunRecord
from .recorder import Recorder
from .spec import TensorSpec

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIRS = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + p
                  for p in ("tracer", "analysis", "strategies"))
_STDLIB = os.path.dirname(os.__file__)

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


def _is_model_file(f: str) -> bool:
    f = os.path.abspath(f)
    stdlib = f.startswith(_STDLIB) and "site-packages" not in f and "dist-packages" not in f
    return not (f.startswith(_TORCH_DIR) or f.startswith(_OWN_DIRS) or stdlib
                or "<frozen" in f or "/site-packages/sympy" in f
                or "/site-packages/networkx" in f)


def model_source(tb) -> str | None:
    """``file:line`` of the innermost traceback frame that is model code (not torch, not ours)."""
    best = None
    for frame, lineno in traceback.walk_tb(tb):
        if _is_model_file(frame.f_code.co_filename):
            best = f"{os.path.abspath(frame.f_code.co_filename)}:{lineno}"
    return best


def model_source_stack(stack) -> str | None:
    """``file:line`` of the innermost frame of model code in a ``traceback.extract_stack()``."""
    for fr in reversed(stack):
        if _is_model_file(fr.filename):
            return f"{os.path.abspath(fr.filename)}:{fr.lineno} ({fr.line})"
    return None


@contextlib.contextmanager
def module_tracking(model: torch.nn.Module, recorder: Recorder):
    """Keep ``recorder.module_stack`` as the dotted paths of the modules whose forward is open."""
    names = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), name)

    def pre(mod, args):
        recorder.module_stack.append(names.get(id(mod), type(mod).__name__))

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


def check_inputs(model: torch.nn.Module, names: list[str]) -> None:
    """Raise an InputError naming the input that ``forward`` does not take."""
    sig = inspect.signature(model.forward)
    params = [p for p in sig.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    known = {p.name for p in params}
    for n in names:
        if n not in known:
            import difflib
            close = difflib.get_close_matches(n, known, n=1)
            raise InputError(
                f"{type(model).__name__}.forward has no parameter {n!r}"
                + (f" (did you mean {close[0]!r}?)" if close else ""),
                hint=f"forward takes: {', '.join(p.name for p in params) or '(nothing)'}")
    missing = [p.name for p in params if p.default is p.empty and p.name not in names]
    if missing:
        raise InputError(
            f"{type(model).__name__}.forward needs {', '.join(map(repr, missing))}, "
            "which no input gives",
            hint=f"forward takes: {', '.join(p.name for p in params)}")


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
    return tensors, SymbolTable(raw, dict(hints))


def translate(err: BaseException, recorder: Recorder | None) -> MemsimError:
    """Turn an exception raised inside the symbolic run into a typed memsim error."""
    module = recorder.module if recorder is not None else None
    op = recorder.current_op if recorder is not None else None
    source = model_source(err.__traceback__)
    if isinstance(err, TraceError):
        if err.source is None:
            err.source = source
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
    return TraceError(f"the model failed when run symbolically: {type(err).__name__}: "
                      f"{text[0] if text else ''}", module=module, op=op, source=source,
                      hint="check that the model runs eagerly with these input shapes; if it "
                           "does, report the op and module above")


def run_step(model: torch.nn.Module, specs: list[TensorSpec], *, device: str,
             hints: dict[str, int], train: bool, loss_fn: LossFn | None = None,
             optimizer: OptimizerFactory | None = None, constants: dict | None = None,
             keep_outputs: bool = True, patches: Callable | None = None,
             precision=None, accumulate: int = 1, transform: Callable | None = None,
             compiled: bool = False, driver: "Driver | None" = None
             ) -> tuple[RunRecord, ShapeEnv, SymbolTable]:
    """Run one training step (``train=True``) or one inference forward symbolically.

    ``precision``: a :mod:`tracer.precision` mode. ``accumulate``: micro-batches per optimizer
    step (gradient accumulation); micro-steps after the second repeat the second exactly (the
    gradients exist, the previous output is released when the next forward returns), so two are
    run for any ``accumulate >= 2``. ``compiled``: the forward runs as ``torch.compile`` would
    partition it (:mod:`tracer.compiled`). ``driver``: a :class:`Driver` that owns the training
    loop (DeepSpeed's engine) in place of the plain one.
    """
    from .precision import forward_context, precision as _precision, step_context, wrap_optimizer

    prec = _precision(precision)
    if not isinstance(accumulate, int) or accumulate < 1:
        raise InputError(f"accumulate={accumulate!r} must be an int >= 1",
                         hint="micro-batches per optimizer step")
    low = prec.param_dtype if prec.param_dtype != torch.float32 else None
    if driver is not None and train:
        if prec.autocast is not None or accumulate != 1 or compiled:
            what = ("precision " + repr(prec.name) if prec.autocast is not None else
                    "accumulate" if accumulate != 1 else "compiled")
            raise InputError(f"{what} is not supported with {type(driver).__name__}",
                             hint="the engine owns the training loop and its precision")
    # with a driver the engine casts the model itself (float inputs are made in its dtype)
    model_low = None if driver is not None and train else low
    constants = dict(constants or {})
    check_inputs(model, [s.name for s in specs] + list(constants))
    if transform is not None or driver is not None:
        import copy
        model = copy.deepcopy(model)
    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    recorder = Recorder(device)
    recorder.shape_env = shape_env
    was_training = model.training
    loss_fn = loss_fn or default_loss
    try:
        with contextlib.ExitStack() as stack:
            if driver is not None and train:
                stack.enter_context(driver.context())
                recorder.scalar_hook = driver.scalar
                # host memory is apart from the device's only on a GPU (on the CPU it is all one)
                recorder.host_device = driver.host_device if device == "cuda" else None
            stack.enter_context(fake_mode)
            stack.enter_context(fake_module(model, "cpu", model_low))
            stack.enter_context(optimizer_defaults_for(device))
            stack.enter_context(_modes_in_recompute(recorder))
            if device == "cuda":
                from .cuda import cuda_kernels
                stack.enter_context(cuda_kernels())
            if patches is not None:
                stack.enter_context(patches())
            if transform is not None:
                transform(model)
            inputs, symbols = make_inputs(specs, shape_env, hints,
                                          driver.device if driver and train else "cpu", low)
            model.train(train)
            params = [p for p in dict.fromkeys(model.parameters())]
            trainable = [p for p in params if p.requires_grad]
            _check_precision(prec, model, trainable, train)
            factory = optimizer or default_optimizer(device)
            if driver is None:
                factory = wrap_optimizer(prec, factory)
            opt = factory(trainable) if train and driver is None else None
            scaler = torch.amp.GradScaler("cpu") if train and prec.scaler else None
            stack.enter_context(recorder)
            stack.enter_context(recorder.watch_resizes())
            stack.enter_context(recorder.skip_sharding_propagation())
            stack.enter_context(module_tracking(model, recorder))
            stack.enter_context(_no_cuda_autocast())
            stack.enter_context(step_context(prec, device))
            _register(recorder, model, inputs)
            call = model
            if compiled:
                from .compiled import CompiledForward
                call = CompiledForward(model, recorder)
            if train and driver is not None:
                call = driver.setup(model, trainable, factory)
                # the engine may have replaced modules (DeepSpeed's AutoTP): hold only what the
                # model holds now, as the user's program would
                params = None
                trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
                for _ in range(driver.warmup):
                    loss = loss_fn(call(**inputs, **constants))
                    driver.backward(loss)
                    driver.step()
                    loss = None
                driver.label(recorder)
                # what the warm-up left in reference cycles is collected before the step, and
                # the collector does not run inside it (as the oracle measures it)
                gc.collect()
                if gc.isenabled():
                    gc.disable()
                    stack.callback(gc.enable)
            elif train:
                _warm_up(recorder, opt, trainable, device, scaler)
            recorder.run.start = len(recorder.run.events)
            if train and driver is not None:
                out, loss = _driven_step(recorder, driver, call, inputs, constants, loss_fn,
                                         keep_outputs)
            elif train:
                for p in trainable:
                    stack.callback(p.register_post_accumulate_grad_hook(recorder.grad_ready).remove)
                recorder.mark(Phase.ZERO_GRAD)
                opt.zero_grad(set_to_none=True)
                for _ in range(min(accumulate, 2)):
                    recorder.mark(Phase.FORWARD)
                    with torch.autograd.graph.saved_tensors_hooks(
                            lambda t: (recorder.mark_saved(t), t)[1], lambda t: t):
                        with forward_context(prec):
                            out = call(**inputs, **constants)
                            recorder.mark(Phase.LOSS)
                            loss = loss_fn(out)
                            _check_loss(loss)
                            if accumulate > 1:
                                loss = loss / accumulate
                    if not keep_outputs:
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
            else:
                recorder.mark(Phase.FORWARD)
                with torch.no_grad(), forward_context(prec):
                    out = call(**inputs, **constants)
            record = recorder.finish()
            record.specialized = list(recorder.specialized)
            out = loss = None
    except BaseException as e:  # noqa: BLE001 - re-raised as a typed error
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise translate(e, recorder) from e
    finally:
        model.train(was_training)
    return record, shape_env, symbols


class Driver:
    """A training loop owned by a library (DeepSpeed's engine), in place of the plain one.

    :func:`run_step` calls ``setup`` once inside the symbolic run (its allocations are the
    step's starting state), runs ``warmup`` whole steps, calls ``label`` to name what the
    library holds (:meth:`Recorder.set_category`), then records one step::

        out = call(**inputs)
        loss = loss_fn(out)
        driver.backward(loss)
        driver.step()
    """

    warmup = 2
    device = "cpu"  # the (fake) device the engine computes on; the inputs are made there
    host_device = None  # where the engine puts host memory (offload), if it has any

    def context(self) -> contextlib.AbstractContextManager:
        """Entered around the whole symbolic run, outside the fake mode."""
        return contextlib.nullcontext()

    def setup(self, model: torch.nn.Module, params: list, optimizer: OptimizerFactory
              ) -> Callable:
        """Build the engine around ``model``; return what runs the forward."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def scalar(self, t: torch.Tensor):
        """The value the engine's code reads with ``.item()`` from ``t`` (a fake tensor has
        none), or None for memsim's default (:mod:`tracer.kernels`)."""
        return None

    def label(self, recorder: Recorder) -> None:
        """Set the categories of what the engine holds (after the warm-up steps)."""

    def label_gradients(self, recorder: Recorder) -> None:
        """Set the categories of the gradients the backward produced."""


def _driven_step(recorder, driver, call, inputs, constants, loss_fn, keep_outputs):
    recorder.mark(Phase.ZERO_GRAD)
    recorder.mark(Phase.FORWARD)
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: (recorder.mark_saved(t), t)[1], lambda t: t):
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


def _check_precision(prec, model: torch.nn.Module, trainable: list, train: bool) -> None:
    """Combinations that cannot run get an error naming the setting."""
    if not train or not prec.scaler:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    half = [names.get(id(p), "?") for p in trainable if p.dtype == torch.float16]
    if half:
        raise InputError(
            f"precision {prec.name!r} needs fp32 parameters, but {half[0]!r}"
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
            stack = contextlib.ExitStack()

            @contextlib.contextmanager
            def recompute():
                depth = len(recorder.module_stack) if recorder is not None else 0
                try:
                    with rec, stack:
                        for m in modes:
                            stack.enter_context(m)
                        yield
                finally:
                    if recorder is not None:
                        del recorder.module_stack[depth:]

            return fwd, recompute()

        return orig(fn, preserve_rng_state, context, *rest, **kwargs)

    ckpt._checkpoint_without_reentrant_generator = generator
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = orig


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
        if "autocast" not in str(w.message).lower():
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _warm_up(recorder: Recorder, opt: torch.optim.Optimizer, trainable: list,
             device: str, scaler=None) -> None:
    """Create the optimizer state as a previous step would have, and that step's gradients.

    On CUDA, torch.optim keeps scalar ``step`` counters on the host unless the optimizer is
    ``capturable`` or ``fused``: those are marked as host memory. Master-weight optimizers
    (:class:`tracer.precision.MasterWeights`) hold fp32 masters (optimizer state) and fp32
    gradient buffers (gradients). A GradScaler's scale and growth tracker are optimizer state.
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
        for i, g in enumerate(opt.main_grads):
            recorder.register(g, f"<main_grad.{i}>", Category.GRADIENT)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in trainable:
        recorder.set_category(p.grad, Category.GRADIENT)
    inner = opt.inner if isinstance(opt, MasterWeights) else opt
    on_device_steps = any(g.get("capturable") or g.get("fused") for g in inner.param_groups)
    paged = device == "cuda" and getattr(inner, "_memsim_host_state", False)
    for state in inner.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                recorder.set_category(v, Category.OPTIMIZER_STATE)
                if paged or (device == "cuda" and k == "step" and v.dim() == 0
                             and not on_device_steps):
                    recorder.set_host(v)

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

This module holds the loops (a plain one, a library's, an inference forward). What the run
enters around them is :mod:`~memsim.tracer.run_context`; the optimizer's warm-up,
:mod:`~memsim.tracer.optimizer_state`; the checks of what the step is given,
:mod:`~memsim.tracer.step_checks`; an exception raised inside the run, as memsim's typed error,
:mod:`~memsim.tracer.run_errors`.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from . import data_dependent, kernels, rnn_cpu  # noqa: F401  (register the built-in rules)
from . import known
from .errors import InputError
from .config import StepConfig
from .driver import Driver
from .module_state import changed_note, kept
from .optimizer_state import never_stepped, optimizer_factory, warm_up
from .precision import forward_context, wrap_optimizer
from .previous import mark_held, storage_ids
from .records import Category, Phase, RunRecord
from .recorder import Recorder
from .run_context import SymbolTable, enter_run, start_recording
from .run_errors import explained, translate
from .spec import TensorSpec
from .step_checks import check_driven, check_inputs, check_loss, check_precision, check_read
from .pointwise import fast_pointwise
from .symcache import remembered

LossFn = Callable[[Any], torch.Tensor]


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
    if driven:
        check_driven(driver, config)
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
    tracker = None
    try:
        with contextlib.ExitStack() as stack:
            # the model as given for every trace: what this run changes is undone after it
            # (a copy is thrown away after its run)
            changed = [] if copied else stack.enter_context(kept(model))
            stack.enter_context(remembered())
            stack.enter_context(fast_pointwise())
            tracker = stack.enter_context(known.tracking())
            inputs, symbols = enter_run(stack, recorder, model, specs, config, hints, train,
                                        transform, driver if driven else None, patches)
            model.train(train)
            step = _driven if driven else _plain if train else _inference
            # what the step holds (its output, the loss, the optimizer) lives past the end of
            # the recording, as a training loop holds it to the end of the step
            try:
                held = step(stack, recorder, model, inputs, constants, config, driver)
            except RuntimeError as e:   # named while the parameters are the run's
                raise explained(e, model, recorder) or e
            record = recorder.finish()
            _mark_held(record, recorder, held, train=train, driven=driven,
                       keep_outputs=config.keep_outputs)
            record.specialized = list(recorder.specialized)
            record.assumed = list(tracker.assumed)
            record.branches = list(tracker.branches.values())
            del held
        if changed:
            record.assumed.append(changed_note(changed))
        check_read(model, record, swallowed)
    except BaseException as e:  # noqa: BLE001 - re-raised as a typed error
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        err = translate(e, recorder, hints)
        # the values the run went on with before it failed (a branch that raises: the trace
        # tries the other)
        err.branches = list(tracker.branches.values()) if tracker is not None else []
        raise err from e
    finally:
        model.train(was_training)
    return record, shape_env, symbols


def _mark_held(record: RunRecord, recorder: Recorder, held: tuple, *, train: bool,
               driven: bool, keep_outputs: bool) -> None:
    """Mark what the loop's names hold at the end of the step (``held``: what the step
    returned)."""
    if train and not driven:
        # what the loop's names hold at the end: the next step's previous output and
        # loss (memsim.tracer.trace adds them to the finished run)
        mark_held(record, recorder.sid_of, held[0], held[1])
    elif not train and keep_outputs:
        # an inference loop rebinds `out` too: the previous forward's output is alive
        # until the next forward returns
        mark_held(record, recorder.sid_of, held[0], None)


def _saving(recorder: Recorder):
    """Autograd's saved-tensor hooks, marking what forward keeps for backward."""
    return torch.autograd.graph.saved_tensors_hooks(
        recorder.pack_saved, lambda t: t)


def _forward(model, recorder: Recorder, config):
    """What runs the forward: the model, or its ``torch.compile`` partition."""
    if config.compiled:
        from .compiled import CompiledForward
        return CompiledForward(model, recorder)
    return model


def _plain(stack, recorder: Recorder, model, inputs: dict, constants: dict, config,
           driver=None) -> tuple:
    """The plain eager training loop (module docstring), after a warm-up step."""
    prec = config.precision
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    check_precision(prec, model, trainable)
    opt = wrap_optimizer(prec, optimizer_factory(config))(trainable)
    scaler = torch.amp.GradScaler("cpu") if prec.scaler else None
    loss_fn = config.loss_fn or default_loss
    start_recording(stack, recorder, model, inputs, config)
    call = _forward(model, recorder, config)
    owned = warm_up(recorder, opt, trainable, config.device, scaler,
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
            check_loss(loss)
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
    never_stepped(recorder, trainable, owned)
    return out, loss, opt, scaler, call  # all held to the end of the step


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
    start_recording(stack, recorder, model, inputs, config)
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
    start_recording(stack, recorder, model, inputs, config)
    driver.loss_fn, driver.precision = loss_fn, config.precision
    call = driver.setup(model, trainable, optimizer_factory(config))
    # the engine holds what it trains (a pipeline rank: its stages' parameters only)
    del trainable
    # the loop the measured step runs (_driven_step): the previous step's output and loss are
    # held until the loop rebinds the names (memsim.tracer.previous)
    held = [None, None]
    for _ in range(driver.warmup):
        out, loss = held
        held.clear()
        driver.zero_grad()
        out = call(**inputs, **constants)
        loss = None if driver.owns_backward else loss_fn(out)
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
    recorder.run.interleaved = driver.owns_backward
    recorder.run.replays = driver.replays if driver.warmup > 0 else 0
    held = _driven_step(recorder, driver, call, inputs, constants, loss_fn,
                        config.keep_outputs, held)
    # DeepSpeed's stage 3 gathers its persistent (small) parameters again after the optimizer
    # step, in fresh storages they keep
    _parameters_made_in_the_step(recorder, model)
    return held, call


def _driven_step(recorder, driver, call, inputs, constants, loss_fn, keep_outputs, previous):
    """The measured step; ``previous``: a list of the last step's output and loss, emptied
    here so that the rebinding of ``out`` and ``loss`` releases them."""
    out, loss = previous
    previous.clear()
    recorder.mark(Phase.ZERO_GRAD)
    driver.zero_grad()
    recorder.mark(Phase.FORWARD)
    with _saving(recorder):
        out = call(**inputs, **constants)
        recorder.mark(Phase.LOSS)
        if not driver.owns_backward:   # else forward, loss and backward ran in call
            loss = loss_fn(out)
            check_loss(loss)
    if not keep_outputs:
        out = None
    recorder.mark(Phase.BACKWARD)
    driver.backward(loss)
    driver.label_gradients(recorder)
    recorder.mark(Phase.OPTIMIZER)
    driver.step()
    return out, loss  # held to the end of the step, as in a plain loop


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

"""What the step is given, checked before or after the symbolic run: the inputs ``forward``
takes and reads, the loss, and a precision the parameters cannot run.
"""

from __future__ import annotations

import inspect

import torch

from .errors import InputError, did_you_mean
from .records import Category, LeafRecord, OpRecord, RunRecord


def check_inputs(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Raise an InputError naming an input that ``forward`` does not take, or a parameter it
    needs that no input gives. Returns the inputs that ``forward`` only takes through
    ``**kwargs`` (:func:`check_read` checks after the run that something read them)."""
    sig = inspect.signature(model.forward)
    params = [p for p in sig.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    known = {p.name for p in params}
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        swallowed = [n for n in names if n not in known]
        for n in swallowed:
            # a near miss of a parameter (``lables``): a misspelling, said before any trace
            # (the check after the run would find it unread)
            near = did_you_mean(n, known)
            if near:
                raise InputError(
                    f"input {n!r} is not a parameter of {type(model).__name__}.forward, which "
                    "would take it through **kwargs" + near,
                    hint=f"forward takes: {', '.join(p.name for p in params)}")
        return swallowed
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


def check_driven(driver, config) -> None:
    """A library's loop (a :class:`~memsim.tracer.driver.Driver`) owns the training loop and its
    precision: autocast, accumulation and a compiled forward are errors with it."""
    autocast = config.precision.autocast is not None and not driver.precision_ok
    if autocast or config.accumulate != 1 or config.compiled:
        what = (f"precision {config.precision.value!r}" if autocast
                else "accumulate" if config.accumulate != 1 else "compiled")
        raise InputError(f"{what} is not supported with {type(driver).__name__}",
                         hint="the engine owns the training loop and its precision")


def check_precision(prec, model: torch.nn.Module, trainable: list) -> None:
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


def check_loss(loss) -> None:
    """The loss is a scalar tensor that requires grad; else an InputError saying what it is."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else (
            f"tensor of shape {tuple(loss.shape)}" if loss.dim() else "tensor without grad")
        raise InputError(f"the loss must be a scalar tensor that requires grad; got a {what}",
                         hint="pass loss_fn=... returning a scalar, or check that some "
                              "parameter requires grad")

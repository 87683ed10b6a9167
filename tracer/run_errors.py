"""An exception raised inside a symbolic run, as memsim's typed error (:func:`translate`).

The tracer knows PyTorch's failures (a missing fake kernel, a data-dependent size, the model's
own error at the example sizes). What a failure means under a library's transform (tensor
parallelism, FSDP2) is known where that transform is: such code registers an explainer
(:func:`register_explainer`), which :func:`explained` asks before the parameters of the run
are restored, so the tracer needs none of it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from .errors import DataDependentError, MemsimError, TraceError, UnsupportedOpError
from .recorder import Recorder
from .sources import model_source

# ``explainer(err, model, recorder)``: the typed error a RuntimeError raised in the step means
# (``model``: the run's model, its parameters still the run's; ``recorder``: the run's, its
# module stack naming the modules open), or None where it is not the explainer's case
Explainer = Callable[[BaseException, torch.nn.Module, Recorder], "MemsimError | None"]
_EXPLAINERS: dict[str, Explainer] = {}


def register_explainer(fn: Explainer) -> Explainer:
    """Add ``fn`` (a decorator) to the explainers :func:`explained` asks, in the order they
    were registered; one registered already (by its module and name) is an error."""
    key = f"{fn.__module__}.{fn.__qualname__}"
    if key in _EXPLAINERS:
        raise MemsimError(f"the explainer {key} is already registered")
    _EXPLAINERS[key] = fn
    return fn


def explained(err: BaseException, model: torch.nn.Module, recorder: Recorder
              ) -> MemsimError | None:
    """The first registered explainer's error for ``err``, or None where none knows it."""
    for fn in _EXPLAINERS.values():
        got = fn(err, model, recorder)
        if got is not None:
            return got
    return None


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

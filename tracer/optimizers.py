"""Optimizers by name: every ``torch.optim`` class (traced), and the popular ones outside it.

Two kinds of entries:

- **traced**: a factory ``params -> torch.optim.Optimizer`` whose real ``step`` runs in the
  symbolic step, so its state and temporaries are exact for that implementation. All of
  ``torch.optim`` (``AdamW``, ``Adafactor``, ``SGD``...), ``sgd-momentum`` (momentum 0.9) and
  ``lion`` (:class:`Lion`, the update of the reference implementation, lucidrains'
  ``lion-pytorch``: one moment, two parameter-sized temporaries per parameter in ``step``).
- **state layouts**: for optimizers whose step is a fused kernel that allocates nothing
  (bitsandbytes' 8-bit optimizers), the state tensors each parameter gets, created by a
  stand-in optimizer (:class:`StateLayout`) whose step updates in place.

bitsandbytes 8-bit layout (checked against a real ``bitsandbytes`` 0.50 optimizer on CPU in
``tests/test_optimizers.py``): parameters with at least 4,096 elements get ``uint8`` states
(one per moment) plus a float32 absmax per block of 256 elements; smaller parameters get
float32 states; one 256-entry float32 quantization map per moment is shared by all parameters;
the step count is a Python int. Paged variants keep the states in CUDA unified memory, which the
driver evicts to the host under pressure: they are reported on the host, not in the device peak.

A torch.optim class takes its keyword arguments in the name, as Python writes the call:
``"AdamW(foreach=False)"``, ``"Adam(amsgrad=True, betas=(0.9, 0.95))"``, ``"SGD(momentum=0.9,
nesterov=True)"`` (values are Python literals; each keyword is checked against the class's
signature and the optimizer is built once on a one-element parameter, so that a value it refuses
is an error before any trace). They change memory: ``amsgrad`` keeps a third state, ``foreach``
and ``fused`` change the step's temporaries, and ``foreach=False`` is what a tensor-parallel
model with plain parameters beside its DTensors needs.

Register your own in a few lines::

    from memsim.tracer.optimizers import register_optimizer
    register_optimizer("my-adam", state=lambda p: {"m": (p.shape, p.dtype),
                                                   "v": (p.shape, p.dtype)})
    register_optimizer("my-sgd", factory=lambda params: MySGD(params, lr=0.1))
"""

from __future__ import annotations

import ast
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import UsageError, did_you_mean

StateFn = Callable[[torch.Tensor], dict]


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    factory: Callable
    doc: str
    # which states live off the device on CUDA (paged / unified memory): host_state(p, name)
    host_state: Callable[[torch.Tensor, str], bool] | None = None


_REGISTRY: dict[str, OptimizerEntry] = {}


class StateLayout(torch.optim.Optimizer):
    """Creates each parameter's state from ``state(p) -> {name: (shape, dtype)}`` (and
    ``shared`` tensors once for the whole optimizer) and updates parameters in place."""

    def __init__(self, params, state: StateFn, shared: dict | None = None, lr: float = 1e-3):
        super().__init__(params, {"lr": lr})
        self._layout = state
        self._shared_spec = dict(shared or {})
        self.shared: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.shared and self._shared_spec:
                    self.shared = {k: torch.zeros(s, dtype=d, device=p.device)
                                   for k, (s, d) in self._shared_spec.items()}
                st = self.state[p]
                if not st:
                    for k, (shape, dtype) in self._layout(p).items():
                        st[k] = torch.zeros(shape, dtype=dtype, device=p.device)
                    st.update(self.shared)
                p.add_(p.grad, alpha=-group["lr"])


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), with the update of the reference implementation (lucidrains'
    ``lion-pytorch``; ``tests/test_optimizers.py`` runs it for real): one update per parameter
    in a function of its own, so each update's two temporaries are freed before the next
    parameter's (kept in ``step``'s loop, the last update lived into the next one's)."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                _lion_update(p, p.grad, st["exp_avg"], group["lr"], group["weight_decay"],
                             *group["betas"])


def _lion_update(p, grad, exp_avg, lr, wd, beta1, beta2) -> None:
    """One parameter's Lion step: decoupled weight decay, the sign of the interpolated moment,
    then the moment's update."""
    p.mul_(1 - lr * wd)
    update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
    p.add_(update, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


def register_optimizer(name: str, factory: Callable | None = None, *,
                       state: StateFn | None = None, shared: dict | None = None,
                       doc: str = "", host_state: bool | Callable = False) -> OptimizerEntry:
    """Register an optimizer by ``name``: a traced ``factory(params)`` or a state layout. A name
    already registered, or one of torch.optim's, is an error. ``host_state``: True when every
    state lives in host (paged) memory on CUDA, or ``host_state(param, state_name) -> bool``."""
    if (factory is None) == (state is None):
        raise UsageError(f"register_optimizer({name!r}): give exactly one of factory= or state=")
    if name.lower() in _REGISTRY or name.lower() in _torch_optimizers():
        raise UsageError(f"an optimizer named {name!r} is already registered",
                         hint="choose another name")
    if factory is None:
        factory = lambda params: StateLayout(params, state, shared)  # noqa: E731
    if host_state is True:
        host_state = lambda p, name: True  # noqa: E731
    entry = OptimizerEntry(name.lower(), factory, doc, host_state or None)
    _REGISTRY[entry.name] = entry
    return entry


def _bnb_8bit(moments: int, min_8bit_size: int = 4096, block: int = 256) -> tuple:
    def state(p):
        n = p.numel()
        if n < min_8bit_size:
            return {f"state{i + 1}": (p.shape, torch.float32) for i in range(moments)}
        out = {f"state{i + 1}": (p.shape, torch.uint8) for i in range(moments)}
        out.update({f"absmax{i + 1}": ((math.ceil(n / block),), torch.float32)
                    for i in range(moments)})
        return out

    shared = {f"qmap{i + 1}": ((256,), torch.float32) for i in range(moments)}
    return state, shared


def _bnb_paged(p: torch.Tensor, name: str) -> bool:
    """A paged bitsandbytes optimizer pages a moment buffer only for a parameter of at least
    1e5 elements (``Optimizer8bit.get_state_buffer``); smaller parameters' moments, the absmax
    blocks and the quantization maps are ordinary device tensors."""
    return name.startswith("state") and p.numel() >= 100_000


def _torch_optimizers() -> dict[str, type]:
    return {k.lower(): getattr(torch.optim, k) for k in dir(torch.optim)
            if isinstance(getattr(torch.optim, k), type)
            and issubclass(getattr(torch.optim, k), torch.optim.Optimizer) and k != "Optimizer"}


def names() -> list[str]:
    """Every name :func:`optimizer` accepts."""
    return sorted(set(_torch_optimizers()) | set(_REGISTRY))


def lookup(name: str) -> OptimizerEntry:
    """The entry for ``name`` (case-insensitive): registered first, then torch.optim; a
    torch.optim class with keyword arguments, ``"AdamW(foreach=False)"``
    (:func:`_with_options`)."""
    if "(" in name:
        return _with_options(name)
    key = name.lower()
    if key in _REGISTRY:
        return _REGISTRY[key]
    cls = _torch_optimizers().get(key)
    if cls is not None:
        lr = {"sgd": 1e-3}.get(key)  # SGD has no default lr
        return OptimizerEntry(key, (lambda params: cls(params, lr=lr)) if lr else
                              (lambda params: cls(params)), f"torch.optim.{cls.__name__}")
    raise UsageError(f"unknown optimizer {name!r}" + did_you_mean(key, names(), n=3),
                     hint=f"known: {', '.join(names())}; or register_optimizer(...)")


def _with_options(name: str) -> OptimizerEntry:
    """``Class(key=value, ...)``: a torch.optim class with keyword arguments, each a Python
    literal, checked against the class's signature and by building it once."""
    example = "e.g. 'AdamW(foreach=False)' or 'SGD(lr=0.01, momentum=0.9)'"
    base = name[:name.index("(")].strip()
    try:
        call = ast.parse(name.strip(), mode="eval").body
        if (not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name)
                or any(k.arg is None for k in call.keywords)):
            raise SyntaxError("not Class(key=value, ...)")
    except SyntaxError as e:
        raise UsageError(f"optimizer {name!r} is not a class name with keyword arguments "
                         f"({e.msg})", hint=example) from None
    if call.args:
        raise UsageError(f"optimizer {name!r}: give its options by keyword", hint=example)
    options = {}
    for k in call.keywords:
        try:
            options[k.arg] = ast.literal_eval(k.value)
        except ValueError:
            raise UsageError(f"optimizer {name!r}: the value of {k.arg!r} is not a Python "
                             "literal (a number, True/False/None, a string or a tuple)",
                             hint=example) from None
    key = base.lower()
    cls = _torch_optimizers().get(key)
    if cls is None:
        if key in _REGISTRY:
            raise UsageError(f"optimizer {name!r}: options in parentheses are for torch.optim's "
                             f"classes, and {base!r} is memsim's own entry",
                             hint="register_optimizer(...) one with the options you want")
        raise UsageError(f"unknown optimizer class {base!r}"
                         + did_you_mean(key, sorted(_torch_optimizers()), n=3),
                         hint=f"torch.optim's: {', '.join(sorted(_torch_optimizers()))}")
    accepted = [p for p in inspect.signature(cls.__init__).parameters
                if p not in ("self", "params")]
    for k in options:
        if k not in accepted:
            raise UsageError(f"optimizer {name!r}: torch.optim.{cls.__name__} takes no "
                             f"argument {k!r}" + did_you_mean(k, accepted, n=3),
                             hint=f"its arguments: {', '.join(accepted)}")
    if key == "sgd":
        options.setdefault("lr", 1e-3)  # SGD has no default lr

    def make(params):
        return cls(params, **options)

    try:
        make([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError, RuntimeError) as e:
        raise UsageError(f"optimizer {name!r}: torch.optim.{cls.__name__} refuses these "
                         f"options: {e}", hint=example) from None
    shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return OptimizerEntry(f"{key}({shown})", make, f"torch.optim.{cls.__name__}({shown})")


for _name, _moments, _paged in [("adamw8bit", 2, False), ("adam8bit", 2, False),
                                ("paged_adamw8bit", 2, True), ("paged_adam8bit", 2, True),
                                ("lion8bit", 1, False), ("paged_lion8bit", 1, True)]:
    _st, _sh = _bnb_8bit(_moments)
    register_optimizer(_name, state=_st, shared=_sh, host_state=_bnb_paged if _paged else False,
                       doc=f"bitsandbytes {_name} state layout ({_moments} x 8-bit + absmax)")
register_optimizer("lion", lambda params: Lion(params), doc="Lion (reference update)")
register_optimizer("sgd-momentum", lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
                   doc="torch.optim.SGD, momentum 0.9")

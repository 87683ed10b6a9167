"""Sizes that depend on tensor values, answered at a bound the user picks.

``x[x > 0]``, ``nonzero``, ``masked_select``, ``unique`` and ``torch.where(mask)`` return as many
elements as the data makes true; a symbolic run has no data. PyTorch's fake kernels give such a
size a fresh unbacked symbol, which no formula can be evaluated at. Here each such count is a
size the run can carry instead, chosen by the option ``data_dependent`` (:class:`Bound`):

- ``max`` (the default): the most it can be, every element of the mask true (a ``nonzero`` of a
  ``(B, S)`` mask counts ``B*S``). Memory only grows with these counts, so the figure is an upper
  bound, and it is exact for data that makes every element true.
- a fraction ``f`` in (0, 1]: ``ceil(f * most)`` (``0.15`` for masked-language-model labels of
  which 15% are kept).
- ``balanced``: as ``max`` for masks; a mixture of experts' routing spread evenly.

A mixture of experts' routing is followed from its ``topk`` (:mod:`memsim.tracer.known`): the
tokens each expert takes and the experts hit are the routing's (:class:`Route`), not each
mask's own bound.

What is known of the mask's values (:mod:`memsim.tracer.known`: a mask of ones, an all-true
comparison, the values of a small concrete tensor) decides the count exactly, with nothing
assumed. Every count taken at a bound is a note of the run (the op, the model's line, the bound),
which the report lists. Where a small mask has a concrete size and every element is taken as
true, the result's values are known too (the indices of every element), so that a model's loop
over them (a mixture of experts iterating over the experts hit) runs as it would on such data.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import known
from .errors import InputError
from .rules import Kind, rule

aten = torch.ops.aten


@dataclass(frozen=True)
class Bound:
    """The value a data-dependent count is answered at (see the module docstring).

    >>> Bound.parse("max"), Bound.parse("0.15"), str(Bound.parse("balanced"))
    (Bound(kind='max', fraction=Fraction(1, 1)), Bound(kind='fraction', fraction=Fraction(3, 20)), 'balanced')
    >>> Bound.parse("1.5")
    Traceback (most recent call last):
    ...
    memsim.tracer.errors.InputError: data_dependent=1.5 must be max, balanced or a fraction in (0, 1]
      hint: max: every element of a mask true (the default); 0.15: 15% of them
    """

    kind: str = "max"
    fraction: Fraction = Fraction(1)

    @classmethod
    def parse(cls, value) -> "Bound":
        if isinstance(value, Bound):
            return value
        text = str(value).strip().lower()
        if text in ("max", "balanced"):
            return cls(text)
        try:
            f = Fraction(text).limit_denominator(10_000)
        except (ValueError, ZeroDivisionError):
            f = None
        if f is None or not 0 < f <= 1:
            raise InputError(f"data_dependent={value} must be max, balanced or a fraction in "
                             "(0, 1]", hint="max: every element of a mask true (the default); "
                             "0.15: 15% of them")
        return cls("max") if f == 1 else cls("fraction", f)

    def __str__(self) -> str:
        return self.kind if self.kind != "fraction" else str(float(self.fraction))

    def describe(self) -> str:
        """The bound in words, for a note."""
        if self.kind == "fraction":
            return f"{float(self.fraction):g} of its elements true (--data-dependent)"
        return "every element of its mask true, the most it can count (--data-dependent max)"


_BOUND: contextvars.ContextVar[Bound] = contextvars.ContextVar("data_dependent",
                                                               default=Bound())


@contextlib.contextmanager
def bounded(bound: Bound):
    """Inside: data-dependent counts are answered at ``bound``."""
    token = _BOUND.set(Bound.parse(bound))
    try:
        yield
    finally:
        _BOUND.reset(token)


def _ceil_fraction(n, f: Fraction):
    """``ceil(n * f)`` of a size (an int or a SymInt), as a size (a floor division of
    non-negative terms: a negative one makes PyTorch pin the size)."""
    return (n * f.numerator + f.denominator - 1) // f.denominator


def count(most, mask: torch.Tensor | None, op: str):
    """How many elements of ``mask`` are not zero, of at most ``most``: what is known of its
    values, else the run's bound (noted); the same count each time the run counts the same mask
    (backward indexes with the mask forward saved: :func:`memsim.tracer.known.counted`)."""
    if mask is None:
        return _bounded(most, op)
    return known.counted(mask, lambda: _count(most, mask, op))


def _count(most, mask: torch.Tensor, op: str):
    real = known.contents(mask)
    if real is not None:
        with unset_fake_temporarily():
            return int((real != 0).sum())
    b = known.bounds(mask)
    if b is not None and (b[0] == b[1] == 0 or b[0] > 0 or b[1] < 0):
        why = known.why(mask)   # decided from counts at the bound: that bound is noted
        if why is not None:
            known.assume(why)
        return 0 if b[0] == b[1] == 0 else most
    return _bounded(most, op)


def _bounded(most, op: str):
    """``most`` at the run's bound (noted)."""
    known.assume(bound_note(op))
    return at_bound(most)


def bound_note(op: str) -> str:
    """The note for a count ``op`` takes at the run's bound, at the model's line."""
    from .sources import model_line
    return (f"data-dependent size: {op}{model_line()} counted with "
            f"{_BOUND.get().describe()}")


def at_bound(most):
    """A count of at most ``most`` at the run's bound (nothing noted)."""
    bound = _BOUND.get()
    if bound.kind == "fraction":
        return _ceil_fraction(most, bound.fraction)
    return most


def _all_indices(shape) -> torch.Tensor | None:
    """The indices of every element of a concrete ``shape`` (``nonzero`` of a mask of ones), or
    None where the shape is symbolic or large."""
    if not all(type(d) is int for d in shape) or math.prod(shape) > known.SMALL:
        return None
    with unset_fake_temporarily():
        return torch.ones(shape, dtype=torch.bool).nonzero()


@dataclass(frozen=True)
class Route:
    """A mixture of experts' routing (followed by :mod:`memsim.tracer.known` from ``topk``):
    each of ``tokens`` tokens picks ``k`` distinct experts of ``n``."""

    k: int
    n: int
    tokens: object  # an int or a SymInt

    def experts_hit(self, bound: Bound) -> list[int]:
        """The experts that receive tokens at ``bound``: the first ``k`` when every token
        goes to the same ones (``max``), all ``n`` when they are spread."""
        return list(range(self.k if bound.kind == "max" else self.n))

    def tokens_of(self, expert: int, bound: Bound):
        """How many tokens ``expert`` receives at ``bound``: every token (``max``: each of the
        first ``k`` experts takes all of them, the most one expert can take); the ``k T``
        choices dealt round-robin (``balanced``: ``(k T + n - 1 - e) // n`` for expert ``e``,
        which add up to ``k T``); ``ceil(f T)`` (a fraction)."""
        if expert not in self.experts_hit(bound):
            return 0
        if bound.kind == "max":
            return self.tokens
        if bound.kind == "balanced":
            return (self.tokens * self.k + self.n - 1 - expert) // self.n
        return _ceil_fraction(self.tokens, bound.fraction)

    def describe(self, bound: Bound) -> str:
        if bound.kind == "max":
            return (f"routing: every token to the same {self.k} of {self.n} experts, each "
                    "taking all of them (the most tokens one expert can take; "
                    "--data-dependent balanced spreads them evenly)")
        if bound.kind == "balanced":
            return (f"routing: the {self.k} choices of every token dealt round-robin over the "
                    f"{self.n} experts, {self.k}/{self.n} of the tokens to each "
                    "(--data-dependent balanced)")
        return (f"routing: {float(bound.fraction):g} of the tokens to each of the {self.n} "
                "experts (--data-dependent)")


def _routed(x: torch.Tensor, op: str):
    """``(count, values)`` of ``nonzero`` over a routing's mask (the experts hit, or one
    expert's slots and tokens), at the run's bound; None where ``x`` is no such mask."""
    got = known.routed(x)
    if got is None:
        return None
    route, expert = got
    bound = _route_noted(route, op)
    if expert is None:
        hit = route.experts_hit(bound)
        with unset_fake_temporarily():
            return len(hit), torch.tensor(hit, dtype=torch.long).reshape(len(hit), 1)
    return route.tokens_of(expert, bound), None


def routed_tokens(t: torch.Tensor):
    """The tokens one expert takes, where ``t`` is that expert's element of a routing's
    tokens per expert read as a number (noted), or None."""
    got = known.tokens_per_expert(t)
    if got is None:
        return None
    route, expert = got
    return route.tokens_of(expert, _route_noted(route, "tokens per expert"))


def _route_noted(route: Route, op: str) -> Bound:
    """The run's bound, the routing ``op`` counts at it noted at the model's line."""
    from .sources import model_line
    bound = _BOUND.get()
    known.assume(f"data-dependent size: {op}{model_line()}: {route.describe(bound)}")
    return bound


def _nonzero_of(x: torch.Tensor, op: str) -> torch.Tensor:
    """``x.nonzero()`` with the count the bound gives (a fake tensor; its values known where
    the mask's are, or where every element is taken as true and the mask is small)."""
    routed = _routed(x, op)
    if routed is not None:
        n, values = routed
        out = torch.empty((n, x.dim()), dtype=torch.long, device=x.device)
        if values is not None and x.dim() == 1:
            known.set_contents(out, values)
        return out
    n = count(x.numel(), x, op)
    out = torch.empty((n, x.dim()), dtype=torch.long, device=x.device)
    real = known.contents(x)
    if real is not None:
        with unset_fake_temporarily():
            known.set_contents(out, real.nonzero())
    elif type(n) is int and n == x.numel():
        idx = _all_indices(tuple(x.shape))
        if idx is not None:
            known.set_contents(out, idx)
    return out


@rule(Kind.ATEN, aten.nonzero.default,
      doc="data-dependent count: what the mask's known values give, else the bound "
          "--data-dependent picks (max: every element true); tracer/data_dependent.py")
def _nonzero(recorder, func, args, kwargs):
    return _nonzero_of(args[0], "nonzero")


@rule(Kind.ATEN, aten.masked_select.default,
      doc="data-dependent count: the mask's known values, else --data-dependent's bound of "
          "the broadcast shape's elements")
def _masked_select(recorder, func, args, kwargs):
    x, mask = args[0], args[1]
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    n = count(math.prod(shape), mask if tuple(mask.shape) == tuple(shape) else None,
              "masked_select")
    return torch.empty((n,), dtype=x.dtype, device=x.device)


def _long_indices(indices, op: str) -> list | None:
    """``indices`` with each boolean mask replaced by the long indices of its true elements
    (as ATen's index kernels do before indexing), or None where none is boolean."""
    out, masks = [], False
    for i in indices:
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            out.extend(_nonzero_of(i, op).unbind(1))
            masks = True
        else:
            out.append(i)
    return out if masks else None


@rule(Kind.ATEN, aten.index.Tensor,
      doc="a boolean mask index (x[mask]): its true elements' indices, counted as nonzero "
          "counts them (--data-dependent), then the same kernel with long indices")
def _index(recorder, func, args, kwargs):
    new = _long_indices(list(args[1]), "indexing with a boolean mask")
    if new is None:
        return func(*args, **kwargs)
    return func(args[0], new)


def _index_put(recorder, func, args, kwargs):
    new = _long_indices(list(args[1]), "assigning through a boolean mask")
    if new is None:
        return func(*args, **kwargs)
    return func(args[0], new, *args[2:], **kwargs)


for _op in (aten.index_put.default, aten.index_put_.default):
    rule(Kind.ATEN, _op, doc="a boolean mask index (x[mask] = v, and index's backward): its "
         "true elements' indices, counted as nonzero counts them (--data-dependent)")(_index_put)


def _unique(recorder, func, args, kwargs):
    """``unique`` variants: at most as many values as elements (the count is the bound's);
    inverse indices and counts have their fixed shapes."""
    x = args[0]
    names = [a.name for a in func._schema.arguments]
    opts = dict(zip(names, args), **kwargs)
    dim = opts.get("dim")
    if dim is not None:
        shape = list(x.shape)
        d = dim % max(x.dim(), 1)
        n = count(shape[d], None, "unique")
        shape[d] = n
        values = torch.empty(shape, dtype=x.dtype, device=x.device)
        inverse_shape = (x.shape[d],)
    else:
        n = count(x.numel(), None, "unique")
        values = torch.empty((n,), dtype=x.dtype, device=x.device)
        inverse_shape = tuple(x.shape)
    want_inverse = opts.get("return_inverse", False)
    want_counts = opts.get("return_counts", False)
    inverse = torch.empty(inverse_shape if want_inverse else (0,), dtype=torch.long,
                          device=x.device)
    counts = torch.empty((n,) if want_counts else (0,), dtype=torch.long, device=x.device)
    outs = len(func._schema.returns)
    return (values, inverse, counts)[:outs] if outs > 1 else values


for _op in (aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default):
    rule(Kind.ATEN, _op, doc="unique: at most as many values as elements, counted as "
         "--data-dependent bounds it; inverse indices and counts of their fixed shapes")(_unique)


@rule(Kind.ATEN, aten._ctc_loss.Tensor,
      doc="CTC loss with lengths as tensors: log_alpha is (B, T, 2 L + 1) for the longest "
          "target L, a count of the labels (--data-dependent), as the CPU kernel allocates it")
def _ctc_loss(recorder, func, args, kwargs):
    """``_ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, zero_inf)``:
    the loss per sequence and ``log_alpha``, whose last dimension is twice the longest target
    plus one (the value is the data's: the target lengths' known values, else their bound)."""
    log_probs, targets, lengths = args[0], args[1], args[3]
    real = known.contents(lengths)
    if real is not None:
        with unset_fake_temporarily():
            longest = int(real.max()) if real.numel() else 0
    else:
        most = known.most(lengths)
        if most is None:   # padded (B, L) targets: at most L each; concatenated: all of them
            most = targets.shape[-1] if targets.dim() == 2 else targets.numel()
        longest = count(most, None, "the longest target of ctc_loss")
    batched = log_probs.dim() == 3
    b = log_probs.shape[1] if batched else 1
    nll = torch.empty((b,) if batched else (), dtype=log_probs.dtype, device=log_probs.device)
    alpha = torch.empty(((b,) if batched else ()) + (log_probs.shape[0], 2 * longest + 1),
                        dtype=log_probs.dtype, device=log_probs.device)
    return nll, alpha


@rule(Kind.ATEN, aten._ctc_loss_backward.Tensor,
      doc="CTC loss's backward with lengths as tensors (no fake kernel): the gradient of "
          "log_probs, contiguous, as the CPU kernel returns it")
def _ctc_loss_backward(recorder, func, args, kwargs):
    return torch.empty(args[1].shape, dtype=args[1].dtype, device=args[1].device)


# -- values read in Python control flow ---------------------------------------------------------

@dataclass(frozen=True)
class Branch:
    """A tensor value the model read in Python (``if labels.max() >= n:``, ``.item()``) that
    the run has no data for: where (``site``, ``file.py:LINE``; ``code``, its text), the value
    the run went on with, and whether it was given (``--assume``, or a retrace that tries the
    other branch) or taken by default (a truth value: True first)."""

    site: str
    value: object
    given: bool
    code: str = ""


# site -> value: the values given for this run (StepConfig.assume, and the other branch a
# retrace tries: memsim.tracer.trace)
_DECISIONS: contextvars.ContextVar[dict] = contextvars.ContextVar("decisions", default={})


@contextlib.contextmanager
def decisions(values):
    """Inside: a value read at a site of ``values`` (``{"file.py:LINE": value}``) is that."""
    token = _DECISIONS.set(dict(values or {}))
    try:
        yield
    finally:
        _DECISIONS.reset(token)


def site_here() -> tuple[str, str] | None:
    """``("file.py:LINE", code)`` of the model's line running now, or None."""
    import os

    from .sources import model_frame
    fr = model_frame()
    if fr is None:
        return None
    return f"{os.path.basename(fr.filename)}:{fr.lineno}", (fr.line or "").strip()


def decide(t: torch.Tensor | None):
    """The value a read of ``t`` (a value the run does not know; None: a truth value an op
    computes from data) goes on with: the one given for its site, else True for a truth value
    (the other branch is tried by the trace), else None (a number: only a given value answers
    it). Recorded as a :class:`Branch`."""
    here = site_here()
    if here is None:
        return None
    site, code = here
    given = _DECISIONS.get()
    if site in given:
        value, was_given = given[site], True
    elif t is None or t.dtype == torch.bool:
        value, was_given = True, False
    else:
        return None
    known.branch(Branch(site, value, was_given, code))
    return value



@rule(Kind.ATEN, aten._nested_tensor_from_mask_left_aligned.default,
      doc="whether a padding mask is left-aligned (nn.TransformerEncoder's fast path asks): a "
          "truth value of the data, tried both ways (tracer/branching.py)")
def _left_aligned(recorder, func, args, kwargs):
    v = decide(None)
    if v is None:
        return func(*args, **kwargs)
    return bool(v)

def parse_assumptions(text: str) -> dict:
    """``--assume`` values: ``file.py:LINE=VALUE`` items, comma-separated (True/False, ints,
    floats).

    >>> parse_assumptions("modeling_led.py:1446=False,x.py:3=12")
    {'modeling_led.py:1446': False, 'x.py:3': 12}
    """
    out = {}
    for item in (p.strip() for p in str(text).split(",") if p.strip()):
        site, eq, value = item.rpartition("=")
        if not eq or ":" not in site:
            raise InputError(f"--assume item {item!r} is not FILE:LINE=VALUE",
                             hint="e.g. --assume modeling_led.py:1446=False (the line a note "
                                  "or an error names)")
        out[site.strip()] = _value(value.strip(), item)
    return out


def _value(text: str, item: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise InputError(f"--assume item {item!r}: {text!r} is not True, False or a number",
                     hint="e.g. --assume modeling_led.py:1446=False")

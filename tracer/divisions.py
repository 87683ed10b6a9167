"""Integer divisions in a run's sizes that are polynomials after all.

PyTorch keeps ``(8*s0**2)//s0`` and ``(8*s0 + 1)//(2*s0)`` as floor divisions (its ``FloorDiv``
simplifies constant divisors only). Where the quotient of the two polynomials is a polynomial
and the remainder lies in ``[0, divisor)`` at every size of the symbols' ranges, the division is
that quotient, and the modulo that remainder: ``8*s0`` and ``4`` (for ``s0 >= 1``).
Swin's windows over an image traced at multiples of its step give such sizes by the dozen; left
as they are, the peak is a ``Max`` of formulas no one can read, and each guard on them an
unsolved condition.

>>> import sympy
>>> from torch.utils._sympy.functions import FloorDiv
>>> s0 = sympy.Symbol("s0", integer=True, positive=True)
>>> exact(FloorDiv(8 * s0 ** 2, s0) + FloorDiv(8 * s0 + 1, 2 * s0), {s0: 2})
8*s0 + 4
>>> exact(FloorDiv(s0 + 3, 2), {s0: 2})   # a remainder that depends on s0: kept
((s0 + 3)//2)
>>> exact(FloorDiv(s0 + 5, s0), {s0: 2})  # 5 may be past s0 (7 // 2 is 3, not 1): kept
((s0 + 5)//s0)
"""

from __future__ import annotations

import sympy
from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

__all__ = ["exact"]


def _nonnegative(poly: sympy.Expr, lower: dict) -> bool:
    """Whether ``poly`` is >= 0 wherever each symbol is at least its lower bound: every
    coefficient of it in ``y = symbol - lower`` (y >= 0) is >= 0 (sufficient)."""
    free = sorted(poly.free_symbols, key=str)
    if not free:
        return bool(poly >= 0)
    if any(s not in lower for s in free):
        return False
    ys = {s: sympy.Dummy(nonnegative=True) for s in free}
    shifted = sympy.expand(poly.xreplace({s: ys[s] + lower[s] for s in free}))
    try:
        coeffs = sympy.Poly(shifted, *ys.values()).coeffs()
    except sympy.PolynomialError:
        return False
    return all(c >= 0 for c in coeffs)


def _split(a: sympy.Expr, b: sympy.Expr, lower: dict):
    """``(quotient, remainder)`` of ``a // b`` where both are polynomials and the remainder
    lies in ``[0, b)`` over the ranges; None otherwise."""
    free = sorted(a.free_symbols | b.free_symbols, key=str)
    if not free or not (a.is_polynomial(*free) and b.is_polynomial(*free)):
        return None
    try:
        q, r = sympy.div(sympy.Poly(a, *free), sympy.Poly(b, *free), domain="QQ")
    except (sympy.PolynomialError, sympy.CoercionFailed):
        return None
    q, r = q.as_expr(), r.as_expr()
    if not all(c.is_integer for c in sympy.Poly(q, *free).coeffs()):
        return None
    if not (_nonnegative(r, lower) and _nonnegative(sympy.expand(b - r - 1), lower)):
        return None
    return q, r


def exact(expr: sympy.Expr, lower: dict) -> sympy.Expr:
    """``expr`` with each floor division and modulo of polynomials replaced by its quotient
    or remainder where those hold at every size (``lower``: each symbol's least size)."""
    if not isinstance(expr, sympy.Basic) or not expr.has(FloorDiv, Mod, PythonMod):
        return expr

    def walk(e):
        if not e.args:
            return e
        args = tuple(walk(a) for a in e.args)
        if isinstance(e, (FloorDiv, Mod, PythonMod)):
            split = _split(args[0], args[1], lower)
            if split is not None:
                return split[0] if isinstance(e, FloorDiv) else split[1]
        return e.func(*args) if args != e.args else e

    return walk(expr)

"""Symbolic peaks of live memory over a run's allocation timeline.

Sizes are polynomials in positive integer symbols. The running sum of live bytes is tracked as a
vector of integer coefficients; every local maximum is a candidate for the peak. A candidate is
dropped when another one is at least as large for every admissible size, proven by shifting each
symbol to its lower bound (``x = lo + y``, ``y >= 0``) and comparing coefficients: a polynomial
in ``y`` with no negative coefficient is ``>= 0`` for all ``y >= 0``. What remains is an
unevaluated ``Max`` whose arguments are the distinct regimes of the peak.

>>> import sympy
>>> B, S = sympy.symbols("B S", positive=True, integer=True)
>>> c = [Candidate(B*S, 0, None), Candidate(2*B*S, 1, None), Candidate(S**2, 2, None)]
>>> [str(k.expr) for k in prune(c, [B, S], {"B": 2, "S": 2})]
['2*B*S', 'S**2']
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, Iterable, Sequence

import numpy as np
import sympy
from sympy.printing.pycode import PythonCodePrinter

from .search import last_true


class Candidate:
    """A possible peak: its bytes (sympy), the event index where it is reached, and a label.
    ``terms``: ``expr`` as ``{monomial: coefficient}`` where known (the running sum's own;
    saves expanding ``expr`` again). Given ``terms``, ``expr`` may be None: it is built on
    first use (a run emits thousands of candidates, of which pruning keeps a few)."""

    __slots__ = ("_expr", "event", "label", "terms")

    def __init__(self, expr: sympy.Expr | None, event: int, label: object,
                 terms: dict | None = None):
        if expr is None and terms is None:
            raise ValueError("a candidate needs its bytes: expr or terms")
        self._expr, self.event, self.label, self.terms = expr, event, label, terms

    @property
    def expr(self) -> sympy.Expr:
        if self._expr is None:
            self._expr = sympy.Add(*[c * m for m, c in self.terms.items() if c])
        return self._expr

    def __eq__(self, other) -> bool:
        if not isinstance(other, Candidate):
            return NotImplemented
        return (self.event, self.label, self.expr) == (other.event, other.label, other.expr)

    def __hash__(self) -> int:
        return hash((self.event, self.expr))

    def __repr__(self) -> str:
        return f"Candidate(expr={self.expr}, event={self.event}, label={self.label!r})"


def _number(c: sympy.Rational) -> int | Fraction:
    """A sympy rational as an int, or a Fraction where it is not whole."""
    return int(c) if c.is_Integer else Fraction(int(c.p), int(c.q))


class PolyBasis:
    """Maps size expressions to ``{monomial: coefficient}`` dicts, with a cache.

    Monomials are sympy products of the symbols and of any non-polynomial atoms a size holds
    (``floor(S/2)`` from a strided pooling, say): an atom stays a factor of its monomial.
    Coefficients are ints, or Fractions where a symbol is traced at multiples of a step
    (``B*H**2/4`` bytes for ``H`` a multiple of 32: whole at every size the formulas hold for).
    """

    def __init__(self, symbols: Sequence[sympy.Symbol]):
        self.symbols = tuple(symbols)
        self._cache: dict[sympy.Expr, dict[sympy.Expr, int]] = {}

    def coeffs(self, expr: sympy.Expr) -> dict[sympy.Expr, int]:
        got = self._cache.get(expr)
        if got is None:
            got = {}
            for m, c in sympy.expand(expr).as_coefficients_dict().items():
                if c != 0:
                    if not c.is_Rational:
                        raise ValueError(f"size {expr} has a non-rational coefficient {c}")
                    got[m] = got.get(m, 0) + _number(c)
            self._cache[expr] = got
        return got


def running_peaks(events: Iterable, size: Callable[[int], dict | None], basis: PolyBasis,
                  start: int, label: Callable[[int], object]) -> list[Candidate]:
    """Candidates for the maximum of the running sum of live bytes.

    ``events`` are ``(sign, sid)`` in order; ``size(sid)`` gives a coefficient dict or None (not
    counted). The sum at ``start`` and each local maximum at or after ``start`` are candidates.
    """
    events = list(events)
    cur: dict[tuple, int] = {}
    out: list[Candidate] = []
    seen: set = set()
    rising = False

    def emit(i):
        key = frozenset((m, c) for m, c in cur.items() if c)
        if key not in seen:
            seen.add(key)
            terms = dict(key)
            out.append(Candidate(None, i, label(i), terms))

    for i, (sign, sid) in enumerate(events):
        if i == start:
            emit(i - 1)
        c = size(sid)
        if not c:
            continue
        if sign < 0 and rising and i > start:
            emit(i - 1)
        for m, v in c.items():
            cur[m] = cur.get(m, 0) + sign * v
        rising = sign > 0
    if rising or start >= len(events):
        emit(len(events) - 1)
    return out


def _shift_monomial(m: sympy.Expr, lows: dict[sympy.Symbol, int]) -> dict[sympy.Expr, int]:
    """``m`` with each symbol ``x`` replaced by ``lo + x`` (then ``x >= 0``), as coefficients.

    Monomials holding a non-polynomial atom are returned unshifted, tagged so that dominance
    demands equal coefficients on them.
    """
    powers = m.as_powers_dict()
    if any(b not in lows for b in powers if b != 1):
        return {("atom", m): 1}
    return _shift_poly(m, lows)


def _shift_poly(p: sympy.Expr, lows: dict[sympy.Symbol, int]) -> dict:
    out: dict = {}
    shifted = sympy.expand(p.xreplace({s: s + lo for s, lo in lows.items()}))
    for mm, c in shifted.as_coefficients_dict().items():
        if c:
            out[mm] = out.get(mm, 0) + _number(c)
    return out


def _atom_bounds(m: sympy.Expr, lows: dict[sympy.Symbol, int]):
    """Polynomial bounds ``(lo, hi)`` of a monomial ``symbols * floor/ceiling(p/q)``, or None.

    ``ceiling(p/q)`` lies in ``[p/q, p/q + (q-1)/q]`` and ``floor(p/q)`` in
    ``[p/q - (q-1)/q, p/q]`` for integer-valued ``p``; the symbols are positive.
    """
    atoms = [f for f in sympy.Mul.make_args(m) if f.free_symbols and not (
        f in lows or f.is_Pow and f.base in lows and f.exp.is_Integer and f.exp > 0)]
    if len(atoms) != 1 or not isinstance(atoms[0], (sympy.ceiling, sympy.floor)):
        return None
    atom = atoms[0]
    arg = atom.args[0]
    num, den = arg.as_numer_denom()
    if not (den.is_Integer and den > 0 and num.is_polynomial(*lows)
            and all(c.is_Integer for c in sympy.Poly(num, *lows).coeffs())):
        return None
    slack = sympy.Rational(int(den) - 1, int(den))
    rest = m / atom
    lo, hi = (arg, arg + slack) if isinstance(atom, sympy.ceiling) else (arg - slack, arg)
    return sympy.expand(rest * lo), sympy.expand(rest * hi)


def prune(cands: list[Candidate], symbols: Sequence[sympy.Symbol],
          lows: dict[str, int]) -> list[Candidate]:
    """Drop every candidate that another is provably >= for all sizes >= ``lows``.

    ``a`` dominates ``b`` when the shifted coefficients of ``a - b`` are all >= 0, with any
    non-polynomial atoms equal in both; or, for atoms ``floor``/``ceiling`` of a polynomial over
    an integer (the CUDA allocator's block rounding), when ``a``'s lower bound is >= ``b``'s
    upper bound in the same sense.
    """
    if not cands:
        return []
    basis = PolyBasis(symbols)
    low = {s: lows.get(s.name, 1) for s in symbols}
    cache: dict = {}
    bounds_cache: dict = {}
    shifted, los, his = [], [], []
    for c in cands:
        acc: dict = {}
        lo: dict = {}
        hi: dict = {}
        bounded = True
        for m, v in (c.terms if c.terms is not None else basis.coeffs(c.expr)).items():
            if m not in cache:
                cache[m] = _shift_monomial(m, low)
            for mm, k in cache[m].items():
                acc[mm] = acc.get(mm, 0) + v * k
            if not any(isinstance(k, tuple) for k in cache[m]):
                for mm, k in cache[m].items():
                    lo[mm] = lo.get(mm, 0) + v * k
                    hi[mm] = hi.get(mm, 0) + v * k
                continue
            if m not in bounds_cache:
                b = _atom_bounds(m, low)
                bounds_cache[m] = None if b is None else tuple(_shift_poly(x, low) for x in b)
            b = bounds_cache[m]
            if b is None:
                bounded = False
                continue
            for mm, k in b[0 if v > 0 else 1].items():
                lo[mm] = lo.get(mm, 0) + v * k
            for mm, k in b[1 if v > 0 else 0].items():
                hi[mm] = hi.get(mm, 0) + v * k
        shifted.append(acc)
        los.append(lo if bounded else None)
        his.append(hi if bounded else None)
    keys = sorted({k for s in shifted for k in s}, key=str)
    exact = [isinstance(k, tuple) for k in keys]
    vecs = [tuple(s.get(k, 0) for k in keys) for s in shifted]
    has_atoms = [any(isinstance(k, tuple) for k in s) for s in shifted]
    bkeys = sorted({k for b in los + his if b for k in b}, key=str)
    lvec = [tuple(b.get(k, 0) for k in bkeys) if b is not None else None for b in los]
    hvec = [tuple(b.get(k, 0) for k in bkeys) if b is not None else None for b in his]
    order = sorted(range(len(cands)), key=lambda i: (
        -sum(lvec[i] if lvec[i] is not None else vecs[i]), cands[i].event))

    # a dominates b: every shifted coefficient of a is >= b's (equal on atoms), or a's lower
    # bound is >= b's upper bound where atoms are involved; as integer arrays (fractions
    # scaled to one denominator), each candidate checked against all kept ones at once
    vm = _scaled(vecs, len(keys))
    lm, hm = _scaled(lvec + hvec, len(bkeys)).reshape(2, len(cands), len(bkeys))
    ex = np.array(exact, dtype=bool)
    atoms = np.array(has_atoms, dtype=bool)
    lok = np.array([v is not None for v in lvec], dtype=bool)
    hok = np.array([v is not None for v in hvec], dtype=bool)

    def beats(a, b) -> np.ndarray:
        """Whether each of ``a`` dominates each of ``b`` (one side a single index)."""
        va, vb = vm[a], vm[b]
        first = np.where(ex, va == vb, va >= vb).all(axis=-1)
        second = (atoms[a] | atoms[b]) & lok[a] & hok[b] & (lm[a] >= hm[b]).all(axis=-1)
        return first | second

    kept = np.empty(0, dtype=np.int64)
    for i in order:
        if kept.size:
            if beats(kept, i).any():
                continue
            kept = kept[~beats(i, kept)]
        kept = np.append(kept, i)
    kept = [int(k) for k in kept]
    kept.sort(key=lambda i: cands[i].event)
    return [cands[i] for i in kept]


def _scaled(rows: list, width: int) -> np.ndarray:
    """Rows of ints and fractions (None: zeros) as one integer array, all multiplied by the
    least common denominator (Python ints where they would not fit in int64)."""
    den = 1
    for r in rows:
        for x in r or ():
            if isinstance(x, Fraction):
                den = math.lcm(den, x.denominator)
    ints = [[int(x * den) for x in r] if r is not None else [0] * width for r in rows]
    big = max((abs(x) for r in ints for x in r), default=0)
    arr = np.array(ints, dtype=np.int64 if big < 2 ** 62 else object)
    return arr.reshape(len(rows), width)


def exact_values(exprs: Sequence[sympy.Expr], symbols: Sequence[sympy.Symbol]) -> Callable:
    """One function of integer ``symbols`` returning the list of ``exprs``' values with exact
    integer arithmetic: ``floor``/``ceiling`` of a polynomial over an integer become integer
    divisions, so that no float is involved at any size. One code generation for a peak's
    many candidates."""
    printer = _ExactPrinter({"fully_qualified_modules": False, "inline": True,
                             "allow_unknown_functions": True,
                             "user_functions": {k: k for k in _EXACT}})
    return sympy.lambdify(list(symbols), [sympy.sympify(e) for e in exprs],
                          modules=[_EXACT, "math"], printer=printer)


class _ExactPrinter(PythonCodePrinter):
    """Python code in which ``floor``/``ceiling`` of ``p/q`` are the integer divisions
    ``fdiv(p, q)``/``cdiv(p, q)`` of its numerator and denominator. Printed, not substituted:
    a peak's candidates are large sums, and rebuilding them around each replaced node
    (``Expr.replace``/``xreplace``) took seconds per analysis."""

    def _division(self, name: str, e) -> str:
        num, den = e.args[0].as_numer_denom()
        return f"{name}({self._print(num)}, {self._print(den)})"

    def _print_floor(self, e) -> str:
        return self._division("fdiv", e)

    def _print_ceiling(self, e) -> str:
        return self._division("cdiv", e)


# torch's own integer functions (a kernel's ``//``, ``%`` or ``math.ceil(n / k)`` on sizes:
# the CPU LSTM's page rounding, F.interpolate's scaled sizes), evaluated exactly
_EXACT = {"cdiv": lambda p, q: -((-p) // q), "fdiv": lambda p, q: p // q,
          "FloorDiv": lambda p, q: p // q, "CleanDiv": lambda p, q: p // q,
          "PythonMod": lambda p, q: p % q, "Mod": lambda p, q: p % q,
          "IntTrueDiv": Fraction, "CeilToInt": math.ceil, "FloorToInt": math.floor}


def as_max(cands: Sequence[Candidate]) -> sympy.Expr:
    """The peak as a sympy expression: one candidate, or an unevaluated ``Max`` of several."""
    return unevaluated_max([c.expr for c in cands])


def unevaluated_max(exprs: Sequence[sympy.Expr]) -> sympy.Expr:
    """``Max`` of ``exprs`` as given, in their order: ``sympy.Max(..., evaluate=False)`` still
    sorts its arguments by sympy's canonical key, which for the thousands of large candidates
    of a tensor-parallel model's peak was a large part of its analysis (Llama-3-70B over TP 8
    with sequence parallelism x FSDP 8, ``benchmarks/frontier_strategies.py``). Printers that
    need an order sort them themselves."""
    exprs = list(dict.fromkeys(sympy.sympify(e) for e in exprs))
    if not exprs:
        return sympy.Integer(0)
    if len(exprs) == 1:
        return exprs[0]
    out = sympy.Expr.__new__(sympy.Max, *exprs)
    out._argset = frozenset(exprs)
    return out


def regime_changes(cands: Sequence[Candidate], sym: sympy.Symbol, at: dict,
                   lo: int, hi: int | None) -> list[tuple[int, Candidate]]:
    """Where the largest candidate changes as ``sym`` grows, others held at ``at``.

    The winner is found at ``lo`` and at powers of two up to ``hi`` (or 2**24), and each change
    between two samples is located exactly by bisection. Returns ``[(first value of sym where
    the candidate is largest, candidate), ...]``. A regime that starts and ends between two
    samples can be missed; the peak formula itself is unaffected.
    """
    if not cands:
        return []
    others = [(s, v) for s, v in at.items() if s != sym]
    syms = [sym] + [s for s, _ in others]
    fixed = [v for _, v in others]
    every = exact_values([c.expr for c in cands], syms)
    top = hi if hi is not None else 2 ** 24

    def best(v: int) -> int:
        vals = every(v, *fixed)
        return max(range(len(vals)), key=lambda k: (vals[k], -cands[k].event))

    samples = sorted({lo, top} | {2 ** k for k in range(1, 25) if lo < 2 ** k < top})
    out = [(lo, best(lo))]
    prev = lo
    for v in samples[1:]:
        w = best(v)
        if w != out[-1][1]:
            # the last size where the previous winner still wins: at prev it does, at v not
            won = out[-1][1]
            b = last_true(lambda x: best(x) == won, prev, v) + 1
            out.append((b, best(b)))
            if out[-1][1] != w:
                out.append((v, w))
        prev = v
    return [(v, cands[k]) for v, k in out]

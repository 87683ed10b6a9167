"""The symbolic peak machinery on hand-made timelines (derivations beside the values), and
its pruning against brute force over random candidates and timelines."""

import functools

import sympy
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from memsim.analysis.peak import Candidate, PolyBasis, as_max, prune, regime_changes, running_peaks

B, S = sympy.symbols("B S", positive=True, integer=True)


def _peaks(sizes, events, start=0):
    basis = PolyBasis([B, S])
    return running_peaks(events, lambda sid: basis.coeffs(sizes[sid]), basis, start,
                         lambda i: i)


def test_running_peaks_are_local_maxima():
    # +a(B*S) +b(2*B*S) -a +c(S**2) -b -c: local maxima after +b (3BS) and after +c (2BS+S^2)
    sizes = {0: B * S, 1: 2 * B * S, 2: S ** 2}
    ev = [(1, 0), (1, 1), (-1, 0), (1, 2), (-1, 1), (-1, 2)]
    got = [c.expr for c in _peaks(sizes, ev)]
    assert got == [0, 3 * B * S, 2 * B * S + S ** 2]


def test_start_state_is_a_candidate():
    # live before the step: 100 bytes of parameters; the step adds and frees B bytes
    sizes = {0: sympy.Integer(100), 1: B}
    got = [c.expr for c in _peaks(sizes, [(1, 0), (1, 1), (-1, 1)], start=1)]
    assert got == [100, B + 100]


def test_prune_uses_lower_bounds():
    # 2*B*S >= B*S always; B*S + 3 vs 2*B*S: for B, S >= 2, 2BS - (BS + 3) = BS - 3 >= 1
    c = [Candidate(B * S + 3, 0, "a"), Candidate(2 * B * S, 1, "b")]
    assert [k.label for k in prune(c, [B, S], {"B": 2, "S": 2})] == ["b"]
    # ... but not for B, S >= 1 (at B = S = 1: 4 > 2), so both stay
    assert [k.label for k in prune(c, [B, S], {"B": 1, "S": 1})] == ["a", "b"]


def test_prune_keeps_crossing_regimes():
    # 16*S**2 vs 1000*S: neither dominates (cross at S = 62.5)
    c = [Candidate(1000 * S, 0, "linear"), Candidate(16 * S ** 2, 1, "quadratic")]
    kept = prune(c, [S], {"S": 2})
    assert len(kept) == 2
    ch = regime_changes(kept, S, {}, 2, None)
    assert [(v, k.label) for v, k in ch] == [(2, "linear"), (63, "quadratic")]


def test_atoms_must_match_exactly():
    f = sympy.floor(S / 2)
    c = [Candidate(4 * f + B, 0, "a"), Candidate(4 * f + 2 * B, 1, "b"),
         Candidate(8 * f, 2, "c")]
    # b >= a (same atom part, more B); c has a different atom part: kept
    assert [k.label for k in prune(c, [B, S], {"B": 2, "S": 2})] == ["b", "c"]


def test_as_max_is_unevaluated_and_substitutes():
    m = as_max([Candidate(1000 * S, 0, None), Candidate(16 * S ** 2, 1, None)])
    assert isinstance(m, sympy.Max)
    assert m.subs(S, 10) == 10000 and m.subs(S, 100) == 160000


def test_exact_values_takes_torch_integer_functions():
    """Sizes from a kernel's ``//``, ``%`` and ``math.ceil(n / k)`` (the CPU LSTM's page rounding
    made ``FloorDiv``) are evaluated exactly; the text output's regime search failed on them with
    ``NameError: FloorDiv``."""
    import sympy
    from torch.utils._sympy.functions import CeilToInt, FloorDiv, IntTrueDiv, PythonMod

    from memsim.analysis.peak import exact_values

    B, S = sympy.symbols("B S", positive=True, integer=True)
    exprs = [FloorDiv(512 * B * S + 4095, 4096), PythonMod(S, 8),
             CeilToInt(IntTrueDiv(S, 32)) * 32]
    f = exact_values(exprs, [B, S])
    assert f(3, 41) == [(512 * 3 * 41 + 4095) // 4096, 41 % 8, 64]


# -- pruning against brute force -------------------------------------------------------------
#
# A size is built here as a sum of terms: a polynomial ``{(i, j): c}`` (``c * B**i * S**j``,
# coefficients of either sign), or ``c * B**i * S**j * atom`` with ``atom`` the ``ceiling`` or
# ``floor`` of a polynomial over an integer ``q``. CPU sizes are polynomials (``4*B*(S - 1)``)
# and strided sizes (``floor((S - 3)/2)``, which is negative at S = 1); CUDA sizes are
# ``512*ceiling(nbytes/512)``, the allocator's 512-byte blocks (analysis/allocator.py). Each is
# evaluated at a point with Python's integers (integer division for the atoms), apart from
# sympy and from memsim.

MONOMIALS = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]   # B**i * S**j


def _poly(draw, lo: int, hi: int) -> dict:
    """``{(i, j): coefficient}``, at least one term."""
    ms = draw(st.lists(st.sampled_from(MONOMIALS), min_size=1, max_size=3, unique=True))
    return {m: draw(st.integers(lo, hi)) for m in ms}


def _scaled(p: dict, k: int, plus: int = 0) -> dict:
    out = {m: k * c for m, c in p.items()}
    out[(0, 0)] = out.get((0, 0), 0) + plus
    return out


def _atom(kind: str, p: dict, q: int, coef: int | None = None, at=(0, 0)) -> tuple:
    """``coef * B**i * S**j * kind(p / q)`` (``coef`` q by default: ``q*ceiling(p/q)``, ``p``
    rounded up to a multiple of ``q``)."""
    return (("atom", q if coef is None else coef, at, (kind, p, q)),)


def _block(nbytes: dict) -> tuple:
    """The CUDA charge of a storage of ``nbytes``: ``512 * ceiling(nbytes / 512)``."""
    return _atom("ceiling", nbytes, 512)


def _bytes_of(p: dict) -> tuple:
    return (("poly", p),)


@st.composite
def sizes(draw):
    """A random size: a polynomial, a CUDA block of random bytes, or a multiple of a strided
    ``floor``/``ceiling((p + k)/q)`` (``k`` may make it negative at the smallest sizes)."""
    kind = draw(st.sampled_from(["poly", "block", "floor", "ceiling"]))
    if kind == "poly":
        return _bytes_of(_poly(draw, -8, 64))
    if kind == "block":
        return _block(_poly(draw, 1, 2048))
    return _atom(kind, _scaled(_poly(draw, 1, 6), 1, draw(st.integers(-6, 6))),
                 draw(st.sampled_from([2, 3, 4, 64])), draw(st.integers(-3, 8)),
                 draw(st.sampled_from(MONOMIALS[:4])))


def _poly_expr(p: dict):
    return sympy.Add(*[c * B ** i * S ** j for (i, j), c in p.items()])


def _poly_value(p: dict, b: int, s: int) -> int:
    return sum(c * b ** i * s ** j for (i, j), c in p.items())


def size_expr(z):
    out = []
    for t in z:
        if t[0] == "poly":
            out.append(_poly_expr(t[1]))
        else:
            _, coef, (i, j), (kind, p, q) = t
            f = sympy.ceiling if kind == "ceiling" else sympy.floor
            out.append(coef * B ** i * S ** j * f(_poly_expr(p) / q))
    return sympy.Add(*out)


def size_value(z, b: int, s: int) -> int:
    out = 0
    for t in z:
        if t[0] == "poly":
            out += _poly_value(t[1], b, s)
        else:
            _, coef, (i, j), (kind, p, q) = t
            n = _poly_value(p, b, s)
            out += coef * b ** i * s ** j * (-(-n // q) if kind == "ceiling" else n // q)
    return out


def _grid(lo_b: int, lo_s: int) -> list[tuple[int, int]]:
    """Points at and above the lower bounds: the smallest sizes (where a block's rounding is
    largest against its bytes), and around multiples of 64 and 512."""
    bs = sorted({lo_b, lo_b + 1, lo_b + 2, 5, 8, 33, 100, 1000} - set(range(lo_b)))
    ss = sorted({lo_s, lo_s + 1, lo_s + 2, 7, 63, 64, 65, 255, 257, 511, 512, 513, 1000,
                 4097} - set(range(lo_s)))
    return [(b, s) for b in bs for s in ss]


@st.composite
def near_pairs(draw):
    """Two sizes made from one storage of ``x`` bytes that nearly tie, of a kind only the
    bounds of their atoms decide (in either order): ``x`` plus a few bytes about a bound
    (a CPU size) against its CUDA block, or ``x`` rounded up or down to a multiple of
    ``q``; two blocks of ``x`` against one of ``2x`` (equal bytes, not equal blocks); the
    remainder ``x - q*floor(x/q)`` (an atom with a negative coefficient) against ``q - 1``
    and a few bytes; ``k`` and ``k'`` times ``floor((x + c)/q)`` (negative at the smallest
    sizes for ``c < 0``); ``x`` and a few bytes against ``x + B`` or ``x + S`` (they cross
    at the smallest sizes)."""
    x = _poly(draw, 1, 600)
    q = draw(st.sampled_from([2, 3, 4, 64]))
    kind = draw(st.sampled_from(["block", "ceiling", "floor", "split", "remainder", "times",
                                 "cross"]))
    if kind == "block":
        d = draw(st.sampled_from([-1, 0, 1, 510, 511, 512]))
        pair = [_bytes_of(_scaled(x, 1, d)), _block(x)]
    elif kind == "ceiling":
        d = draw(st.sampled_from([-1, 0, q - 2, q - 1, q]))
        pair = [_bytes_of(_scaled(x, 1, d)), _atom("ceiling", x, q)]
    elif kind == "floor":
        d = draw(st.sampled_from([-q, 1 - q, 2 - q, -1, 0]))
        pair = [_bytes_of(_scaled(x, 1, d)), _atom("floor", x, q)]
    elif kind == "split":
        pair = [_block(x) + _block(x), _block(_scaled(x, 2))]
    elif kind == "remainder":
        d = draw(st.sampled_from([-1, 0, 1]))
        pair = [_bytes_of(x) + _atom("floor", x, q, -q), _bytes_of({(0, 0): q - 1 + d})]
    elif kind == "times":
        c = _scaled(_poly(draw, 1, 3), 1, draw(st.integers(-6, 0)))
        pair = [_atom("floor", c, q, draw(st.integers(1, 3))),
                _atom("floor", c, q, draw(st.integers(1, 3)))]
    else:
        pair = [_bytes_of(_scaled(x, 1, draw(st.integers(1, 4)))),
                _bytes_of(x) + _bytes_of({draw(st.sampled_from([(1, 0), (0, 1)])): 1})]
    return draw(st.permutations(pair))


@st.composite
def candidate_sets(draw):
    """Candidates as running sums make them, at a few local maxima: the same polynomial
    bytes (parameters, say) and one or two sizes each, from :func:`near_pairs` and random
    ones (:func:`sizes`); the symbols' lower bounds; and whether to give the candidates as
    coefficient dicts (the running sum's) or as expressions."""
    pool = draw(near_pairs()) + draw(st.lists(sizes(), max_size=2))
    common = _bytes_of(_poly(draw, 0, 64))
    picks = st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=2)
    cands = [[common, pool[0]], [common, pool[1]]] + [
        [common] + [pool[i] for i in p] for p in draw(st.lists(picks, max_size=2))]
    return cands, draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.booleans())


def _check_prune(cands, lo_b, lo_s, as_terms):
    """``prune`` of ``cands`` (lists of sizes) against the maximum of all at every point."""
    exprs = [sympy.Add(*[size_expr(z) for z in c]) for c in cands]
    basis = PolyBasis([B, S])
    given_ = [Candidate(None, i, i, dict(basis.coeffs(e))) if as_terms else Candidate(e, i, i)
              for i, e in enumerate(exprs)]
    kept = prune(given_, [B, S], {"B": lo_b, "S": lo_s})
    assert kept and all(k is given_[k.label] for k in kept)
    for b, s in _grid(lo_b, lo_s):
        values = [sum(size_value(z, b, s) for z in c) for c in cands]
        assert max(values[k.label] for k in kept) == max(values), (b, s)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(candidate_sets())
# 500 B against one 512 B block of S bytes: S + 500 (CPU) is >= 512*ceiling(S/512)'s lower
# bound S, but not its upper bound S + 511; at S = 1 the block's 512 B is the peak
@example(([[_bytes_of({(0, 0): 500, (0, 1): 1})], [_block({(0, 1): 1})]], 1, 1, False))
def test_prune_keeps_the_max_at_every_point(case):
    """The pruned candidates' maximum equals the maximum over all candidates, at every point
    of a grid at and above the lower bounds, each value computed with integers by the test
    (ceiling and floor as integer divisions): nothing that is ever the peak is dropped. CPU
    candidates (polynomials, floors of strided sizes) and CUDA ones (512-byte blocks),
    given as expressions or as the running sum's coefficient dicts."""
    _check_prune(*case)


def _bytes(draw) -> dict:
    """A storage's bytes, never negative at sizes >= 1: positive coefficients, and maybe a
    term ``c * B**i * S**j * (S - 1)`` (``4*B*(S - 1)``: a shifted or trimmed sequence)."""
    p = _poly(draw, 0, 64)
    if draw(st.booleans()):
        c, (i, j) = draw(st.integers(1, 8)), draw(st.sampled_from(MONOMIALS[:4]))
        p[(i, j + 1)] = p.get((i, j + 1), 0) + c
        p[(i, j)] = p.get((i, j), 0) - c
    return p


@st.composite
def timelines(draw):
    """A run's events over storages of random sizes: ``(sign, storage)``, each storage
    allocated once and freed at most once after; the index where the measured step starts;
    CUDA (sizes charged in 512-byte blocks) or CPU."""
    cuda = draw(st.booleans())
    n = draw(st.integers(1, 7))
    # storages of 1 to 3 times one of two sizes (one of 2x bytes against two of x), or of
    # their own
    xs = [_poly(draw, 1, 600) if cuda else _bytes(draw) for _ in range(2)]
    raw = [draw(st.sampled_from([_scaled(x, k) for x in xs for k in (1, 2, 3)]))
           if draw(st.booleans()) else _poly(draw, 1, 600) if cuda else _bytes(draw)
           for _ in range(n)]
    order = draw(st.permutations(range(n)))
    events, live = [], []
    for sid in order:
        events.append((1, sid))
        live.append(sid)
        while live and draw(st.booleans()):
            events.append((-1, live.pop(draw(st.integers(0, len(live) - 1)))))
    start = draw(st.integers(0, len(events)))
    return raw, events, start, cuda, draw(st.integers(1, 3)), draw(st.integers(1, 3))


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(timelines())
def test_running_peaks_and_prune_keep_the_peak(case):
    """The peak of a timeline as memsim computes it (``running_peaks`` then ``prune``) equals,
    at every point of the grid, the largest running sum of live bytes at or after the start,
    computed event by event by the test (a CUDA storage of ``n`` bytes charged
    ``512 * ceil(n / 512)``)."""
    raw, events, start, cuda, lo_b, lo_s = case
    charge = [_block(p) if cuda else _bytes_of(p) for p in raw]
    basis = PolyBasis([B, S])
    sizes_ = [basis.coeffs(size_expr(z)) for z in charge]
    kept = prune(running_peaks(events, sizes_.__getitem__, basis, start, lambda i: i),
                 [B, S], {"B": lo_b, "S": lo_s})
    for b, s in _grid(lo_b, lo_s):
        value = [size_value(z, b, s) for z in charge]
        live, best = 0, None
        for i, (sign, sid) in enumerate(events):
            if i == start:
                best = live
            live += sign * value[sid]
            if i >= start:
                best = live if best is None else max(best, live)
        if best is None:  # the step starts after the last event
            best = live
        got = max(sum(c * _monomial_value(m, b, s) for m, c in k.terms.items()) for k in kept)
        assert got == best, (b, s)


def _monomial_value(m, b: int, s: int) -> int:
    """A monomial of the running sum (``B*S``, ``ceiling(S/512)``, ...) at ``B = b, S = s``,
    with integer division for the atoms."""
    i, j, atoms = _monomial_parts(m)
    out = b ** i * s ** j
    for num, den, e in atoms:
        out *= (-(-_poly_value(num, b, s) // den)) ** e
    return out


@functools.lru_cache(maxsize=None)
def _monomial_parts(m) -> tuple:
    """``m`` as ``(exponent of B, of S, [(numerator {(i, j): c}, denominator, exponent)])``
    for its ``ceiling`` factors."""
    i = j = 0
    atoms = []
    for f, e in m.as_powers_dict().items():
        if f == B:
            i = int(e)
        elif f == S:
            j = int(e)
        elif isinstance(f, sympy.ceiling):
            num, den = f.args[0].as_numer_denom()
            terms = {k: int(c) for k, c in sympy.Poly(num, B, S).terms()}
            atoms.append((terms, int(den), int(e)))
        elif f != 1:
            raise AssertionError(f"unexpected factor {f}")
    return i, j, atoms

"""The symbolic peak machinery on hand-made timelines (derivations beside the values)."""

import sympy

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

"""The traced graph: fx (ATen level) and networkx projections of the same run."""

import networkx as nx
import sympy
import torch

from memsim.tracer import Category, trace

from tests.support import zoo


def _trace():
    with torch.device("meta"):
        m = zoo.Block()
    return trace(m, {"x": ("float32", ["B", "S", 32])}, device="cpu")


def test_networkx_graph_attributes():
    t = _trace()
    g = t.graph()
    assert nx.is_directed_acyclic_graph(g)
    ops = [d for _, d in g.nodes(data=True) if d["kind"] == "op"]
    phases = {d["phase"] for d in ops}
    assert {"forward", "backward", "optimizer"} <= phases
    mm = next(d for d in ops if d["op"] == "aten.addmm.default" and d["phase"] == "forward")
    B, S = t.symbols["B"], t.symbols["S"]
    # c_attn: (B*S, 32) @ (32, 96) -> 96 * 4 bytes per row
    assert mm["module"] == "attn.c_attn" and mm["nbytes"] == 384 * B * S
    assert mm["outputs"][0][0] == (B * S, 96) and mm["outputs"][0][1] == "float32"
    leaves = {d["op"]: d for _, d in g.nodes(data=True) if d["kind"] == "leaf"}
    assert leaves["ln_1.weight"]["category"] == Category.PARAMETER.value


def test_views_share_storage():
    t = _trace()
    g = t.graph()
    view = next(d for _, d in g.nodes(data=True) if d["op"] == "aten.view.default")
    assert view["nbytes"] == 0  # a view allocates nothing
    src = next(iter(g.predecessors(next(n for n, d in g.nodes(data=True) if d is view))))
    assert g.nodes[src]["storages"][0] == view["storages"][0]


def test_fx_graph_is_aten_level():
    t = _trace()
    fx = t.fx_graph()
    targets = {n.target for n in fx.nodes if n.op == "call_function"}
    assert torch.ops.aten.addmm.default in targets
    assert all("memsim" in n.meta for n in fx.nodes if n.op != "output")


def test_sizes_are_sympy_in_user_symbols():
    t = _trace()
    syms = set(t.symbols.values())
    for s in t.run.storages:
        assert isinstance(s.nbytes, sympy.Expr) and s.nbytes.free_symbols <= syms


def test_equal_modules_are_listed_in_the_models_order():
    # identical blocks save the same bytes: listed 0, 1, 2 ... 11 (the model's order),
    # not 0, 1, 10, 11, 2 (the paths' string order)
    from memsim.analysis import analyze
    with torch.device("meta"):
        m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                  for _ in range(12)])
    r = analyze(m, {"input": ("float32", ["B", 8])}, device="cpu")
    saved = {x.path: x.saved for x in r.modules}
    same = [x.path for x in r.modules if x.path.isdigit() and x.saved == saved["1"]]
    assert same == [str(i) for i in range(1, 12)], same   # block 0 saves less (not its input)

"""Project a recorded run onto a ``torch.fx.Graph`` (ATen level) and a ``networkx.DiGraph``.

Why not ``make_fx``: its nodes keep every fake output in ``node.meta["val"]``, so nothing is ever
released and only graph last-use liveness is left, which is a lower bound for eager code. The
recorder runs the step eagerly instead and this module rebuilds the same kind of graph from what
it saw. Each node carries one frozen record in ``node.meta["memsim"]`` (an
:class:`~memsim.tracer.records.OpRecord` or :class:`~memsim.tracer.records.LeafRecord`).
"""

from __future__ import annotations

import networkx as nx
import torch.fx

from .records import LeafRecord, OpRecord, RunRecord


def _name(rec) -> str:
    if isinstance(rec, LeafRecord):
        return rec.name.replace(".", "_").strip("<>") or "leaf"
    return rec.op.split(".")[-2] if rec.op.count(".") >= 2 else rec.op


def to_fx(run: RunRecord) -> torch.fx.Graph:
    """An fx graph with one placeholder per leaf tensor and one call_function node per op."""
    g = torch.fx.Graph()
    nodes: list[torch.fx.Node] = []
    for rec in run.ops:
        if isinstance(rec, LeafRecord):
            n = g.placeholder(_name(rec))
        else:
            n = g.create_node("call_function", _target(rec.op),
                              tuple(nodes[i] for i in rec.inputs), {}, name=_name(rec))
        n.meta["memsim"] = rec
        nodes.append(n)
    g.output(None)
    return g


def _target(op: str):
    import torch

    ns, name, overload = (op.split(".") + ["default"])[:3]
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except AttributeError:
        return op


def to_networkx(run: RunRecord, storages=None) -> nx.DiGraph:
    """A DAG: node ``i`` is ``run.ops[i]``; an edge ``u -> v`` means ``v`` read a tensor of ``u``.

    Node attributes: ``op``, ``kind`` ("leaf" / "op"), ``phase``, ``module``, ``outputs`` (tuple of
    ``(shape, dtype)``), ``nbytes`` (sympy, bytes of storages the op allocated), ``storages`` (ids
    of the output storages: a view's id is its base's), ``category`` (of the first output).
    """
    storages = storages if storages is not None else run.storages
    g = nx.DiGraph()
    for rec in run.ops:
        outs = (rec.meta,) if isinstance(rec, LeafRecord) else rec.outputs
        fresh = {m.sid for m in outs if m.fresh}
        attrs = dict(
            op=rec.name if isinstance(rec, LeafRecord) else rec.op,
            kind="leaf" if isinstance(rec, LeafRecord) else "op",
            phase=None if isinstance(rec, LeafRecord) else rec.phase.value,
            module=None if isinstance(rec, LeafRecord) else rec.module,
            outputs=tuple((m.shape, m.dtype) for m in outs),
            storages=tuple(m.sid for m in outs),
            nbytes=sum((storages[s].nbytes for s in fresh), start=0),
            category=storages[outs[0].sid].category.value if outs else None,
        )
        g.add_node(rec.index, **attrs)
        if isinstance(rec, OpRecord):
            g.add_edges_from((i, rec.index) for i in set(rec.inputs))
    return g

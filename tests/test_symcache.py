"""Symbolic size arithmetic remembered during a trace (memsim.tracer.symcache): the trace is
the same, event for event, guard for guard, as torch's own arithmetic gives, and torch's
SymNode is left as it was."""

import contextlib

import pytest
import torch
import transformers
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import sym_node
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from memsim.strategies import FSDP
from memsim.strategies.compose import analyze
from memsim.tracer import fold, trace
from memsim.tracer.hf import adapt
from memsim.tracer.symcache import remembered

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
SMALL = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)


def _model(cls, cfg):
    with torch.device("meta"):
        return cls(cfg)


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_the_trace_is_the_same_without_it(family, monkeypatch):
    model = (_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL))
             if family == "llama" else
             # a sliding window shorter than the example sequence: guards on S
             _model(transformers.MistralForCausalLM,
                    transformers.MistralConfig(sliding_window=4, **SMALL)))
    patches, limits = adapt(model, LM)
    kw = dict(patches=patches, limits=limits, device="cuda", fold=False)
    fast = trace(model, LM, **kw)
    monkeypatch.setenv("MEMSIM_SYMCACHE", "0")   # torch's own arithmetic
    plain = trace(model, LM, **kw)
    assert fold.difference(fast.run, plain.run) is None
    assert (fast.ranges, fast.guards) == (plain.ranges, plain.guards)


def test_the_trace_is_the_same_with_pytorchs_fake_cache(monkeypatch):
    """A plain run is traced without PyTorch's cache of fake kernels' results (it is slower
    there: memsim.tracer.fake_cache.FAKE_CACHE). With it (a driven run's), the run is the same,
    event for event: the sliding-window mask that CUDA's attention pads and slices is not
    cached (remade as ``empty_strided``, its storage's size was another expression, with a
    ``Max(1, ...)``, of the same value). The cache's keys add guards of their own (memory
    formats of symbolic strides): never fewer."""
    from memsim.tracer import fake_cache
    model = _model(transformers.MistralForCausalLM,
                   transformers.MistralConfig(sliding_window=4, **SMALL))
    patches, limits = adapt(model, LM)
    kw = dict(patches=patches, limits=limits, device="cuda", fold=False)
    without = trace(model, LM, **kw)
    monkeypatch.setattr(fake_cache, "FAKE_CACHE", True)
    hits = FakeTensorMode.cache_hits
    cached = trace(model, LM, **kw)
    assert FakeTensorMode.cache_hits > hits
    assert fold.difference(cached.run, without.run) is None
    assert cached.ranges == without.ranges and set(without.guards) < set(cached.guards)


def test_the_figures_are_the_same_under_fsdp2(monkeypatch):
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL))
    fast = analyze(model, LM, device="cuda", fsdp=FSDP(2), inference=False)
    monkeypatch.setenv("MEMSIM_SYMCACHE", "0")
    plain = analyze(model, LM, device="cuda", fsdp=FSDP(2), inference=False)
    for b, s in ((2, 16), (3, 100), (8, 128)):
        assert fast.at(B=b, S=s) == plain.at(B=b, S=s)


def test_symnode_is_left_as_it_was(monkeypatch):
    before = dict(vars(sym_node.SymNode))
    with pytest.raises(RuntimeError):
        with remembered():
            assert vars(sym_node.SymNode)["_mul"] is not before["_mul"]
            with remembered():   # re-entrant: the inner block changes nothing
                pass
            assert vars(sym_node.SymNode)["_mul"] is not before["_mul"]
            raise RuntimeError("inside")
    assert dict(vars(sym_node.SymNode)) == before
    monkeypatch.setenv("MEMSIM_SYMCACHE", "0")
    with remembered():
        assert dict(vars(sym_node.SymNode)) == before


def _arithmetic(context):
    env = ShapeEnv()
    b = env.create_symintnode(env.create_symbol(2, ConstantSource("B")), hint=2)
    s = env.create_symintnode(env.create_symbol(64, ConstantSource("S")), hint=64)
    with context():
        first, again = b * s * 4096, b * s * 4096
        assert first.node is not again.node   # a node of its own, as torch makes
        assert (str(first), first.node.hint) == (str(again), again.node.hint)
        said = [bool(s > 8), bool(b > 8), bool(b * s == 128), bool((b - 1) * 7 + 1 > 0),
                bool(torch.sym_max(b, 4) == 4)]
    return str(first), first.node.hint, said, [str(g.expr) for g in env.guards]


def test_the_arithmetic_and_its_guards():
    fast = _arithmetic(remembered)
    assert fast == _arithmetic(contextlib.nullcontext)
    assert fast[1:3] == (524288, [True, False, True, True, True])
    assert len(fast[3]) >= 3, fast[3]

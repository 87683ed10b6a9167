"""Fast fake kernels of pointwise ops with symbolic sizes (memsim.tracer.pointwise): each
output is the one the op's decomposition gives (shape, strides, dtype, the tensor itself in
place) over the layouts a step meets, traces are the same event for event with and without
them, and torch's table of fast paths is left as it was."""

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from memsim.tracer import fold, pointwise, trace
from memsim.tracer.pointwise import OPS, fast_pointwise

from .support import zoo

aten = torch.ops.aten


def _layouts(mode, env):
    """Fake tensors of symbolic size (B, 6) or (B, 6, 4, 4) in the layouts a step makes."""
    b = env.create_symintnode(env.create_symbol(5, ConstantSource("B")), hint=5)
    with mode:
        wide = torch.empty(b, 18)
        yield "contiguous", torch.empty(b, 6)
        yield "a column slice", wide[:, 6:12]
        yield "transposed", torch.empty(6, b).t()
        yield "expanded", torch.empty(1, 6).expand(b, 6)
        yield "channels_last", torch.empty(b, 6, 4, 4).to(memory_format=torch.channels_last)
        yield "bf16", torch.empty(b, 6, dtype=torch.bfloat16)
        yield "int64", torch.empty(b, 6, dtype=torch.int64)


def _meta(t):
    return (tuple(map(str, t.shape)), tuple(map(str, t.stride())), t.dtype, t.device)


def _call(op, args, kwargs, mode):
    with mode:
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:
            return type(e)


@pytest.mark.parametrize("op", list(OPS), ids=str)
def test_each_output_is_the_decompositions(op):
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    mode.cache_enabled = False   # each call runs its kernel: the first's result is not reused
    layouts = dict(_layouts(mode, env))
    seen = 0
    for name, x in layouts.items():
        for other in ([None] if op._schema.arguments[1:2] == [] or op in (
                aten.clone.default,) else [x, layouts["contiguous"]] if x.dim() == 2 else [x]):
            args = (x,) if other is None else (x, other)
            if op._schema.is_mutable:
                args = (x.clone(),) if x.dtype.is_floating_point else (x,)
            kwargs = {}
            slow = _call(op, args, kwargs, mode)
            with fast_pointwise():
                fast = _call(op, args, kwargs, mode)
            if isinstance(slow, type):      # an op the tensor's dtype refuses: refused again
                assert fast is slow, (name, op)
                continue
            assert _meta(fast) == _meta(slow), (name, op)
            if op._schema.is_mutable:
                assert fast is args[0]
            seen += 1
    assert seen >= 5


def test_the_fast_kernels_are_used_and_the_trace_is_the_same(monkeypatch):
    """A bidirectional GRU's step (sigmoid_, tanh_ and their backward on column slices): the
    trace is the same, storage for storage, guard for guard."""
    used = []
    kernel = pointwise._kernel

    def counted(func, *how):
        impl = kernel(func, *how)
        return lambda *a, **k: (used.append(func), impl(*a, **k))[1]
    monkeypatch.setattr(pointwise, "_kernel", counted)
    with torch.device("meta"):
        model = zoo.GRULM(bidirectional=True)
    inputs = {"x": ("int64", ["B", 9])}
    fast = trace(model, inputs, device="cpu")
    assert {aten.sigmoid_.default, aten.sigmoid_backward.default, aten.tanh_.default,
            aten.tanh_backward.default} <= set(used)
    monkeypatch.setenv("MEMSIM_FAST_POINTWISE", "0")
    n = len(used)
    plain = trace(model, inputs, device="cpu")
    assert len(used) == n
    assert fold.difference(fast.run, plain.run) is None
    assert (fast.ranges, fast.guards) == (plain.ranges, plain.guards)


def test_torchs_table_is_left_as_it_was():
    before = dict(fake_impls.FAST_OP_IMPLEMENTATIONS)
    with pytest.raises(RuntimeError):
        with fast_pointwise():
            assert aten.tanh_.default in fake_impls.FAST_OP_IMPLEMENTATIONS
            raise RuntimeError("inside")
    assert fake_impls.FAST_OP_IMPLEMENTATIONS == before

"""Each distributed mechanism once at a realistic width, against a real 2-rank gloo run on CPU
(tests/oracles/dist.py): size-dependent behaviour (DDP's 25 MB buckets, sharding of 4-MiB
matrices, the all-gather of whole layers) that the width-64 tests never reach. Every figure per
rank: peak, parameters, gradients, optimizer states. ZeRO at DeepSpeed's default buckets is in
tests/test_zero.py."""

import functools

import pytest
import torch

import oracles.dist as O
from memsim.strategies import DDP, FSDP, TensorParallel
from memsim.strategies.api import analyze
from oracle import figures

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
# 2 layers of a Llama 1024 wide (8 heads of 128, MLP 2816, vocab 1000): 27.7M parameters
HIDDEN = 1024
WIDE_LLAMA = functools.partial(O.llama_model, attn="sdpa", layers=2, hidden=HIDDEN,
                               intermediate=2816, heads=8, kv_heads=8, vocab=1000,
                               positions=4096)
WIDE_INPUTS = functools.partial(O.llama_inputs, batch=2, seq=128, vocab=1000)
POINT = {"B": 2, "S": 128}


def _predict(factory, inputs, **kw):
    with torch.device("meta"):
        m = factory()
    return analyze(m, inputs, device="cpu", inference=False, **kw)


def _per_rank(real, got, activations=True):
    """Parameters, gradients, optimizer states and the activation peak (not under DDP: see
    tests/test_parallel.py) equal on every rank; the peaks returned."""
    for r in real:
        assert (r.parameters, r.gradients, r.optimizer_states) == (
            got["parameters"], got["gradients"], got["optimizer_states"]), r.rank
        assert activations is False or r.activation_peak == got["activation_peak"], r.rank
        # the one tensor outside the step: the device mesh's rank layout (world_size int32)
        assert r.other == 2 * 4, r.other_detail
    return {r.peak - r.other for r in real}


@pytest.mark.slow
def test_ddp_several_buckets_at_default_cap():
    """An MLP 1024 wide (2 blocks through 4096: 16.8M parameters, 67 MB of fp32 gradients)
    fills several of DDP's default 25 MB buckets."""
    factory = functools.partial(O.mlp_model, width=1024, hidden=4096, blocks=2)
    report = _predict(factory, {"input": ("float32", ["B", 1024])}, ddp=DDP(2))
    assert report.strategy["ddp"]["bucket_cap_mb"] == 25.0
    real = O.measure(factory, functools.partial(O.mlp_inputs, batch=8, width=1024),
                     strategy=O.DDP())
    got = figures(report, B=8)["train"]
    assert _per_rank(real, got, activations=False) == {got["peak"]}
    assert [d for d in real[0].other_detail if d.startswith("ddp_buckets=")] == [
        f"ddp_buckets={got['gradients']}"]


@pytest.mark.slow
def test_tensor_parallel_at_width_1024():
    report = _predict(WIDE_LLAMA, LM, tp=TensorParallel(2))
    real = O.measure(WIDE_LLAMA, WIDE_INPUTS, strategy=O.TP())
    got = figures(report, **POINT)["train"]
    assert _per_rank(real, got) == {got["peak"]}


@pytest.mark.slow
def test_fsdp2_at_width_1024():
    """Exact since gloo's reduce-scatter copy of its input is modelled (tracer/kernels.py):
    4,096 B low before, 4 B per hidden unit, as 256 B at width 64."""
    report = _predict(WIDE_LLAMA, LM, fsdp=FSDP(2))
    real = O.measure(WIDE_LLAMA, WIDE_INPUTS, strategy=O.FSDP2())
    got = figures(report, **POINT)["train"]
    assert _per_rank(real, got) == {got["peak"]}
    assert {r.peak_phase for r in real} == {"backward"}

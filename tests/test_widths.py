"""Each distributed mechanism once at a realistic width (Llama-2-7B's 4096 and 11008), against
a real 2-rank gloo run on CPU (tests/support/oracles/dist.py): size-dependent behaviour (DDP's
25 MB buckets, sharding of 64-MiB matrices, the all-gather and reduce-scatter of whole layers) that
the width-64 tests never reach. Every figure per
rank: peak, parameters, gradients, optimizer states. ZeRO at DeepSpeed's default buckets is in
tests/test_zero.py.

The three runs at Llama-2-7B's widths are marked ``wide``, as are tests/test_zero.py's runs
at realistic widths: the README's test command leaves them out (10-60 s and GBs each, most of
the suite's budget); ``.ci/run`` runs them as a step of their own, and ``python -m pytest -m
wide`` runs them anywhere."""

import functools

import pytest
import torch

from memsim.strategies import DDP, FSDP, TensorParallel
from memsim.strategies.compose import analyze

from tests.conftest import HOST_SKIP
from tests.support.oracles import dist as O
from tests.support.predict import figures

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
# 2 layers of a Llama 1024 wide (8 heads of 128, MLP 2816, vocab 1000): 27.7M parameters (FSDP2
# below, exact here before and after the 7B-width case was)
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


@pytest.mark.wide
def test_ddp_several_buckets_at_default_cap():
    """An MLP block of Llama-2-7B's widths (Linear(4096, 11008), GELU, Linear(11008, 4096):
    90.2M parameters, 361 MB of fp32 gradients) fills 15 of DDP's default 25 MB buckets;
    B=8. 2,164,869,140 B on both ranks, every figure equal (about 15 s)."""
    factory = functools.partial(O.mlp_model, width=4096, hidden=11008, blocks=1)
    report = _predict(factory, {"input": ("float32", ["B", 4096])}, ddp=DDP(2))
    assert report.strategy["ddp"]["bucket_cap_mb"] == 25.0
    real = O.measure(factory, functools.partial(O.mlp_inputs, batch=8, width=4096),
                     strategy=O.DDP())
    got = figures(report, B=8)["train"]
    assert _per_rank(real, got, activations=False) == {got["peak"]}
    assert [d for d in real[0].other_detail if d.startswith("ddp_buckets=")] == [
        f"ddp_buckets={got['gradients']}"]


@pytest.mark.wide
def test_tensor_parallel_at_llama_7b_width():
    """One decoder layer of Llama-2-7B's shape, TP 2 (q/k/v/gate/up column-wise, o/down
    row-wise), B=2, S=512: 2,024,915,508 B on both ranks, every figure equal (about 25 s)."""
    factory = functools.partial(_llama_7b_width, checkpointing=False)
    report = _predict(factory, LM, tp=TensorParallel(2))
    real = O.measure(factory, functools.partial(O.llama_inputs, batch=2, seq=512, vocab=1000),
                     strategy=O.TP())
    got = figures(report, B=2, S=512)["train"]
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


def _llama_7b_width(layers: int = 1, checkpointing: bool = True):
    """Layers of Llama-2-7B's shape (hidden 4096, 32 heads, MLP 11008; vocab 1000 to keep
    the embedding small), sdpa, Hugging Face's own checkpointing (non-reentrant)."""
    m = O.llama_model(attn="sdpa", layers=layers, hidden=4096, intermediate=11008, heads=32,
                      kv_heads=32, vocab=1000, positions=4096)
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m


@pytest.mark.wide
def test_fsdp2_mixed_precision_at_llama_7b_width():
    """Issue 17's case: one decoder layer of Llama-2-7B's shape under FSDP2 (the layer, then
    the root) with bf16 parameters and fp32 gradient reduction, HF checkpointing, the output
    dropped after the loss, AdamW, B=2, S=512. 24% low before gloo's reduce-scatter copy was
    modelled (2,518,966,840 against 3,320,316,472 B: the copy is one layer's fp32 gradients,
    809 MB); now every figure of both ranks is equal (3 layers: 6,567,105,152 B on both sides,
    checked once, 81 s). About 7 GB of memory for the two real ranks, 35 s."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from memsim.tracer import CpuIsa
    if CpuIsa.host() is not CpuIsa.AVX512:
        pytest.skip(f"{HOST_SKIP}: without AVX-512 the real ranks' bf16 matmuls at Llama-2-7B's "
                    "widths run past the oracle's 300 s (three tries on such a machine)")
    with torch.device("meta"):
        m = _llama_7b_width()
    report = analyze(m, LM, device="cpu", inference=False, keep_outputs=False,
                     fsdp=FSDP(2, param_dtype="bfloat16", reduce_dtype="float32"))
    real = O.measure(_llama_7b_width, functools.partial(O.llama_inputs, batch=2, seq=512,
                                                        vocab=1000),
                     strategy=O.FSDP2(mp_policy=MixedPrecisionPolicy(
                         param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
                     keep_outputs=False)
    got = figures(report, B=2, S=512)["train"]
    assert _per_rank(real, got) == {got["peak"]} == {3_320_316_472}
    assert {r.peak_phase for r in real} == {"backward"}


@pytest.mark.wide
def test_pipeline_at_llama_7b_width():
    """Two decoder layers of Llama-2-7B's shape over 2 pipeline ranks (1F1B, 2 micro-batches;
    the embeddings and one layer on rank 0, one layer with the norm, head and loss on rank 1),
    B=2, S=256: every figure of every rank equal (peaks 3,853,132,328 and 3,853,197,868 B;
    about 60 s)."""
    from memsim.strategies import PipelineParallel

    factory = functools.partial(_llama_7b_width, layers=2, checkpointing=False)
    pp = PipelineParallel(pp=2, schedule="1F1B", microbatches=2)
    with torch.device("meta"):
        groups = pp.groups(factory())
    report = _predict(factory, LM, pp=pp)
    real = O.measure(factory, functools.partial(O.llama_inputs, batch=2, seq=256, vocab=1000),
                     strategy=O.Pipeline("1F1B", 2, groups), world_size=2)
    for r in real:
        rank = next(rc.report for rc in report.ranks if r.rank in rc.ranks)
        got = figures(rank, B=2, S=256)["train"]
        assert (r.peak, r.parameters, r.gradients, r.optimizer_states, r.activation_peak) == (
            got["peak"], got["parameters"], got["gradients"], got["optimizer_states"],
            got["activation_peak"]), r.rank


@pytest.mark.wide
def test_pipeline_with_fsdp2_at_llama_7b_width():
    """Two decoder layers of Llama-2-7B's shape over 2 pipeline ranks x FSDP2 over 2 (4 gloo
    ranks, a (pp, dp) mesh; 1F1B, 2 micro-batches), B=2, S=128: every figure of every rank
    equal (peaks 3,277,214,264 B on ranks 0 and 1, 3,750,774,344 B on ranks 2 and 3; about
    90 s)."""
    from memsim.strategies import FSDP, PipelineParallel

    factory = functools.partial(_llama_7b_width, layers=2, checkpointing=False)
    pp = PipelineParallel(pp=2, schedule="1F1B", microbatches=2)
    with torch.device("meta"):
        groups = pp.groups(factory())
    report = _predict(factory, LM, pp=pp, fsdp=FSDP(dp=2))
    real = O.measure(factory, functools.partial(O.llama_inputs, batch=2, seq=128, vocab=1000),
                     strategy=O.Pipeline("1F1B", 2, groups, dp=2, fsdp=O.FSDP2()),
                     world_size=4)
    for r in real:
        rank = next(rc.report for rc in report.ranks if r.rank in rc.ranks)
        got = figures(rank, B=2, S=128)["train"]
        assert r.other == 0, r.other_detail
        assert (r.peak, r.parameters, r.gradients, r.optimizer_states, r.activation_peak) == (
            got["peak"], got["parameters"], got["gradients"], got["optimizer_states"],
            got["activation_peak"]), r.rank

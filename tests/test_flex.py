"""FlexAttention under ``torch.compile``: Inductor's fused kernels (memsim.tracer.flex).

Uncompiled, FlexAttention runs its unfused implementation (tests/test_accuracy.py checks it
against real runs). Compiled with Inductor, one fused kernel runs each way and no (B, H, S, S)
score exists. On CPU the compiled forward runs for real here (Inductor's C++ template), and
memsim's --device cpu prediction equals it to the byte, counted from the CPU allocator's own
report (a dispatch mode cannot count a compiled run: Dynamo compiles nothing under one). The
CUDA kernels cannot run here: their buffers are checked against Inductor's lowering
(torch/_inductor/kernel/flex/flex_attention.py), not measured on a GPU.
"""

import math

import pytest
import sympy
import torch
from memsim.analysis import analyze
from memsim.tracer import StepConfig, TraceError, trace

from tests.support import zoo
from tests.support.oracles.measure import example_inputs, materialize
from torch import nn

SEQ = {"x": ("float32", ["B", "S", 64])}


def _meta(factory, *args, **kwargs):
    with torch.device("meta"):
        return factory(*args, **kwargs)


def _fused(run, op: str) -> list:
    """The storages the fused op ``op`` allocated, in order."""
    return [s for s in run.storages if s.op == op]


def _blocks(n: int) -> int:
    """Bytes the CUDA caching allocator gives ``n`` bytes: 512-byte blocks."""
    return 512 * math.ceil(n / 512)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_cuda_compiled_training_allocates_the_fused_kernels_buffers(kv_heads):
    """--device cuda, training: the forward kernel allocates out (B, H, S, D) and two (B, H, S)
    float32 statistics (log-sum-exp, saved; max scores, freed after it); the backward kernel
    delta (B, H, S) float32 and the three gradients, those of key and value with the KV heads
    (GQA sums query heads inside the kernel). Nothing is quadratic in S."""
    t = trace(_meta(zoo.CompiledFlexAttention, kv_heads=kv_heads), SEQ,
              StepConfig(device="cuda"), train=True)
    B, S = t.symbols["B"], t.symbols["S"]
    H, D = 4, 16
    fwd = _fused(t.run, "fused_flex_attention")
    #      lse (fp32)     max_scores (fp32)   out
    assert [s.nbytes for s in fwd] == [4 * B * H * S, 4 * B * H * S, 4 * B * H * S * D]
    lse, mx, out = fwd
    assert lse.saved and out.saved and not mx.saved
    assert mx.free == mx.alloc + 1                      # dies with its kernel
    bwd = _fused(t.run, "fused_flex_attention_backward")
    #      delta (fp32)   grad_query            grad_value, grad_key: Hkv heads
    assert [s.nbytes for s in bwd] == [4 * B * H * S, 4 * B * H * S * D] + \
        [4 * B * kv_heads * S * D] * 2
    assert bwd[0].free == bwd[0].alloc + 1
    for saved in (lse, out):  # released when the backward node has run, before the next one
        assert t.run.ops[saved.free - 1].autograd_node == "_FusedBackward"
    for s in t.run.storages:
        assert sympy.degree(sympy.expand(s.nbytes), S) <= 1, (s.op, s.nbytes)


def test_cuda_compiled_peaks_equal_the_hand_derivation():
    """The peaks of zoo.CompiledFlexAttention (d=64, 4 heads of 16, fp32, AdamW) on
    --device cuda, from the buffers of Inductor's lowering, each in 512-byte blocks
    (n = B*S): inference peaks at the forward kernel (short sequences) or at the projection,
    with the loop's previous output alive; training at the backward kernel."""
    report = analyze(_meta(zoo.CompiledFlexAttention), SEQ, device="cuda")
    params = 2 * 16384 + 32768 + 3 * 512  # q, proj: 64x64 + 64; kv: 64x128 + 128 (fp32)
    assert params == 67072
    for b, s in [(2, 2), (2, 9), (3, 40), (8, 1024)]:
        n = b * s
        x = q = out = proj = _blocks(256 * n)         # (B, S, 64) fp32 each
        kv = _blocks(512 * n)                          # (B, S, 128)
        stat = _blocks(16 * n)                         # (B, 4, S) fp32
        mask = 2 * 512                                 # the default BlockMask's two int32
        prev = _blocks(256 * n)                        # the loop's previous output
        kernel = params + x + q + kv + out + 2 * stat + mask + prev
        projection = params + x + q + kv + out + proj + prev
        got = report.at(B=b, S=s)
        assert got["inference"]["peak"] == max(kernel, projection), (b, s)
        if n >= 1024:
            # grads of proj (16384 + 512), AdamW's two moments, 4 BlockMask tensors, the loss
            # and its seed; saved x, q, kv, out, lse; the output; grad_out, delta and the
            # three gradients
            state = params + 16896 + 2 * params
            backward = (state + 4 * 512 + 2 * 512 + x + q + kv + out + stat + proj
                        + _blocks(256 * n) + stat + 3 * _blocks(256 * n))
            assert got["train"]["peak"] == backward, (b, s)


def test_cuda_log_sum_exp_in_the_loss():
    """``return_aux=AuxRequest(lse=True)`` read by the loss: the backward kernel also
    allocates grad_lse_exp2 (B, H, S) float32; ``max_scores`` returned is kept, not saved."""
    from torch.nn.attention.flex_attention import AuxRequest

    class Aux(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 192)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.lin(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
            y, aux = zoo.compiled_flex_attention()(
                q, k, v, return_aux=AuxRequest(lse=True, max_scores=True))
            return y.sum() + aux.lse.sum() + aux.max_scores.sum()

    t = trace(_meta(Aux), SEQ, StepConfig(device="cuda"), train=True)
    B, S = t.symbols["B"], t.symbols["S"]
    lse, mx, _ = _fused(t.run, "fused_flex_attention")
    assert lse.saved and not mx.saved and mx.free > mx.alloc + 1  # max read by the loss
    bwd = _fused(t.run, "fused_flex_attention_backward")
    #                   delta, grad_lse_exp2       grad_query, grad_value, grad_key
    assert [s.nbytes for s in bwd] == [16 * B * S] * 2 + [256 * B * S] * 3


def _profiled(model, inputs: dict) -> tuple[int, list]:
    """A real inference forward on CPU, counted from the CPU allocator's own report to the
    profiler (every buffer: ATen's, Inductor's and its C++ kernels' work buffers): the most
    bytes live at once (the parameters and inputs, and the largest sum of allocations during
    the call), and the sizes allocated inside the compiled region, in order. The first call
    compiles; the second is measured, in a loop that rebinds ``out``: the first call's output
    is alive until the second returns."""
    from torch.profiler import ProfilerActivity, profile

    held = {id(t.untyped_storage()): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers(), *inputs.values()]}
    with torch.no_grad():
        out = model(**inputs)
        held[id(out.untyped_storage())] = out.untyped_storage().nbytes()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = model(**inputs)
    changes, compiled = [], []

    def walk(node, inside=False):
        inside = inside or node.name.startswith("Torch-Compiled Region")
        if node.tag == torch._C._profiler._EventType.Allocation:
            changes.append((node.start_time_ns, node.extra_fields.alloc_size))
            if inside and node.extra_fields.alloc_size > 0:
                compiled.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child, inside)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, n in sorted(changes):
        live += n
        peak = max(peak, live)
    del out
    return sum(held.values()) + peak, [n for _, n in sorted(compiled)]


def test_cpu_compiled_inference_equals_real_compiled_run():
    """--device cpu, inference: Inductor's C++ template (out, no log-sum-exp, and its work
    buffers: per thread an (S, S) float32 tile and its copy without a BlockMask, key and value
    reordered) equals a real ``torch.compile(flex_attention)`` run to the byte, at sizes not
    traced: the peak, and each buffer of the compiled region (the default BlockMask's two
    int32, then the kernel's). The tests run one thread (tests/conftest.py)."""
    from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
    if not check_cpu_supported():
        pytest.skip("Inductor's CPU FlexAttention needs AVX2")
    model = _meta(zoo.CompiledFlexAttention)
    report = analyze(model, SEQ, device="cpu", train=False)
    t = trace(model, SEQ, StepConfig(device="cpu"), train=False)
    S = report.symbols["S"]
    assert sympy.degree(sympy.expand(report.inference.peak), S) == 2  # the per-thread tile
    for pt in ({"B": 2, "S": 9}, {"B": 3, "S": 20}):
        torch.manual_seed(0)
        real = materialize(zoo.CompiledFlexAttention())
        peak, compiled = _profiled(real, example_inputs(SEQ, pt))
        assert report.at(**pt)["inference"]["peak"] == peak, pt
        at = {t.symbols[k]: v for k, v in pt.items()}
        kernel = [int(s.nbytes.subs(at)) for s in _fused(t.run, "fused_flex_attention")]
        assert compiled == [4, 4] + kernel, pt


def test_uncompiled_and_other_backends_keep_the_unfused_path():
    """Only Inductor fuses: eager flex_attention, ``backend="eager"`` and a
    ``torch.compiler.disable``d call inside a compiled function run the unfused
    implementation (its (B, H, S, S) scores) on --device cuda too."""
    from torch.nn.attention.flex_attention import flex_attention

    class Call(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.lin, self.how = nn.Linear(64, 192), how

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.lin(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
            if self.how == "eager backend":
                return torch.compile(flex_attention, backend="eager")(q, k, v)
            if self.how == "disabled":
                return torch.compile(lambda *a: torch.compiler.disable(flex_attention)(*a))(
                    q, k, v)
            return flex_attention(q, k, v)

    for how in ("eager", "eager backend", "disabled"):
        t = trace(_meta(Call, how), SEQ, StepConfig(device="cuda"), train=False)
        S = t.symbols["S"]
        assert not _fused(t.run, "fused_flex_attention"), how
        assert any(sympy.degree(sympy.expand(s.nbytes), S) == 2 for s in t.run.storages), how


@pytest.mark.parametrize("case", ["head dim 8", "trained capture", "fixed short S", "cpu lse"])
def test_what_cannot_be_modelled_is_refused(case):
    """A compiled call that a real run refuses, or whose kernel is not modelled, is a
    TraceError naming it: a head dimension below 16 on CUDA (Inductor's NotImplementedError),
    a score_mod reading a tensor that requires grad (its gradient buffers), a query length
    fixed below 128 on CUDA (FlexDecoding), a log-sum-exp on CPU."""
    from torch.nn.attention.flex_attention import AuxRequest

    class Case(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 192)
            self.bias = nn.Parameter(torch.zeros(4))

        def forward(self, x):
            b, s, _ = x.shape
            hd = 8 if case == "head dim 8" else 16
            q, k, v = self.lin(x).view(b, s, 3, 64 // hd, hd).permute(2, 0, 3, 1, 4)
            flex, bias = zoo.compiled_flex_attention(), self.bias
            if case == "trained capture":
                return flex(q, k, v, score_mod=lambda sc, b_, h, qi, ki: sc + bias[h])
            if case == "cpu lse":
                return flex(q, k, v, return_aux=AuxRequest(lse=True))[0]
            return flex(q, k, v)

    inputs, device, train, match = {
        "head dim 8": (SEQ, "cuda", False, "head dimension of at least 16"),
        "trained capture": (SEQ, "cuda", True, "requires grad"),
        "fixed short S": ({"x": ("float32", ["B", 64, 64])}, "cuda", False, "FlexDecoding"),
        "cpu lse": (SEQ, "cpu", False, "log-sum-exp"),
    }[case]
    with pytest.raises(TraceError, match=match) as err:
        trace(_meta(Case), inputs, StepConfig(device=device), train=train)
    assert err.value.hint and err.value.op == "flex_attention"

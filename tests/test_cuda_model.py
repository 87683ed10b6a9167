"""--device cuda: the kernel choices CUDA would make (modelled; not measured on a GPU here)."""

import sympy
import torch

from memsim.analysis import analyze

from tests.support import zoo
from tests.support.oracles.measure import measure_train

SEQ = {"x": ("float32", ["B", "S", 32])}


def unrounded(e):
    """A CUDA figure without the allocator's 512-byte block rounding (and a kernel's own
    rounding of a size, ``CeilToInt``): the tensors' own bytes."""
    from torch.utils._sympy.functions import CeilToInt, IntTrueDiv

    e = e.replace(IntTrueDiv, lambda a, b: a / b).replace(CeilToInt, lambda x: x)
    return sympy.expand(e.replace(sympy.ceiling, lambda x: x))


def _run(factory, device, **kw):
    with torch.device("meta"):
        m = factory()
    return analyze(m, SEQ, device=device, inference=False, **kw)


def test_sdpa_saves_no_scores_on_cuda():
    S = sympy.Symbol("S", positive=True, integer=True)
    cpu = _run(lambda: zoo.Block(sdpa=True, dropout=0.1), "cpu").train.saved_activations
    cuda = unrounded(_run(lambda: zoo.Block(sdpa=True, dropout=0.1), "cuda").train.saved_activations)
    # CPU with dropout takes the math path: (B, H, S, S) probabilities are saved
    assert sympy.degree(cpu, S) == 2
    # CUDA's fused kernels save the output and a (B, H, S) float32 log-sum-exp
    assert sympy.degree(cuda, S) == 1


def test_dropout_mask_is_bool_on_cuda():
    B = sympy.Symbol("B", positive=True, integer=True)
    S = sympy.Symbol("S", positive=True, integer=True)
    cpu = _run(lambda: zoo.Block(dropout=0.1), "cpu").train.saved_activations
    cuda = unrounded(_run(lambda: zoo.Block(dropout=0.1), "cuda").train.saved_activations)
    # attention-probability dropout mask, 4 heads: float (4 B) on CPU, bool (1 B) on CUDA
    assert sympy.expand(cpu - cuda).coeff(S, 2) == 4 * 3 * B


def test_adamw_step_counters_stay_on_host():
    cpu = _run(zoo.Block, "cpu").train
    cuda = _run(zoo.Block, "cuda").train
    n_params = len(list(zoo.Block().parameters()))
    host = [s for s in cuda.trace.run.storages if s.device == "host"]
    # one float32 step counter per parameter tensor, kept on the host, not in device figures
    assert len(host) == n_params and all(s.nbytes == 4 for s in host)
    assert all(s.device == "cpu" for s in cpu.trace.run.storages)
    dev_states = sum(512 * -(-int(s.nbytes) // 512) for s in cuda.trace.run.storages
                     if s.category.value == "optimizer_state" and s.device == "cuda")
    assert cuda.optimizer_states == dev_states


def test_foreach_on_cuda_for_loop_on_cpu():
    ops = lambda r: {rec.op for rec in r.train.trace.run.ops if hasattr(rec, "phase")}
    assert any("_foreach_" in o for o in ops(_run(zoo.Block, "cuda")))
    assert not any("_foreach_" in o for o in ops(_run(zoo.Block, "cpu")))


def test_cuda_blocks_are_512_byte_multiples():
    """The caching allocator charges 512-byte blocks: a bias of 4 floats costs 512 bytes."""
    with torch.device("meta"):
        m = torch.nn.Linear(32, 4)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    r = analyze(m, {"input": ("float32", ["B", 32])}, device="cuda", optimizer=sgd)
    assert r.train.parameters == 512 + 512  # weight 512 B, bias 16 B -> 512 B
    c = analyze(m, {"input": ("float32", ["B", 32])}, device="cpu", optimizer=sgd)
    assert c.train.parameters == 512 + 16
    # Live at backward's end (the output kept): weight 512, bias 16, input (B, 32) 128*B,
    # output (B, 4) 16*B, loss 4, backward's seed of ones 4, weight grad 512, bias grad 16
    # (SGD without momentum: no state; its update is in place): 144*B + 1,064 on the CPU.
    # Live at forward's addmm: weight, bias, input, the new output, and the previous step's
    # output and loss (a loop rebinds `out` and `loss` only once forward and loss return):
    # 160*B + 532, the peak from B = 17 on. A real run's peak is the larger. On CUDA each
    # storage takes whole 512-byte blocks: 512*ceil(128*B/512) + 512*ceil(16*B/512) + 6 * 512
    # and 512*ceil(128*B/512) + 2 * 512*ceil(16*B/512) + 3 * 512
    blocks = lambda n: 512 * -(-n // 512)  # noqa: E731
    for b in (2, 3, 100, 1000):
        assert c.at(B=b)["train"]["peak"] == max(144 * b + 1064, 160 * b + 532) == \
            measure_train(torch.nn.Linear(32, 4), {"input": torch.randn(b, 32)},
                          optimizer=sgd).peak
        assert r.at(B=b)["train"]["peak"] == max(
            blocks(128 * b) + blocks(16 * b) + 6 * 512,
            blocks(128 * b) + 2 * blocks(16 * b) + 3 * 512)
    assert [r.at(B=b)["train"]["peak"] for b in (2, 3, 100, 1000)] == [
        512 + 512 + 3072, 512 + 512 + 3072, 12_800 + 2 * 2_048 + 1536,
        128_000 + 2 * 16_384 + 1536]


class _Attention(torch.nn.Module):
    """q, k, v made from the input by a parameter (so only attention's own tensors are saved
    activations), an optional causal bool mask of shape (S, S), SDPA."""

    def __init__(self, heads_kv: int = 4, mask: bool = True, gqa: bool = False):
        super().__init__()
        self.wq = torch.nn.Parameter(torch.ones(4, 1, 8))
        self.wk = torch.nn.Parameter(torch.ones(heads_kv, 1, 8))
        self.mask, self.gqa, self.hkv = mask, gqa, heads_kv

    def forward(self, x):  # (B, 4, S, 8)
        import torch.nn.functional as F
        s = x.shape[2]
        q, k = x * self.wq, x[:, :self.hkv] * self.wk
        v = x[:, :self.hkv] * self.wk
        m = torch.ones(s, s, dtype=torch.bool).tril() if self.mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=self.gqa)


HEADS = {"x": ("float32", ["B", 4, "S", 8])}


def _saved(model, point, precision="32-true"):
    with torch.device("meta"):
        m = model()
    r, p = analyze(m, HEADS, device="cuda", inference=False, precision=precision).for_point(point)
    return r.at(**p)["train"]["saved_activations"]


def test_sdpa_with_a_mask_runs_memory_efficient_attention():
    """CUDA picks memory-efficient attention for a mask (flash takes none): it saves q, k, v, the
    output, a float32 log-sum-exp of (B, H, 32 * ceil(S / 32)) (``_efficient_attention_forward``)
    and the additive mask made from the bool one (``convert_boolean_attn_mask``), padded to a
    multiple of 8 columns where a row is not 8-aligned (``preprocess_mask``). The math path would
    keep (B, H, S, S) probabilities. Expected bytes from those shapes, in 512-byte blocks."""
    blocks = lambda n: 512 * -(-n // 512)  # noqa: E731
    for b, s in ((2, 16), (3, 40), (2, 9), (3, 21)):
        qkv_out = 4 * blocks(b * 4 * s * 8 * 4)
        lse = blocks(b * 4 * 32 * -(-s // 32) * 4)
        cols = s if s % 8 == 0 else s + 8 - s % 8
        mask = blocks(s * cols * 4)
        assert _saved(lambda: _Attention(mask=True), {"B": b, "S": s}) == qkv_out + lse + mask


def test_sdpa_fp32_grouped_query_heads_take_the_math_path():
    """fp32 rules flash out and grouped-query heads memory-efficient attention, so CUDA runs the
    math path (Hugging Face passes ``enable_gqa`` without a mask): the (B, H, S, S) float32
    probabilities are saved; in bf16 flash takes the call and saves none."""
    S = sympy.Symbol("S", positive=True, integer=True)
    with torch.device("meta"):
        m = _Attention(heads_kv=2, mask=False, gqa=True)
    fp32 = analyze(m, HEADS, device="cuda", inference=False).train.saved_activations
    bf16 = analyze(m, HEADS, device="cuda", inference=False,
                   precision="bf16-mixed").train.saved_activations
    assert sympy.degree(unrounded(fp32), S) == 2
    assert sympy.degree(unrounded(bf16), S) == 1

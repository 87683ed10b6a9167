"""--device cuda: the kernel choices CUDA would make (modelled; not measured on a GPU here)."""

import sympy
import torch

import zoo
from memsim.analysis import analyze
from oracles.measure import measure_train

SEQ = {"x": ("float32", ["B", "S", 32])}


def unrounded(e):
    """A CUDA figure without the allocator's 512-byte block rounding: the tensors' own bytes."""
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
    # Live at the peak (backward's end, the output kept): weight 512, bias 16, input (B, 32)
    # 128*B, output (B, 4) 16*B, loss 4, backward's seed of ones 4, weight grad 512, bias grad
    # 16 (SGD without momentum: no state; its update is in place). On the CPU that is
    # 144*B + 1,064, a real run's peak; on CUDA each storage takes whole 512-byte blocks:
    # 512*ceil(128*B/512) + 512*ceil(16*B/512) + 6 * 512
    blocks = lambda n: 512 * -(-n // 512)  # noqa: E731
    for b in (2, 3, 100, 1000):
        assert c.at(B=b)["train"]["peak"] == 144 * b + 1064 == measure_train(
            torch.nn.Linear(32, 4), {"input": torch.randn(b, 32)}, optimizer=sgd).peak
        assert r.at(B=b)["train"]["peak"] == blocks(128 * b) + blocks(16 * b) + 6 * 512
    assert [r.at(B=b)["train"]["peak"] for b in (2, 3, 100, 1000)] == [
        512 + 512 + 3072, 512 + 512 + 3072, 12_800 + 2_048 + 3072, 128_000 + 16_384 + 3072]

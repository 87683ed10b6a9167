"""--device cuda: the kernel choices CUDA would make (modelled; not measured on a GPU here)."""

import sympy
import torch

import zoo
from analysis import analyze

SEQ = {"x": ("float32", ["B", "S", 32])}


def _run(factory, device, **kw):
    with torch.device("meta"):
        m = factory()
    return analyze(m, SEQ, device=device, inference=False, **kw)


def test_sdpa_saves_no_scores_on_cuda():
    S = sympy.Symbol("S", positive=True, integer=True)
    cpu = _run(lambda: zoo.Block(sdpa=True, dropout=0.1), "cpu").train.saved_activations
    cuda = _run(lambda: zoo.Block(sdpa=True, dropout=0.1), "cuda").train.saved_activations
    # CPU with dropout takes the math path: (B, H, S, S) probabilities are saved
    assert sympy.degree(cpu, S) == 2
    # CUDA's fused kernels save the output and a (B, H, S) float32 log-sum-exp
    assert sympy.degree(cuda, S) == 1


def test_dropout_mask_is_bool_on_cuda():
    B = sympy.Symbol("B", positive=True, integer=True)
    S = sympy.Symbol("S", positive=True, integer=True)
    cpu = _run(lambda: zoo.Block(dropout=0.1), "cpu").train.saved_activations
    cuda = _run(lambda: zoo.Block(dropout=0.1), "cuda").train.saved_activations
    # attention-probability dropout mask, 4 heads: float (4 B) on CPU, bool (1 B) on CUDA
    assert sympy.expand(cpu - cuda).coeff(S, 2) == 4 * 3 * B


def test_adamw_step_counters_stay_on_host():
    cpu = _run(zoo.Block, "cpu").train.optimizer_states
    cuda = _run(zoo.Block, "cuda").train.optimizer_states
    n_params = len(list(zoo.Block().parameters()))
    assert cpu - cuda == 4 * n_params  # one float32 step counter per parameter tensor


def test_foreach_on_cuda_for_loop_on_cpu():
    ops = lambda r: {rec.op for rec in r.train.trace.run.ops if hasattr(rec, "phase")}
    assert any("_foreach_" in o for o in ops(_run(zoo.Block, "cuda")))
    assert not any("_foreach_" in o for o in ops(_run(zoo.Block, "cpu")))

"""Precision modes and gradient accumulation: prediction == a real CPU run, byte for byte.

fp16 autocast runs on CPU in torch 2.13, so every mode is checked against a real run. The real
run's GradScaler starts at scale 1 so that no gradient overflows and the optimizer steps (the
steady state memsim models; with 2**16 the small test models overflow and skip the step).
"""

import pytest
import sympy
import torch

from memsim.analysis import analyze
from memsim.tracer import InputError

from tests.support import zoo
from tests.support.predict import check, grid, predict

SEQ = {"x": ("float32", ["B", "S", 32])}
MODES = ["bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16-master"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("factory", [zoo.Block, lambda: zoo.Block(sdpa=True), zoo.CNN],
                         ids=["block", "block_sdpa", "cnn"])
def test_precision_matches_real_run(mode, factory):
    inputs = {"x": ("float32", ["B", 3, 16, 16])} if factory is zoo.CNN else SEQ
    report = predict(factory, inputs, precision=mode)
    points = grid(B=(2, 5)) if factory is zoo.CNN else grid(B=(2, 3), S=(5, 16))
    check(report, factory, inputs, points, precision=mode)


def test_master_weights_layout():
    """bf16-master with AdamW: 2 (param) + 2 (grad) + 4 (fp32 grad) + 4 (master) + 8 (moments)."""
    with torch.device("meta"):
        m = torch.nn.Linear(256, 256, bias=False)
    r = analyze(m, {"input": ("float32", ["B", 256])}, device="cpu", precision="bf16-master",
                inference=False)
    n = 256 * 256
    assert r.train.parameters == 2 * n
    assert r.train.gradients == 2 * n + 4 * n
    assert r.train.optimizer_states == 4 * n + 8 * n + 4  # + the fp32 step counter


@pytest.mark.parametrize("k", [2, 3])
def test_gradient_accumulation_matches_real_run(k):
    """Gradients persist across micro-steps; micro-steps after the second repeat the second."""
    report = predict(zoo.TinyGPT, {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])},
                     accumulate=k, inference=False)
    check(report, zoo.TinyGPT, {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])},
          grid(B=(2, 3), S=(4, 9)), accumulate=k)
    one = predict(zoo.TinyGPT, {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])},
                  inference=False)
    pt = {"B": 3, "S": 9}
    assert report.at(**pt)["train"]["peak"] >= one.at(**pt)["train"]["peak"]


def test_cuda_autocast_policy_keeps_norms_and_softmax_in_fp32():
    """On CUDA autocast runs softmax in fp32 (CPU autocast keeps bf16): the saved activations
    of the explicit-softmax block differ from the CPU's (test_precision_matches_real_run) by
    exactly the sizes derived below from the block's shapes (modelled, not measured)."""
    B, S = sympy.symbols("B S", positive=True, integer=True)
    with torch.device("meta"):
        m = zoo.Block()
    cpu = analyze(m, SEQ, device="cpu", precision="bf16-mixed", inference=False)
    cuda = analyze(m, SEQ, device="cuda", precision="bf16-mixed", inference=False)
    # The attention probabilities (B, 4 heads, S, S). CPU: one bf16 tensor (2 B), saved by
    # softmax's backward and by att @ v. CUDA: softmax's fp32 output (4 B), saved by its
    # backward, and the bf16 copy autocast makes of it for att @ v (2 B). Both save the causal
    # mask (S, S) of bools (1 B) for masked_fill. Per B*S**2: 4 x 2 = 8 B on CPU, 4 x (4 + 2)
    # = 24 B on CUDA.
    probs = cuda.train.saved_activations.replace(sympy.ceiling, lambda x: x)
    assert sympy.expand(probs).coeff(S, 2) == 24 * B + 1
    assert sympy.expand(cpu.train.saved_activations).coeff(S, 2) == 8 * B + 1
    # the rest is the same on both: at B 4, S 64 every saved tensor is a whole number of
    # CUDA's 512-byte blocks, and the difference is 16 B x B*S**2
    pt = {"B": 4, "S": 64}
    s_cpu = cpu.train.evaluate(cpu.train.saved_activations, pt)
    s_cuda = cuda.train.evaluate(cuda.train.saved_activations, pt)
    assert s_cuda - s_cpu == 16 * 4 * 64 ** 2


def test_bad_precision_and_cuda_autocast_in_model_are_errors():
    with torch.device("meta"):
        m = zoo.MLP()
    with pytest.raises(InputError, match="unknown precision 'bf16-mix'.*bf16-mixed"):
        analyze(m, {"x": ("float32", ["B", 16])}, precision="bf16-mix")

    class UsesCudaAutocast(zoo.MLP):
        def forward(self, x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return super().forward(x)

    with torch.device("meta"):
        m = UsesCudaAutocast()
    with pytest.raises(InputError, match="autocast"):
        analyze(m, {"x": ("float32", ["B", 16])}, device="cpu")


def test_cuda_fused_attention_gets_autocast_inputs():
    """The fused kernel memsim routes SDPA to on cuda bypasses autocast's dispatch: its inputs
    are cast as autocast casts SDPA's (to bf16), so the saved q, k, v and output are bf16."""
    with torch.device("meta"):
        m = zoo.Block(sdpa=True)
    r = analyze(m, SEQ, device="cuda", precision="bf16-mixed", inference=False)
    flash = [rec for rec in r.train.trace.run.ops
             if getattr(rec, "op", "") == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert flash and all(rec.outputs[0].dtype == "bfloat16" for rec in flash)


def test_impossible_precision_combination_is_named():
    with torch.device("meta"):
        m = zoo.MLP().half()
    with pytest.raises(InputError, match="'16-mixed' needs fp32 parameters.*GradScaler"):
        analyze(m, {"x": ("float16", ["B", 16])}, precision="16-mixed", device="cpu")

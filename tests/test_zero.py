"""DeepSpeed ZeRO and DDP (modelled: DeepSpeed needs CUDA) — the ZeRO paper's figures,
DeepSpeed's estimators, config loading, and the per-rank model on a traced step."""

import json

import pytest
import torch

from oracle import predict
from strategies import DDP, ZeRO
from strategies.api import analyze as strategy_analyze
from strategies.zero import deepspeed_estimate, load_deepspeed_config, paper_model_states
from tracer import StrategyError


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2019: 7.5B parameters, 64 devices, K = 12: 120, 31.4, 16.6, 1.88 GB."""
    got = [paper_model_states(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert [round(g, 1) for g in got[:3]] == [120.0, 31.4, 16.6]
    assert round(got[3], 2) == 1.88


def test_deepspeed_estimators_formula_for_formula():
    p, ll = 3_000_000_000, 32_000_000
    # estimate_zero2_model_states_mem_needs: 2P + 18P/gpus on the GPU, 4P*gpn*1.5 on the CPU
    assert deepspeed_estimate(2, p, 8, 1) == (2 * p + 18 * p / 8, 4 * p * 8 * 1.5)
    assert deepspeed_estimate(2, p, 8, 1, cpu_offload=True) == (2 * p, p * 32 * 1.5)
    # estimate_zero3_model_states_mem_needs: 4*largest_layer + 18P/gpus
    gpu, cpu = deepspeed_estimate(3, p, 8, 2, largest_layer_params=ll)
    assert gpu == 4 * ll + 18 * p / 16 and cpu == ll * 4 * 8 * 1.5
    assert deepspeed_estimate(3, p, 8, 2, ll, cpu_offload=True, cpu_offload_params=True)[0] == \
        4 * ll


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                               torch.nn.Linear(1024, 256))


X = {"input": ("float32", ["B", 256])}


def test_zero_rank_model_states_shrink_by_stage():
    with torch.device("meta"):
        m = _mlp()
    psi = sum(p.numel() for p in m.parameters())
    figs = {}
    for stage in (1, 2, 3):
        r = strategy_analyze(m, X, zero=ZeRO(stage=stage, dp=8, reduce_bucket_size=10_000),
                             device="cpu", precision="bf16-master", inference=False)
        figs[stage] = r.at(B=4)["train"]
        assert "zero" in r.strategy and any("not checked" in n for n in r.notes)
    # bf16 weights (b = 2), K = 12 over 8 ranks; stage 2 adds the 16-bit gradient partition
    assert figs[1]["parameters"] == 2 * psi and figs[1]["optimizer_states"] == 12 * psi // 8
    assert figs[2]["gradients"] == 2 * psi // 8
    assert figs[3]["parameters"] < figs[2]["parameters"]
    assert figs[1]["peak"] > figs[2]["peak"] > figs[3]["peak"]


def test_ddp_adds_one_gradient_copy():
    with torch.device("meta"):
        m = _mlp()
    base = strategy_analyze(m, X, device="cpu", inference=False).at(B=4)["train"]
    ddp = strategy_analyze(m, X, ddp=DDP(dp=4), device="cpu", inference=False).at(B=4)["train"]
    assert ddp["peak"] == base["peak"] + base["gradients"]


def test_deepspeed_config(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 5e7, "offload_optimizer": {"device": "cpu"}}}))
    z, prec = load_deepspeed_config(str(f), dp=8)
    assert (z.stage, z.reduce_bucket_size, z.offload_optimizer, prec) == (3, 50_000_000, "cpu",
                                                                          "bf16-master")
    f.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}))
    with pytest.raises(StrategyError, match="auto"):
        load_deepspeed_config(str(f), dp=8)


def test_contradictions_name_the_setting():
    from strategies import FSDP, TensorParallel
    with torch.device("meta"):
        m = _mlp()
    with pytest.raises(StrategyError, match="zero and ddp"):
        strategy_analyze(m, X, zero=ZeRO(stage=3, dp=2), ddp=DDP(dp=2))
    with pytest.raises(StrategyError, match="offload_param needs ZeRO stage 3"):
        ZeRO(stage=2, dp=2, offload_param="cpu")
    with pytest.raises(StrategyError, match="stage"):
        ZeRO(stage=4, dp=2)

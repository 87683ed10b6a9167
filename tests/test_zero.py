"""DeepSpeed ZeRO (DeepSpeed's own engine traced on a fake process group) against real 2- and
4-rank DeepSpeed runs on CPU (tests/support/oracles/dist.py); the ZeRO paper's figures, DeepSpeed's
own estimator functions, config loading, the modelled ZeRO-Offload and DDP buckets."""

import json

import pytest
import torch

from memsim.strategies import DDP, LoRA, TensorParallel, ZeRO
from memsim.strategies.compose import analyze as strategy_analyze
from memsim.strategies.zero import load_deepspeed_config
from memsim.tracer import StrategyError

from tests.support.oracles import dist as O
from tests.support.oracles.papers import paper_model_states


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2019: 7.5B parameters, 64 devices, K = 12: 120, 31.4, 16.6, 1.88 GB."""
    got = [paper_model_states(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert [round(g, 1) for g in got[:3]] == [120.0, 31.4, 16.6]
    assert round(got[3], 2) == 1.88


def test_deepspeed_estimators_against_traced_zero2():
    """DeepSpeed 0.19.8's own estimators, called (``estimate_zero2_model_states_mem_needs`` with
    its ``model_to_params`` on a materialized model: on meta every ``data_ptr`` is 0 and its
    de-duplication keeps one tensor), against memsim's traced ZeRO-2 (bf16 master weights, 2
    ranks, modelling a GPU; torch's AdamW, whose step counters stay on the host).

    With ``offload_optimizer`` the estimator's GPU figure is the 16-bit parameters (2P), the
    device's model states in the trace. Without, it is 2P + 18P/N, where 18 = 2 grads_16bit +
    4 grads_32bit + 4 params_32bit + 8 optimizer states (the estimator's own comment): the
    trace's parameters and optimizer states are that less the 6P/N of gradients, which DeepSpeed
    holds only from backward to the end of the step (none left at its end).
    Stage 3's estimate adds 4 x the largest layer, a rule of thumb for the gathered working set,
    not a storage of the trace; its partitioned terms are the same as stage 2's."""
    _need_deepspeed()
    from deepspeed.runtime.zero import stage_1_and_2 as ds
    p, n = ds.model_to_params(O.mlp_model()), 2
    got = {}
    for offload in (True, False):
        with torch.device("meta"):
            m = O.mlp_model()
        zero = ZeRO(stage=2, dp=n, offload_optimizer="cpu" if offload else None, **BUCKETS)
        report = strategy_analyze(m, X64, zero=zero, device="cuda", inference=False,
                                  precision="bf16-master", optimizer=torch.optim.AdamW)
        got[offload] = report.at(B=8)["train"]
    _, gpu = ds.estimate_zero2_model_states_mem_needs(p, n, cpu_offload=True)
    t = got[True]
    assert t["parameters"] + t["gradients"] + t["optimizer_states"] == gpu == 264_704
    _, gpu = ds.estimate_zero2_model_states_mem_needs(p, n, cpu_offload=False)
    t = got[False]
    grads = (2 + 4) * p // n  # the estimator's grads_16bit + grads_32bit terms
    assert t["parameters"] + t["optimizer_states"] == gpu - grads == 1_058_816
    assert t["gradients"] == 0  # both gradient partitions are freed by the end of the step


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                               torch.nn.Linear(1024, 256))


X = {"input": ("float32", ["B", 256])}
X64 = {"input": ("float32", ["B", 64])}


def _need_deepspeed():
    """Skip without deepspeed (the test extra installs it); imported as memsim imports it, its
    logger on stderr."""
    from memsim.strategies.ds_engine import _import_deepspeed
    try:
        _import_deepspeed()
    except StrategyError as e:
        pytest.skip(str(e))


LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
# ZeRO-3 swaps F.linear for its own and leaves it: memsim puts it back after its trace
LINEAR = torch.nn.functional.linear
BUCKETS = {"reduce_bucket_size": 10_000, "allgather_bucket_size": 10_000}


def _bf16_mlp_inputs():
    return {"input": O.mlp_inputs()["input"].to(torch.bfloat16)}


def _peft_llama():
    """The Llama with LoRA as a user adds it, with peft (memsim's ``LoRA(r=4)``: rank 4, alpha
    8, no dropout, on every linear layer of attention)."""
    from peft import LoraConfig, get_peft_model
    return get_peft_model(O.llama_model(), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


# live in every rank that imports peft, outside the step: bitsandbytes' NF4 and FP4 code tables
# (2 x 16 float32) and two int64 scalars of peft's own
PEFT_IMPORT = 2 * 16 * 4 + 2 * 8


# (model, stage, precision, overlap_comm, tp); the real run uses the same settings, written out
# as DeepSpeed's config. Llama fp32 stages 1 and 2: the two ranks differ (partition boundaries).
# DeepSpeed's AutoTP 2 x ZeRO-1 runs on 4 ranks; ZeRO x LoRA with peft's adapters.
CASES = {
    "llama-z1-fp32": ("llama", 1, "32-true", False, 1),
    "llama-z2-fp32-overlap": ("llama", 2, "32-true", True, 1),
    "llama-z3-bf16": ("llama", 3, "bf16-master", False, 1),
    "mlp-z2-bf16": ("mlp", 2, "bf16-master", False, 1),
    "lora-llama-z1-fp32": ("lora", 1, "32-true", False, 1),
    "llama-z1-fp32-autotp2x2": ("llama", 1, "32-true", False, 2),
    "llama-z2-fp32-offload": ("llama", 2, "32-true", False, 1),
    "llama-z3-fp32-offload": ("llama", 3, "32-true", False, 1),
    "llama-z3-fp32-offload-params": ("llama", 3, "32-true", False, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy)
                                  if c in ("llama-z1-fp32-autotp2x2", "llama-z2-fp32-offload")
                                  else c for c in CASES])
def test_zero_matches_real_deepspeed_run(case):
    """Every rank's peak, parameters, gradients and optimizer states, traced with DeepSpeed's
    engine, equal a real DeepSpeed step's (CPU accelerator, gloo) to the byte; the LoRA case's
    real model has peft's adapters (``get_peft_model``). With ``offload_optimizer`` the run is
    on the CPU, so the host placements are in the figures (ZeRO-3 offload: the fp32
    partition's own gradient on the host and the reduced partition buffer, 2 x 180,864 B)."""
    _need_deepspeed()
    model, stage, prec, overlap, tp = CASES[case]
    offload = case.endswith(("offload", "offload-params"))
    params_too = case.endswith("offload-params")
    zero = ZeRO(stage=stage, dp=2, overlap_comm=overlap, stage3_prefetch_bucket_size=10_000,
                stage3_param_persistence_threshold=100, **BUCKETS,
                offload_optimizer="cpu" if offload else None,
                offload_param="cpu" if params_too else None)
    factory, inputs, point = ((O.mlp_model, X64, {"B": 8}) if model == "mlp" else
                              (O.llama_model, LM, {"B": 2, "S": 16}))
    with torch.device("meta"):
        m = factory()
    report = strategy_analyze(m, inputs, zero=zero, device="cpu", inference=False,
                              precision=prec, tp=TensorParallel(tp) if tp > 1 else None,
                              lora=LoRA(r=4) if model == "lora" else None)
    keys = ("peak", "parameters", "gradients", "optimizer_states")
    predicted = {r: report.at(**point)["train"] for r in range(2 * tp)}
    for rc in report.ranks:
        for r in rc.ranks:
            predicted[r] = rc.report.at(**point)["train"]
    predicted = {r: tuple(f[k] for k in keys) for r, f in predicted.items()}
    config = {"zero_optimization": {"stage": stage, "overlap_comm": overlap, **BUCKETS,
                                    "stage3_prefetch_bucket_size": 10_000,
                                    "stage3_param_persistence_threshold": 100}}
    if prec == "bf16-master":
        config["bf16"] = {"enabled": True}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    if offload:  # the client optimizer on the host partitions (CPU Adam is a compiled op)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    if params_too:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    inputs_fn = (O.llama_inputs if model != "mlp" else
                 _bf16_mlp_inputs if prec == "bf16-master" else O.mlp_inputs)
    real = O.measure(_peft_llama if model == "lora" else factory, inputs_fn,
                     strategy=O.DeepSpeed(config), world_size=2 * tp)
    # what importing peft leaves alive is outside the step, not modelled: the oracle counts it
    # in its peak and under `other`, beside DeepSpeed's own 4-byte float32 (the loss it scaled
    # by gradient_accumulation_steps in the last backward, a tensor of the step memsim traces)
    peft = PEFT_IMPORT if model == "lora" else 0
    assert not peft or all(r.other == peft + 4 for r in real), [r.other_detail for r in real]
    assert {r.rank: (r.peak - peft, *(getattr(r, k) for k in keys[1:])) for r in real} == \
        predicted
    assert report.at(**point)["train"]["peak"] == max(r.peak - peft for r in real)
    assert any("DeepSpeed's own ZeRO" in n for n in report.notes)
    if case == "llama-z1-fp32":
        assert len(report.ranks) == 2 and "ranks differ" in " ".join(report.notes)


def _narrow_mlp():
    return O.mlp_model(width=32, hidden=128, blocks=1)


def _narrow_inputs():
    return O.mlp_inputs(batch=8, width=32)


@pytest.mark.slow
def test_zero2_matches_real_run_where_stage_1_differs():
    """ZeRO-2, fp32, 2 ranks, on Linear(32, 128), GELU, Linear(128, 32) (8,352 parameters, each
    tensor under the 10,000-element reduce bucket), B=8: every rank's peak, parameters,
    gradients, optimizer states and activation peak, traced with DeepSpeed's engine, equal a
    real DeepSpeed ZeRO-2 step's. The stages part here: ZeRO-1 keeps each gradient as a tensor
    of its own until backward ends, then copies them into its reduce bucket, where ZeRO-2
    copies each into the bucket as it is made; a real ZeRO-1 step of this model peaks at
    163,096 B on both ranks, its activation peak 79,568 B, against ZeRO-2's 158,996 and 75,468
    (the ZeRO-2 cases above, at width 64, tell the two stages apart only under offload).

    The oracle's activation peak leaves out what it finds alive outside the step (``other``):
    on each rank one float32 scalar, the loss DeepSpeed's backward scaled by
    gradient_accumulation_steps, kept from the last step; memsim traces it as a temporary of
    the step, so its activation peak is the oracle's plus those 4 bytes."""
    _need_deepspeed()
    with torch.device("meta"):
        m = _narrow_mlp()
    report = strategy_analyze(m, {"input": ("float32", ["B", 32])}, zero=ZeRO(
        stage=2, dp=2, **BUCKETS), device="cpu", inference=False)
    keys = ("peak", "parameters", "gradients", "optimizer_states", "activation_peak")
    predicted = {r: report.at(B=8)["train"] for r in range(2)}
    for rc in report.ranks:
        for r in rc.ranks:
            predicted[r] = rc.report.at(B=8)["train"]
    real = O.measure(_narrow_mlp, _narrow_inputs,
                     strategy=O.DeepSpeed({"zero_optimization": {"stage": 2, **BUCKETS}}))
    assert [r.other_detail for r in real] == [["Tensor() torch.float32 4 B"]] * 2
    assert {r.rank: (r.peak, r.parameters, r.gradients, r.optimizer_states,
                     r.activation_peak + r.other) for r in real} == \
        {r: tuple(p[k] for k in keys) for r, p in predicted.items()}


WIDE = {"input": ("float32", ["B", 1024])}


def _wide_mlp():
    return O.mlp_model(width=1024, hidden=4096, blocks=2)


def _wide_inputs():
    return O.mlp_inputs(batch=8, width=1024)


@pytest.mark.wide
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_realistic_width_default_buckets_matches_real_run(stage):
    """A realistic width with DeepSpeed's default buckets (reduce_bucket_size 5e8, stage-3
    prefetch 5e7, persistence threshold 1e5): 2 blocks of Linear(1024, 4096), GELU,
    Linear(4096, 1024), fp32, AdamW, B=8, 2 ranks. Every rank's peak, parameters, gradients and
    optimizer states equal the real run's. Stage 2: 2,235,089,940 B; stage 3: 2,319,057,945 B,
    reached in backward while gloo's reduce-scatter holds its copy of the whole 67,149,824-byte
    gradient bucket (16,334,860 B low when that copy was not modelled). About 15 s each."""
    _need_deepspeed()
    with torch.device("meta"):
        m = _wide_mlp()
    report = strategy_analyze(m, WIDE, zero=ZeRO(stage=stage, dp=2), device="cpu",
                              inference=False)
    keys = ("peak", "parameters", "gradients", "optimizer_states")
    predicted = {r: report.at(B=8)["train"] for r in range(2)}
    for rc in report.ranks:
        for r in rc.ranks:
            predicted[r] = rc.report.at(B=8)["train"]
    real = O.measure(_wide_mlp, _wide_inputs,
                     strategy=O.DeepSpeed({"zero_optimization": {"stage": stage}}))
    assert {r.rank: tuple(getattr(r, k) for k in keys) for r in real} == \
        {r: tuple(p[k] for k in keys) for r, p in predicted.items()}


def _uneven_mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 33), torch.nn.GELU(), torch.nn.Linear(33, 1))


@pytest.mark.slow
def test_zero3_ranks_grouped_by_partition_data_match_real_run():
    """Stage 3 traces one rank per group of ranks whose partitions hold the same amount of
    every parameter. Over 4 ranks, the 33-element bias gives ranks 0-2 9 elements and rank 3
    6, and the 1-element bias is real data on rank 0 only: groups {0}, {1, 2}, {3}. Over 3
    ranks (the run checked, the cheaper one): {0}, {1, 2}, two traces. Every rank's figures,
    rank 2's (not traced) among them, equal a real 3-rank run's."""
    _need_deepspeed()
    zero = ZeRO(stage=3, dp=3, stage3_param_persistence_threshold=0, **BUCKETS)
    assert ZeRO(stage=3, dp=4).partition_classes(_uneven_mlp(), 4) == ((0,), (1, 2), (3,))
    assert zero.partition_classes(_uneven_mlp(), 3) == ((0,), (1, 2))
    assert ZeRO(stage=2, dp=4).partition_classes(_uneven_mlp(), 4) is None
    with torch.device("meta"):
        m = _uneven_mlp()
    report = strategy_analyze(m, X64, zero=zero, device="cpu", inference=False)
    keys = ("peak", "parameters", "gradients", "optimizer_states")
    predicted = {r: report.at(B=8)["train"] for r in range(3)}
    for rc in report.ranks:
        for r in rc.ranks:
            predicted[r] = rc.report.at(B=8)["train"]
    assert "2 of 3 ranks traced" in " ".join(report.notes)
    real = O.measure(_uneven_mlp, O.mlp_inputs, strategy=O.DeepSpeed({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, **BUCKETS}}), world_size=3)
    assert {r.rank: tuple(getattr(r, k) for k in keys) for r in real} == \
        {r: tuple(p[k] for k in keys) for r, p in predicted.items()}


def test_zero_settings_errors():
    with torch.device("meta"):
        m = O.llama_model()
    with pytest.raises(StrategyError, match="AutoTP"):
        strategy_analyze(m, LM, zero=ZeRO(1, 2), tp=TensorParallel(2, sequence_parallel=True))
    with pytest.raises(StrategyError, match="bf16-mixed"):
        strategy_analyze(m, LM, zero=ZeRO(1, 2), precision="bf16-mixed", inference=False)
    # DeepSpeed's own AutoTP refuses Phi-3's plan words (PyTorch's TP reads them)
    _need_deepspeed()
    with torch.device("meta"):
        phi3 = O.hf_causal_lm("Phi3Config", "Phi3ForCausalLM", pad_token_id=0)
    with pytest.raises(StrategyError, match=r"(?s)AutoTP refuses.*rowwise_split_input.*--fsdp"):
        strategy_analyze(phi3, LM, zero=ZeRO(1, 1, **BUCKETS), tp=TensorParallel(2),
                         inference=False)


@pytest.mark.slow
def test_zero_offload_splits_device_and_host_on_gpu():
    """Modelling a GPU, DeepSpeed's CPU placements are host memory: ZeRO-3 with
    ``offload_optimizer: {device: cpu}`` and the client AdamW, 2 ranks. Each rank's model
    states, on the device and on the host, equal the sizes derived below from the model and
    DeepSpeed's placements (the CPU analysis of the same step, every figure, equals a real
    DeepSpeed run: ``llama-z3-fp32-offload`` above)."""
    import dataclasses

    from memsim.analysis.memory import step_memory
    _need_deepspeed()
    with torch.device("meta"):
        m = O.llama_model()
    kw = dict(zero=ZeRO(stage=3, dp=2, offload_optimizer="cpu", **BUCKETS,
                        stage3_prefetch_bucket_size=10_000, stage3_param_persistence_threshold=100),
              inference=False, optimizer=lambda ps: torch.optim.AdamW(ps))
    gpu = strategy_analyze(m, LM, device="cuda", **kw)
    g = gpu.at(B=2, S=16)["train"]
    sub, pt = gpu.for_point({"B": 2, "S": 16})
    host = step_memory(dataclasses.replace(sub.train.trace, device="host"))
    # Llama (hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 128, lm_head
    # untied): embed 128*64 + 2 * (q 64*64 + k, v 64*32 + o 64*64 + 3 * 64*128 + 2 norms of
    # 64) + norm 64 + lm_head 128*64 = 90,432 elements, every tensor even, so ZeRO-3 gives each
    # of the 2 ranks 45,216, one flat fp32 buffer of 180,864 B on the device: 354 of the CUDA
    # caching allocator's 512-byte blocks. The 5 norms (64 elements, under the persistence
    # threshold of 100) also stay whole on every rank, 256 B each, a block each.
    part = 45_216 * 4
    assert (g["parameters"], g["gradients"], g["optimizer_states"]) == (354 * 512 + 5 * 512, 0, 0)
    # On the host (exact bytes): the fp32 master partition and AdamW's two moments, and its
    # float32 step counter; the reduced gradient partition and the fp32 partition's own .grad
    assert (int(host.optimizer_states), int(host.gradients)) == (3 * part + 4, 2 * part)
    assert int(host.parameters) == 0
    assert torch.nn.functional.linear is LINEAR  # a later analysis traces torch's linear
    # the caching allocator replay of DeepSpeed's loop runs its traced warm-up steps first;
    # with expandable segments (every block split to its request) the measured step's
    # allocated peak in the replay is the traced device peak exactly
    from memsim.analysis.alloc_conf import AllocConf
    from memsim.analysis.reserved import replay
    assert sub.train.trace.run.warmed
    rr = replay(sub.train, pt, conf=AllocConf.parse("expandable_segments:True"))
    assert rr.allocated == g["peak"] and rr.reserved >= rr.allocated


@pytest.mark.wide
def test_zero3_on_gpu_replays_a_step_for_the_second_warm_up(monkeypatch):
    """Modelling CUDA, stage 3 traces one warm-up step and the caching-allocator replay walks
    the measured step once more before the one it measures (``RunRecord.replays``), then
    again until a walk changes no figure (analysis/reserved.py, ``STEADY_WALKS``). Every
    figure then equals those of one traced warm-up alone and of two (2 of Llama-2-7B's layers,
    bf16, 8 ranks, DeepSpeed's default buckets; ``python -m benchmarks.ds_warmups``). The
    previous step's output, alive into the next forward, moves blocks for a few steps
    (``python -m benchmarks.replay_walks``); the replay's rule for when they have settled is
    checked against an independent simulation of the allocator in
    tests/test_replay_oracle.py."""
    _need_deepspeed()
    from transformers import LlamaConfig, LlamaForCausalLM

    from memsim.analysis.reserved import replay
    from memsim.strategies.ds_engine import DeepSpeedDriver
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                      num_hidden_layers=2)
    init = DeepSpeedDriver.__init__
    got = {}
    for warmup, replays in ((1, 0), (1, 1), (2, 0)):
        def counted(self, *a, n=warmup, r=replays, **kw):
            init(self, *a, **kw)
            assert (self.warmup, self.replays) == (1, 1)  # stage 3 on CUDA by default
            self.warmup, self.replays = n, r

        monkeypatch.setattr(DeepSpeedDriver, "__init__", counted)
        with torch.device("meta"):
            m = LlamaForCausalLM(cfg)
        r = strategy_analyze(m, LM, device="cuda", precision="bf16-master", inference=False,
                             zero=ZeRO(stage=3, dp=8))
        sub, pt = r.for_point({"B": 2, "S": 512})
        assert sub.train.trace.run.replays == replays
        got[warmup, replays] = (sub.at(**pt)["train"]["peak"], replay(sub.train, pt).as_dict())
    assert got[1, 0] == got[1, 1] == got[2, 0]


def test_zero3_on_gpu_with_hugging_face_kv_cache():
    """Hugging Face's default ``use_cache=True`` keeps a KV cache in training too, started as
    ``torch.tensor([], device=key_states.device)``; on the fake GPU device ``cpu:1`` torch
    made that tensor on ``cpu`` and the first ``torch.cat`` failed ("Tensor on device cpu:1 is
    not on the expected device cpu"). It is made on the GPU device: the step traces, and the
    device peak (in forward, at the final norm) grows by two caches' keys and values: this
    step's, and the previous step's, which its output holds until the loop rebinds ``out``."""
    _need_deepspeed()
    kw = dict(zero=ZeRO(stage=3, dp=2, **BUCKETS, stage3_prefetch_bucket_size=10_000,
                        stage3_param_persistence_threshold=100), inference=False)
    got, live = [], []
    for cache in (False, True):
        with torch.device("meta"):
            m = O.llama_model(use_cache=cache)
        r = strategy_analyze(m, LM, device="cuda", **kw)
        got.append(r.at(B=2, S=16)["train"]["peak"])
        live.append(r.train.breakdown({"B": 2, "S": 16}))
    off, on = got
    # a cache's keys and values: 2 layers x (keys + values) x B 2 x 2 KV heads x S 16 x
    # head 16 x 4 bytes (1,739,264 B without it)
    cache = 2 * 2 * 2 * 2 * 16 * 16 * 4
    assert on == off + 2 * cache
    # both caches are activations at the peak, the traced warm-up's as the step's own (each
    # tensor a 512-byte block: a layer's keys or values are 4 KiB)
    assert live[1]["activation"] == live[0]["activation"] + 2 * cache
    assert live[1]["temporary"] == live[0]["temporary"]


def test_zero_with_autotp_on_gpu():
    """DeepSpeed's AutoTP builds its device mesh on its accelerator's device name, which on
    the fake GPU device is "cpu:1": torch refused it ("Device type with index is not
    supported"), so ZeRO x TP failed on every model modelling CUDA. The mesh is built on the
    CPU's device type (it holds no tensor of the step). Each rank's parameters, gradients and
    optimizer states on the GPU equal the local shard's sizes, derived below; the CPU run of
    the same composition is compared with real DeepSpeed above (llama-z1-fp32-autotp2x2)."""
    _need_deepspeed()
    with torch.device("meta"):
        m = O.llama_model()
    r = strategy_analyze(m, LM, device="cuda", zero=ZeRO(1, dp=1, **BUCKETS),
                         tp=TensorParallel(2), inference=False)
    assert "AutoTP over 2 tensor-parallel ranks" in r.notes[0]
    t = r.at(B=2, S=16)["train"]
    # AutoTP follows Llama's Hugging Face plan (DeepSpeed converts it): q, k, v, gate and up
    # split by output rows, o and down by input columns, lm_head by its vocab rows
    # (colwise_gather_output); embeddings and norms whole. A layer: (q 64*64 + k, v 64*32 +
    # o 64*64 + 3 * 64*128) / 2 + 2 norms of 64 = 18,560 elements; 2 layers + embeddings
    # 128*64 + final norm 64 + lm_head 128*64 / 2 = 49,472 fp32 elements, 197,888 B a rank,
    # which ZeRO-1 flattens into one buffer: 387 of the CUDA caching allocator's 512-byte
    # blocks.
    flat = 387 * 512
    # With dp 1 the rank's optimizer partition is all of it: the fp32 master copy and AdamW's
    # two moments, and the step counter of torch's fused AdamW (memsim's stand-in for
    # DeepSpeed's FusedAdam, its note says), a float32 on the parameters' device, one block.
    # ZeRO-1 frees the gradients by the end of the step.
    assert (t["parameters"], t["gradients"], t["optimizer_states"]) == (flat, 0, 3 * flat + 512)


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
    with torch.device("meta"):
        m = _mlp()
    with pytest.raises(StrategyError, match="zero and ddp"):
        strategy_analyze(m, X, zero=ZeRO(stage=3, dp=2), ddp=DDP(dp=2))
    with pytest.raises(StrategyError, match="offload_param needs ZeRO stage 3"):
        ZeRO(stage=2, dp=2, offload_param="cpu")
    with pytest.raises(StrategyError, match="stage"):
        ZeRO(stage=4, dp=2)
    # real DeepSpeed (0.19.8) fails in deepspeed.initialize on AutoTP over peft's LoRA layers
    with pytest.raises(StrategyError, match=r"(?s)tp and LoRA.*loses its adapters.*drop tp"):
        strategy_analyze(m, X, zero=ZeRO(stage=1, dp=2), tp=TensorParallel(2), lora=LoRA(r=4))


def test_cli_deepspeed_config_traces_the_engine(tmp_path, capsys):
    _need_deepspeed()
    from memsim.cli import main
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 1e4, "allgather_bucket_size": 1e4,
        "stage3_prefetch_bucket_size": 1e4, "stage3_param_persistence_threshold": 100}}))
    args = ["analyze", "examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]",
            "--at", "B=2,S=8", "--device", "cpu", "--train", "--deepspeed", str(f), "--dp", "2"]
    assert main(args) == 0   # the text output only: one DeepSpeed analysis (the budget)
    out = capsys.readouterr().out
    assert "DeepSpeed ZeRO-3 dp=2 (DeepSpeed's engine, traced)" in out
    assert "DeepSpeed's own ZeRO-3 engine" in out.replace("\n", " ")

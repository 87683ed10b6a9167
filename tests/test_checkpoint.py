"""Checkpointing plans: applied for real with torch.utils.checkpoint, re-analysed by tracing, and
compared with a real CPU run of the same checkpointed model (byte for byte)."""

import functools
import json

import pytest
import torch

from memsim.strategies.checkpoint import (apply_checkpointing, blocks, named_plan, optimal_plan,
                                   plans_over_range, ranking, remove_checkpointing)
from memsim.cli import main
from memsim.tracer import InputError

from tests.support import zoo
from tests.support.oracles.measure import example_inputs, measure_train
from tests.support.predict import check, predict

GPT = {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])}


def tiny():
    return zoo.TinyGPT(layers=3, sdpa=False)


@functools.lru_cache(maxsize=None)
def plain():
    return predict(tiny, GPT, inference=False)


def with_plan(plan_name):
    def factory():
        m = tiny()
        return apply_checkpointing(m, named_plan(m, plan_name))
    return factory


@pytest.mark.parametrize("plan", ["blocks", "selective"])
def test_named_plans_match_real_run(plan):
    report = predict(with_plan(plan), GPT, inference=False)
    check(report, with_plan(plan), GPT, [{"B": 2, "S": 8}, {"B": 3, "S": 33}])
    none = plain()
    pt = {"B": 3, "S": 33}
    assert report.at(**pt)["train"]["saved_activations"] < \
        none.at(**pt)["train"]["saved_activations"]


def test_plans_name_modules():
    m = tiny()
    assert blocks(m) == ["h.0", "h.1", "h.2"]
    assert named_plan(m, "every:2") == ["h.0", "h.2"]
    assert named_plan(m, "selective") == [f"h.{i}.attn" for i in range(3)]
    with pytest.raises(InputError, match="does not have"):
        apply_checkpointing(m, ["h.9"])


_SHARED: dict = {}


# Real peaks of tiny() at B 4, S 40 with its first 0, 1, 2 blocks checkpointed: 1,978,152,
# 1,564,392 and 1,173,544 B: within 95% of the first, one block is needed; within 70%, two
@pytest.mark.parametrize("frac,fewest", [(0.95, 1), (0.7, 2)])
def test_optimal_plan_fits_with_fewest_blocks_real_run(frac, fewest):
    """The blocks search's plan: leading blocks, as many as real runs need (the plan fits, one
    block fewer does not), and its prediction equals a real run of it."""
    with torch.device("meta"):
        m = tiny()
    pt = {"B": 4, "S": 40}
    none = plain()
    budget = int(none.at(**pt)["train"]["peak"] * frac)
    res = optimal_plan(m, GPT, pt, budget, device="cpu", base=none, cache=_SHARED,
                       search="blocks")
    assert res is not None and res.plan == blocks(m)[:fewest]
    assert res.report.at(**pt)["train"]["peak"] <= budget
    assert _real_peak(fewest, pt["S"], tiny) <= budget < _real_peak(fewest - 1, pt["S"], tiny)
    factory = lambda: apply_checkpointing(tiny(), res.plan)  # noqa: E731
    check(res.report, factory, GPT, [pt])  # the advised plan, run for real
    assert res.report.train.evaluate(res.recompute_flops, pt) == \
        _real_step_flops(res.plan, tiny, **pt) - _real_step_flops([], tiny, **pt)


@pytest.mark.heavy
def test_modules_search_mixes_blocks_and_children_real_run():
    """``search="modules"`` (the CLI's default): at a budget where whole blocks need two of
    three blocks, the search finds a cheaper plan that mixes a block with MLPs; it fits, its
    recompute is below the fewest-blocks plan's, and a real run of it equals the prediction."""
    with torch.device("meta"):
        m = tiny()
    pt = {"B": 4, "S": 40}
    none = plain()
    budget = int(none.at(**pt)["train"]["peak"] * 0.7)
    res = optimal_plan(m, GPT, pt, budget, device="cpu", base=none)
    by_blocks = optimal_plan(m, GPT, pt, budget, device="cpu", base=none, cache=_SHARED,
                             search="blocks")
    t = res.report.train
    assert res.report.at(**pt)["train"]["peak"] <= budget
    assert res.plan == ["h.0", "h.1.mlp", "h.2.mlp"] and by_blocks.plan == ["h.0", "h.1"]
    # Recomputed in backward at B 4, S 40 (160 tokens, d 32; torch.utils.flop_counter's 2*m*n*k
    # per matmul), per block: c_attn 2*160*32*96 = 983,040, q @ k^T and att @ v
    # 2*(4*4 heads)*40*8*40 = 409,600 each, c_proj 2*160*32*32 = 327,680, the MLP's first Linear
    # 2*160*32*128 = 1,310,720; not the MLP's last Linear, whose output nothing saves (the
    # non-reentrant checkpoint stops early): 3,440,640 per block, 1,310,720 per MLP alone
    # (docs/checkpointing.md: 6.06 vs 6.88 MFLOP). Each also from real steps: the plan's FLOPs less the plain's
    plain_flops = _real_step_flops([], tiny, **pt)
    assert t.evaluate(res.recompute_flops, pt) == 3_440_640 + 2 * 1_310_720 == \
        _real_step_flops(res.plan, tiny, **pt) - plain_flops
    assert by_blocks.report.train.evaluate(by_blocks.recompute_flops, pt) == 2 * 3_440_640 == \
        _real_step_flops(by_blocks.plan, tiny, **pt) - plain_flops
    check(res.report, lambda: apply_checkpointing(tiny(), res.plan), GPT, [pt])


def test_plans_over_a_range_of_S():
    """Bands of S, each with its optimal plan: contiguous from the range's start, one block more
    from one band to the next, each band the point-wise optimum at its ends; real runs: each
    band's plan fits at its top S and not one above, and beyond the last band (inside the
    range) not even every block fits; the last band's plan equals a real run at its top.

    At this budget every plan has a band: at S = 57 a real run with the third block
    checkpointed too peaks lower than with two (they are equal at S = 40), and only it fits."""
    with torch.device("meta"):
        m = tiny()
    none = plain()
    budget = int(none.at(B=4, S=40)["train"]["peak"] * 0.75)
    bands = plans_over_range(m, GPT, {"B": 4}, "S", 8, 64, budget, device="cpu", base=none,
                             cache=_SHARED, search="blocks")
    assert bands[0].lo == 8 and [b.blocks for b in bands] == [0, 1, 2, 3]
    for a, b in zip(bands, bands[1:]):
        assert b.lo == a.hi + 1
    for b in bands:
        assert b.plan == blocks(m)[:b.blocks]
        assert _real_peak(b.blocks, b.hi, tiny) <= budget < _real_peak(b.blocks, b.hi + 1, tiny)
        for s in {b.lo, b.hi}:
            opt = optimal_plan(m, GPT, {"B": 4, "S": s}, budget, device="cpu", base=none,
                               search="blocks",
                               cache=_SHARED)
            assert len(opt.plan) == b.blocks, (b.lo, b.hi, s)
    last = bands[-1]
    assert last.hi < 64   # the range goes on where nothing fits
    assert optimal_plan(m, GPT, {"B": 4, "S": last.hi + 1}, budget, device="cpu",
                        search="blocks", base=none, cache=_SHARED) is None
    check(last.result.report, lambda: apply_checkpointing(tiny(), last.plan), GPT,
          [{"B": 4, "S": last.hi}])


def test_cli_checkpoint_range(capsys):
    args = ["checkpoint", "tests.support.zoo:TinyGPT", "--input", "idx=int64[B,S]", "--input",
            "targets=int64[B,S]", "--device", "cpu", "--at", "B=4", "--budget", "1MiB",
            "--range", "S=8:64"]
    code = main(args + ["--search", "blocks", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["at"]["S"] == 64 and doc["search"] == "blocks"
    bands = [(b["from"], b["to"], b["plan"]) for b in doc["bands"]]
    assert bands == [(8, 33, []), (34, 53, ["h.0"]), (54, 56, ["h.0", "h.1"])]
    # real runs: each band's plan fits at its top S and not one S above, where the band after
    # needs one more block; beyond S = 56 not even both blocks fit, so the range does not fit
    for lo, hi, plan in bands:
        assert _real_peak(len(plan), hi) <= 2 ** 20 < _real_peak(len(plan), hi + 1)
    assert code == 1
    assert main(args[:-1] + ["S=8:12"]) == 0   # the text (the plan-free step fits: one trace)
    out = capsys.readouterr().out
    assert "Optimal plan for S = 8..12" in out and "8..12  0 of 2" in out
    assert main(args + ["--plan", "blocks"]) == 2
    assert main(args[:-1] + ["S=64:8"]) == 2


def _checkpointing(model: torch.nn.Module, paths: list[str]) -> torch.nn.Module:
    """``model`` with the modules at ``paths`` under non-reentrant torch.utils.checkpoint
    (wrapped here, not by memsim)."""
    from torch.utils.checkpoint import checkpoint

    modules = dict(model.named_modules())
    for p in paths:
        modules[p].forward = functools.partial(checkpoint, modules[p].forward,
                                               use_reentrant=False)
    return model


def _real_peak(checkpointed: int, S: int, factory=zoo.TinyGPT) -> int:
    """The peak of a real CPU step of ``factory()`` (the CLI's TinyGPT unless told) at B 4 and
    ``S``, its first ``checkpointed`` blocks checkpointed."""
    torch.manual_seed(0)
    m = _checkpointing(factory(), [f"h.{i}" for i in range(checkpointed)])
    return measure_train(m, example_inputs(GPT, {"B": 4, "S": S})).peak


def test_ranking_groups_repeated_blocks():
    rows = {r.path: r for r in ranking(plain())}
    assert rows["h.*"].count == 3 and rows["h.*"].type == "Block"


def test_cli_checkpoint_json(capsys):
    args = ["checkpoint", "tests.support.zoo:TinyGPT", "--input", "idx=int64[B,S]", "--input",
            "targets=int64[B,S]", "--device", "cpu", "--at", "B=2,S=16", "--plan", "blocks",
            "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"] == ["h.0", "h.1"]
    assert set(doc) >= {"plan", "train", "recompute_flops", "step_flops", "conditions"}
    # what the figures assume: the checkpoint's flavour; no KV cache here (not Hugging Face)
    assert len(doc["conditions"]) == 1 and "use_reentrant=False" in doc["conditions"][0]
    # Recomputed in backward, per block (d 32, B*S = 32 tokens, torch.utils.flop_counter's
    # 2*m*n*k per matmul): c_attn 2*32*32*96 = 196,608, c_proj 2*32*32*32 = 65,536, mlp's first
    # Linear 2*32*32*128 = 262,144; not its last Linear, whose output nothing saves (the
    # non-reentrant checkpoint stops early); CPU's flash-attention kernel has no formula there
    assert doc["recompute_flops"] == {"formula": "32768*B*S",
                                      "bytes": 2 * (196_608 + 65_536 + 262_144)}
    assert doc["step_flops"]["bytes"] == _real_step_flops(["h.0", "h.1"]) and \
        doc["recompute_flops"]["bytes"] == _real_step_flops(["h.0", "h.1"]) - _real_step_flops([])
    assert main(args[:-3] + ["--plan", "optimal"]) == 2  # optimal needs a budget


def _real_step_flops(paths: list[str], factory=zoo.TinyGPT, B: int = 2, S: int = 16) -> int:
    """FlopCounterMode over a real training step of ``factory()`` (the CLI's TinyGPT unless
    told) at ``B`` and ``S`` with the modules at ``paths`` checkpointed."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    m = _checkpointing(factory(), paths)
    idx = torch.zeros(B, S, dtype=torch.int64)
    with FlopCounterMode(display=False) as fc:
        m(idx, idx).backward()
    return fc.get_total_flops()


@pytest.mark.slow
@pytest.mark.parametrize("model,plan", [("llama", "blocks"), ("gpt2", "selective"),
                                        ("llama", "selective"),
                                        ("llama", "every:2")])
def test_hf_plans_match_real_run(model, plan):
    """apply_checkpointing on Hugging Face layers (called with keyword arguments)."""
    hf = pytest.importorskip("tests.support.hf_models")
    base = getattr(hf, model)

    def factory():
        m = base()
        return apply_checkpointing(m, named_plan(m, plan))

    report = predict(factory, hf.LM, inference=False)
    check(report, factory, hf.LM, [{"B": 2, "S": 5}, {"B": 3, "S": 16}])


@pytest.mark.slow
def test_blocks_plan_equals_hugging_faces_own_checkpointing():
    """memsim's "blocks" plan on a Hugging Face Llama (use_cache at its default, True) against
    a real run of the model as users checkpoint it, gradient_checkpointing_enable(): equal in
    every figure. With the cache left on, the recomputation in backward appended each layer's
    keys and values to the cache again and the cache kept the recomputed graph to the end of
    backward (Llama-2-7B, FSDP2 dp 8, B 8, S 2048: 49.30 GiB, 20.64 without)."""
    hf = pytest.importorskip("tests.support.hf_models")
    from memsim.strategies.compose import analyze

    def hf_checkpointed():
        m = hf.llama()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    with torch.device("meta"):
        m = hf.llama()
    assert m.config.use_cache is True
    report = analyze(m, hf.LM, device="cpu", inference=False, checkpoint="blocks")
    assert m.config.use_cache is True  # the user's model is left as it was
    assert any("use_cache=False" in n for n in report.notes)
    check(report, hf_checkpointed, hf.LM, [{"B": 2, "S": 5}, {"B": 3, "S": 16}])
    with_plan = apply_checkpointing(hf.llama(), named_plan(m, "blocks"))
    assert with_plan.config.use_cache is False
    assert remove_checkpointing(with_plan).config.use_cache is True


_LLAMA: dict = {}


@functools.lru_cache(maxsize=None)
def llama_plain():
    hf = pytest.importorskip("tests.support.hf_models")
    return predict(hf.llama, hf.LM, inference=False)


@pytest.mark.slow
@pytest.mark.parametrize("frac", [0.95, 0.85])
def test_hf_llama_optimal_plan_real_run(frac):
    """The optimal plan (modules search) for a Llama-style model at two budgets: it fits, and a
    real run of the checkpointed model equals the prediction."""
    hf = pytest.importorskip("tests.support.hf_models")

    pt = {"B": 4, "S": 64}
    with torch.device("meta"):
        m = hf.llama()
    none = llama_plain()
    budget = int(none.at(**pt)["train"]["peak"] * frac)
    res = optimal_plan(m, hf.LM, pt, budget, device="cpu", base=none, cache=_LLAMA)
    assert res is not None and res.plan and res.report.at(**pt)["train"]["peak"] <= budget
    check(res.report, lambda: apply_checkpointing(hf.llama(), res.plan), hf.LM, [pt])


def test_recomputation_leaves_the_module_stack_as_it_found_it():
    """Checkpoint's recomputation stops early (an exception), skipping the forward hooks that
    pop memsim's module stack: backward ops after it must not be charged to a stale module."""
    report = predict(with_plan("blocks"), GPT, inference=False)
    ops = [op for op in report.train.trace.run.ops if getattr(op, "phase", None) is not None]
    backward = [op.module for op in ops if op.phase.value == "backward"]
    assert backward[-1] is None  # the embedding's backward runs in no module's forward
    assert any(m is not None and m.startswith("h.") for m in backward)  # the recomputation


def _op_sac_llama():
    """hf_models' Llama (use_cache=False) with each decoder layer under non-reentrant
    torch.utils.checkpoint with selective checkpointing: torchtitan's op-level policy (every
    other matmul output and the attention kernel's saved, the rest recomputed)."""
    from collections import defaultdict

    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    hf = pytest.importorskip("tests.support.hf_models")

    saved_ops = {torch.ops.aten.mm.default,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                 torch.ops.aten._scaled_dot_product_efficient_attention.default,
                 torch.ops.aten._scaled_dot_product_flash_attention.default}

    def context():
        seen = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            phase = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                seen[phase] += 1
            save = func in saved_ops and not (func == torch.ops.aten.mm.default
                                              and seen[phase] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    def forward(layer, *args, **kwargs):
        return checkpoint(type(layer).forward, layer, *args, use_reentrant=False,
                          context_fn=context, **kwargs)

    m = hf.llama()
    m.config.use_cache = False
    for layer in m.model.layers:
        layer.forward = functools.partial(forward, layer)
    return m


@pytest.mark.slow
def test_selective_checkpointing_policy_real_run():
    """Selective activation checkpointing (create_selective_checkpoint_contexts) on each layer
    of a Hugging Face Llama, against a real run. The outputs the policy saved are kept by the
    recomputation's dispatch mode (``_CachedTorchDispatchMode.storage``), which checkpoint holds
    until backward has released all the region saved: a cached output the early-stopped
    recomputation never reaches (each layer's down_proj matmul) lives until then, well after the
    recomputation (memsim had it freed with the recomputation: 12,288 B low at B 3, S 16)."""
    hf = pytest.importorskip("tests.support.hf_models")

    report = predict(_op_sac_llama, hf.LM, inference=False)
    check(report, _op_sac_llama, hf.LM,
          [{"B": 2, "S": 5}, {"B": 3, "S": 16}, {"B": 4, "S": 9}])

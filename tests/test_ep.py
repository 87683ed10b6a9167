"""Expert parallelism (memsim.strategies.ep): every rank against a real multi-process gloo run
of Hugging Face's own layout (``DistributedConfig(ep_size, fsdp_size)``,
``maybe_distribute_model``) whose routers are forced to the routing bound, and the errors that
come before any trace."""

import functools

import pytest
import torch

from memsim.strategies import FSDP, ExpertParallel, TensorParallel, analyze
from memsim.tracer import StrategyError

from tests.support.oracles import dist

pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")
from tests.support import hf_models as hf  # noqa: E402

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def _meta(factory, *args):
    with torch.device("meta"):
        return factory(*args)


def _rank_report(report, rank):
    return next((rc.report for rc in report.ranks if rank in rc.ranks), report)


def _equals_real_run(report, forced, b: int, s: int, world: int = 2, vocab: int = 128):
    """Every rank of a real gloo run of Hugging Face's layout (EP 2), its model ``forced()``,
    at B=b, S=s: peak, model states and activation peak as the rank's report says."""
    real = dist.measure(forced, functools.partial(dist.llama_inputs, b, s, vocab),
                        strategy=dist.HFExperts(2), world_size=world)
    for m in real:
        got = _rank_report(report, m.rank).at(B=b, S=s)["train"]
        # the oracle's `other`: the two device meshes' rank tables (world x int32 each)
        assert m.other == 2 * world * 4, m.other_detail
        assert (got["peak"], got["parameters"], got["gradients"], got["optimizer_states"],
                got["activation_peak"]) == (m.peak - m.other, m.parameters, m.gradients,
                                            m.optimizer_states, m.activation_peak), \
            (m.rank, b, s)


@pytest.mark.parametrize("bound, sizes", [("max", [(2, 8), (3, 6)]), ("balanced", [(3, 5)])])
def test_every_expert_rank_equals_a_real_gloo_run(bound, sizes):
    """EP 2 beside FSDP2 over 2 ranks. Under ``max`` every token goes to experts 0 and 1,
    both on rank 0, which receives every rank's tokens twice; rank 1 receives none (its
    experts run on an empty batch). Under ``balanced`` token t's slots go to experts 2t and
    2t + 1 (mod 4): each rank receives as many rows as it sends."""
    report = analyze(_meta(hf.qwen3_moe), LM, device="cpu", fsdp=FSDP(dp=2),
                     ep=ExpertParallel(2), data_dependent=bound, inference=False)
    assert sorted(r for rc in report.ranks for r in rc.ranks) == [0, 1]
    assert any("tokens per expert exchanged" in n for n in report.notes), report.notes
    for b, s in sizes:
        _equals_real_run(report, functools.partial(hf.qwen3_moe_forced, bound == "balanced"),
                         b, s)
    if bound == "max":   # the first expert rank receives every token: it holds the most
        at = [_rank_report(report, r).at(B=4, S=8)["train"]["peak"] for r in (0, 1)]
        assert at[0] > at[1], at


@pytest.mark.heavy
def test_a_model_not_tuned_for_equals_a_real_gloo_run():
    """Mixtral, laid out by the same library code, under ``max`` at one size."""
    report = analyze(_meta(hf.mixtral_moe), LM, device="cpu", fsdp=FSDP(dp=2),
                     ep=ExpertParallel(2), inference=False)
    _equals_real_run(report, functools.partial(hf.mixtral_moe_forced, False), 2, 8)


@pytest.mark.heavy
def test_experts_sharded_over_their_copies_equal_a_real_gloo_run():
    """EP 2 over 4 ranks: each expert group has 2 copies, the experts sharded with FSDP2 over
    them (Hugging Face's ``efsdp``); 8 experts, so each rank holds 4 and 2 of their rows."""
    report = analyze(_meta(hf.qwen3_moe, 8), LM, device="cpu", fsdp=FSDP(dp=4),
                     ep=ExpertParallel(2), inference=False)
    assert sorted(r for rc in report.ranks for r in rc.ranks) == [0, 1, 2, 3]
    _equals_real_run(report, functools.partial(hf.qwen3_moe_forced, False, 8), 2, 8, world=4)


@pytest.mark.parametrize("given, match", [
    (dict(ep=ExpertParallel(2)), "needs FSDP2 beside it"),
    (dict(ep=ExpertParallel(3), fsdp=FSDP(dp=4)), "does not divide --dp 4"),
    (dict(ep=ExpertParallel(3), fsdp=FSDP(dp=3)), "does not divide the 4 experts"),
    (dict(ep=ExpertParallel(2), fsdp=FSDP(dp=2), tp=TensorParallel(2)), "does not combine"),
    (dict(ep=ExpertParallel(2), fsdp=FSDP(dp=2, param_dtype="bf16")), "--param-dtype"),
])
def test_bad_layouts_are_refused_before_any_trace(given, match, monkeypatch):
    from memsim import analysis
    monkeypatch.setattr(analysis, "analyze", lambda *a, **k: pytest.fail("traced"))
    with pytest.raises(StrategyError, match=match):
        analyze(_meta(hf.qwen3_moe), LM, device="cpu", **given)


def test_a_model_without_an_expert_plan_is_refused():
    with pytest.raises(StrategyError, match="has no expert-parallel plan"):
        analyze(_meta(dist.llama_model), LM, device="cpu", fsdp=FSDP(dp=2),
                ep=ExpertParallel(2))
    with pytest.raises(StrategyError, match="must be an int >= 2"):
        ExpertParallel(1)


def test_the_command_line_names_the_degree(tmp_path, capsys):
    """The JSON names the degree; against a GPU the verdict is the routing's worst case, and the
    even routing's largest rank peak is said once, with the verdict (its total, whether it
    fits), equal to an analysis at --data-dependent balanced."""
    import json

    from memsim.cli import main
    from memsim.formats import human
    hf.qwen3_moe().config.save_pretrained(tmp_path)
    argv = ["analyze", f"hf:{tmp_path}", "--input", "input_ids=int64[B,S]",
            "--input", "labels=int64[B,S]", "--at", "B=2,S=8", "--device", "cpu",
            "--ep", "2", "--fsdp", "--dp", "2", "--train", "--json", "--no-cache",
            "--hf-class", "Qwen3MoeForCausalLM", "--memory", "1GiB"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["strategy"]["ep"] == {"ep": 2} and doc["strategy"]["world_size"] == 2
    even = analyze(_meta(hf.qwen3_moe), LM, device="cpu", fsdp=FSDP(dp=2),
                   ep=ExpertParallel(2), data_dependent="balanced", inference=False)
    peak = max(rc.report.at(B=2, S=8)["train"]["peak"] for rc in even.ranks)
    assert doc["train"]["peak"]["bytes"] > peak
    said = [n for n in doc["budget"]["notes"] if n.startswith("expert parallelism")]
    assert len(said) == 1 and f"peak here is {human(peak)}, total " in said[0], said
    assert said[0].endswith(": fits") and not any(
        n.startswith("expert parallelism") for n in doc.get("notes", ()))
    assert main(["analyze", f"hf:{tmp_path}", "--input", "input_ids=int64[B,S]",
                 "--at", "B=2,S=8", "--ep", "1", "--fsdp", "--dp", "2"]) == 2


@pytest.mark.wide
def test_a_realistic_width_equals_a_real_gloo_run():
    """One Qwen3-30B-A3B-shaped layer (32 of its experts, top-8) over EP 2 x FSDP2 2, at
    B=2, S=64 under ``max``: rank 0 receives 2 x 8 x 128 rows."""
    report = analyze(_meta(hf.qwen3_moe_wide), LM, device="cpu", fsdp=FSDP(dp=2),
                     ep=ExpertParallel(2), inference=False)
    _equals_real_run(report, functools.partial(hf.qwen3_moe_wide_forced, False), 2, 64,
                     vocab=256)

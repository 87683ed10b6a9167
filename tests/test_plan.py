"""``memsim plan``: every layout's figures are an analysis's on its worst rank, and equal real
multi-process gloo runs; one trace per program; the errors come before any trace."""

import functools
import json

import pytest

from memsim.cli import main
from memsim.plan import Layout, layouts, parse_fix
from memsim.tracer import UsageError
from tests.support.oracles import dist as O

LM = ["--input", "input_ids=int64[B,S]", "--input", "labels=int64[B,S]"]
# a small HF Llama (the oracle's: 2 layers, width 64), on 2 CPU ranks, global batch 4, S=16
PLAN = ["plan", "tests.support.oracles.dist:llama_model", *LM, "--device", "cpu", "--gpus", "2",
        "--gpus-per-node", "2", "--global-batch", "4", "--seq", "16", "--margin", "0",
        "--json", "--quiet"]
HERE = ["--workers", "1"]   # traced in this process (the default is a process per core)


def _plan(capsys, *extra, where=HERE) -> dict:
    main(PLAN + list(where) + list(extra))
    return json.loads(capsys.readouterr().out)


def test_layouts_reach_the_global_batch():
    got, rejected = layouts(8, 4, 16)
    assert {(x.tp, x.dp) for x in got} == {(1, 8), (2, 4), (4, 2)}   # tp within a node
    assert all(x.micro_batch * x.accumulate * x.dp == 16 for x in got)
    assert not rejected
    got, rejected = layouts(8, 8, 12)   # dp=8 does not divide 12: those degrees cannot reach it
    assert {x.dp for x in got} == {4, 2, 1} and {r.layout.dp for r in rejected} == {8}
    assert "does not divide by dp=8" in rejected[0].reason
    assert Layout(2, 4, "blocks", 1, 4).flags() == \
        "--tp 2 --fsdp --dp 4 --checkpoint blocks --accumulate 4"
    assert Layout(2, 4, "blocks", 1, 4).program_flags() == \
        "--tp 2 --fsdp --dp 4 --checkpoint blocks with accumulation"
    # micro-steps after the second repeat it: accumulation 2 and 4 are one program
    assert Layout(1, 8, "none", 1, 2).program == Layout(1, 8, "none", 2, 4).program


def test_ranking_rules():
    """Fits first; by default the least recomputation, then the smallest tp, then the fewest
    accumulation steps, then the largest headroom; the others by their total."""
    from memsim.plan import Planned, RANK_RULES, plan

    rows = [Planned(Layout(2, 1, "none", 2, 1), 9, 9, 1, 0.2, True),
            Planned(Layout(1, 2, "blocks", 1, 1), 5, 5, 1, 0.5, True),
            Planned(Layout(1, 2, "none", 1, 2), 8, 8, 1, 0.1, True),
            Planned(Layout(1, 2, "none", 2, 1), 7, 7, 1, 0.3, True),
            Planned(Layout(2, 1, "none", 4, 1), 30, 30, 1, -0.5, False, "x"),
            Planned(Layout(1, 2, "none", 4, 1), 20, 20, 1, -0.1, False, "x")]

    def ranked(rule):
        return [(r.layout.tp, r.layout.checkpoint, r.layout.micro_batch) for r in
                plan([(list(rows), 1)], [], world=2, per_node=2, global_batch=4, usable=10,
                     rank_by=rule).rows]
    assert ranked("default") == [(1, "none", 2), (1, "none", 1), (2, "none", 2),
                                 (1, "blocks", 1), (1, "none", 4), (2, "none", 4)]
    assert ranked("headroom")[:4] == [(1, "blocks", 1), (1, "none", 2), (2, "none", 2),
                                      (1, "none", 1)]
    assert ranked("throughput")[:3] == [(1, "none", 2), (2, "none", 2), (1, "none", 1)]
    assert set(RANK_RULES) == {"default", "headroom", "throughput"}


def test_errors_come_before_any_trace(capsys, monkeypatch):
    import memsim.cli as cli

    def no_trace(*a, **k):
        raise AssertionError("traced before the options were checked")
    monkeypatch.setattr(cli, "load_target", no_trace)
    for extra, says in (
            (["--gpus", "0"], "at least one GPU"),
            (["--gpus", "12", "--gpus-per-node", "8"], "not a whole number of nodes of 8"),
            (["--global-batch", "3", "--fix", "tp=1"], "reaches global batch 3"),
            (["--fsdp", "--dp", "2"], "chooses the strategies itself"),
            (["--fix", "pp=2"], "KEY one of tp, dp, ep, checkpoint, micro_batch"),
            (["--fix", "checkpoint=all"], "searches none and blocks"),
            (["--rank-by", "speed"], "is not a rule"),
            (["--gpu", "h1000"], "h1000"),
            (["--at", "B=2"], "chooses the micro-batch"),
            (["--cluster", "nowhere"], "is not host:port or local"),
            (["--cluster", "127.0.0.1:1"], "no Ray cluster answers there"),
            (["--workers", "0"], "--workers 0: at least 1"),
            (["--workers", "2", "--cluster", "local"], "both say where the traces run")):
        argv = [a for a in PLAN if a != "--json"] + extra
        if "--gpu" not in extra:
            argv += ["--memory", "1GiB"]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err
        assert says in err, (extra, err)
        assert "Traceback" not in err
    assert main([a for a in PLAN if a != "--seq" and a != "16"] + ["--memory", "1GiB"]) == 2
    assert "needs the sequence length" in capsys.readouterr().err
    assert main(PLAN) == 2   # no GPU
    assert "needs a GPU" in capsys.readouterr().err
    with pytest.raises(UsageError, match="whole number"):
        parse_fix(["tp=0"])


@pytest.mark.slow
def test_a_fixed_layout_equals_analyze(capsys):
    """``plan`` with every field pinned is ``analyze`` with that layout's options: the same
    total, peak and model states, from one trace."""
    doc = _plan(capsys, "--memory", "1GiB", "--fix", "tp=1", "--fix", "checkpoint=none",
                "--fix", "micro_batch=2")
    assert doc["plan"]["traces"] == 1 and len(doc["layouts"]) == 1
    row = doc["layouts"][0]
    assert (row["dp"], row["micro_batch"], row["accumulate"]) == (2, 2, 1)
    main(["analyze", "tests.support.oracles.dist:llama_model", *LM, "--device", "cpu",
          "--at", "B=2,S=16", "--fsdp", "--dp", "2", "--memory", "1GiB", "--margin", "0",
          "--train", "--json", "--quiet"])
    got = json.loads(capsys.readouterr().out)
    train = got["train"]
    assert row["total"] == got["verdict"]["total"]
    assert row["peak"] == train["peak"]["bytes"]
    assert row["model_states"] == sum(train[k]["bytes"] for k in (
        "parameters", "gradients", "optimizer_states"))


def _real(strategy, batch, accumulate=1):
    ranks = O.measure(O.llama_model, functools.partial(O.llama_inputs, batch=batch, seq=16),
                      strategy=strategy, accumulate=accumulate)
    # the device mesh's rank layout (world size x int32) is host memory, not the step's
    return max(r.peak - r.other for r in ranks)


@pytest.mark.slow
@pytest.mark.heavy
def test_layouts_the_plan_keeps_and_rejects_equal_real_gloo_runs(capsys):
    """Three layouts the plan marks as fitting and one it rejects, each against a real gloo run
    on 2 ranks (the largest peak of the ranks): FSDP2 at micro-batch 2, FSDP2 at micro-batch 1
    with accumulation 2, and TP 2 at micro-batch 4, against a capacity between the largest
    peak and the others."""
    real = {(1, 2, 1): _real(O.FSDP2(), 2), (1, 1, 2): _real(O.FSDP2(), 1, accumulate=2),
            (2, 4, 1): _real(O.TP(), 4)}
    largest = max(real.values())
    cap = (largest + max(v for v in real.values() if v < largest)) // 2
    doc = _plan(capsys, "--memory", f"{cap}B", "--fix", "checkpoint=none")
    rows = {(r["tp"], r["micro_batch"], r["accumulate"]): r for r in doc["layouts"]}
    for key, peak in real.items():
        assert rows[key]["peak"] == peak, (key, rows[key]["peak"], peak)
        assert rows[key]["fits"] is (peak <= cap), key
    # the largest: FSDP2's micro-batch 1 with accumulation, whose first micro-step's gradients
    # live through the second's forward; micro-batch 2 without it fits
    assert [k for k, v in real.items() if not rows[k]["fits"]] == [(1, 1, 2)]
    assert rows[(1, 1, 2)]["reason"] == ("this micro-batch and accumulation do not fit: 2 x 1 "
                                         "does, with the same degrees")
    # four programs (FSDP2 and TP, each with and without accumulation): one trace each, and
    # at most one more for micro-batch 1 (below the formulas' range) traced beside
    assert doc["plan"]["traces"] <= 2 * 4


def test_plan_text_names_the_best_layout_and_the_reasons(capsys):
    """The text: the title with the cluster and the usable memory, the layouts that fit best
    first with the rule, the command of the best, and the others grouped by reason."""
    assert main([a for a in PLAN if a not in ("--json",)] + HERE +
                ["--memory", "1GiB", "--fix", "tp=1", "--fix", "checkpoint=none"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memsim plan: tests.support.oracles.dist:llama_model on 2 GPUs (1 "
                          "node of 2), 1.00 GiB usable each (margin 0%), global batch 4 x S=16")
    assert "Layouts that fit, best first (least recomputation" in out
    assert "best: memsim analyze tests.support.oracles.dist:llama_model ... --at B=2,S=16 " \
           "--fsdp --dp 2" in out
    assert main([a for a in PLAN if a not in ("--json",)] + HERE +
                ["--memory", "100KiB", "--fix", "tp=1", "--fix", "checkpoint=none",
                 "--fix", "micro_batch=2"]) == 1
    out = capsys.readouterr().out
    assert "No layout fits." in out
    assert "the model states alone exceed the usable memory (1)" in out, out


def test_the_html_page_answers_first(capsys, tmp_path):
    """``--html``: one self-contained page, the answer first (how many fit, the best), the
    layouts' totals against the GPU as an inline SVG, the table and the reasons."""
    page = tmp_path / "plan.html"
    assert main([a for a in PLAN if a != "--json"] + HERE + ["--memory", "1GiB", "--fix", "tp=1",
                                                      "--fix", "checkpoint=none",
                                                      "--fix", "micro_batch=2",
                                                      "--html", str(page)]) == 0
    capsys.readouterr()
    got = page.read_text()
    assert got.index('class="verdict fits"') < got.index("<svg")
    assert "1 of 1 FIT" in got and "best: <code>--fsdp --dp 2</code>" in got
    assert "total per rank" in got and "usable (" in got
    from tests.test_report_html import _Tags
    tags = _Tags()
    tags.feed(got)
    assert not tags.resources and not tags.errors, (tags.resources, tags.errors)
    assert main(PLAN + ["--memory", "1GiB", "--html", "plan.txt"]) == 2
    assert "not an .html file" in capsys.readouterr().err


def test_accumulation_is_one_program_and_memory_rises_with_the_micro_batch(capsys):
    """Global batch 8 over 2 ranks: micro-batches 1 x 4, 2 x 2 and 4 x 1, two programs (one
    trace each, and micro-batch 1 traced beside). Within the accumulating program a larger
    micro-batch needs more; accumulation itself can need more than a larger micro-batch without
    (the first micro-step's gradients live through the second's forward: the heavy test above
    measures it in real runs)."""
    doc = _plan(capsys, "--memory", "1GiB", "--fix", "tp=1", "--fix", "checkpoint=none",
                "--global-batch", "8")
    rows = {(r["micro_batch"], r["accumulate"]): r["peak"] for r in doc["layouts"]}
    assert set(rows) == {(1, 4), (2, 2), (4, 1)}
    assert rows[(1, 4)] < rows[(2, 2)]
    assert doc["plan"]["traces"] == 3


@pytest.mark.slow
@pytest.mark.heavy
def test_processes_give_the_plan_this_process_gives(capsys, monkeypatch, tmp_path):
    """The default: the programs traced in a pool of this machine's processes, the same plan
    as in this process, the traces counted in the workers; a process that dies mid-task
    takes the pool with it, and its programs run again in a new pool: no layout is lost."""
    args = ("--memory", "1GiB", "--fix", "checkpoint=none")
    here = _plan(capsys, *args)
    rows = sorted(tuple(sorted(r.items())) for r in here["layouts"])
    there = _plan(capsys, *args, where=["--workers", "2"])
    assert sorted(tuple(sorted(r.items())) for r in there["layouts"]) == rows
    assert there["plan"]["traces"] == here["plan"]["traces"] > 1
    died = tmp_path / "died"
    monkeypatch.setenv("MEMSIM_PLAN_TEST_CRASH", str(died))
    again = _plan(capsys, *args, where=["--workers", "2"])
    assert died.exists()    # a worker process did die in a task
    assert sorted(tuple(sorted(r.items())) for r in again["layouts"]) == rows


@pytest.mark.heavy
def test_a_mixture_of_experts_is_planned_with_expert_parallelism(capsys):
    """A Qwen3-MoE over 2 ranks: FSDP2 alone and FSDP2 with the experts over EP 2 (its
    expert-parallel plan), each as ``analyze`` answers it; ``--fix ep`` for a model without
    experts is an error before any trace."""
    pytest.importorskip("transformers")
    moe = ["tests.support.hf_models:qwen3_moe" if a == "tests.support.oracles.dist:llama_model"
           else a for a in PLAN]
    main(moe + HERE + ["--memory", "1GiB", "--fix", "tp=1", "--fix", "checkpoint=none",
                       "--fix", "micro_batch=2"])
    doc = json.loads(capsys.readouterr().out)
    rows = {r["ep"]: r for r in doc["layouts"]}
    # one trace for FSDP2 alone, one per expert rank under EP (the first receives the most)
    assert set(rows) == {1, 2} and doc["plan"]["traces"] == 1 + 2
    assert rows[2]["options"] == "--fsdp --dp 2 --ep 2"
    main(["analyze", "tests.support.hf_models:qwen3_moe", *LM, "--device", "cpu",
          "--at", "B=2,S=16", "--fsdp", "--dp", "2", "--ep", "2", "--memory", "1GiB",
          "--margin", "0", "--train", "--json", "--quiet"])
    got = json.loads(capsys.readouterr().out)
    assert rows[2]["total"] == got["verdict"]["total"]
    assert rows[2]["peak"] == got["train"]["peak"]["bytes"]
    assert main(PLAN + HERE + ["--memory", "1GiB", "--fix", "ep=2"]) == 2
    assert "the model has no experts to shard" in capsys.readouterr().err

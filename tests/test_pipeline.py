"""Pipeline parallelism (memsim.strategies.pipeline): every pipeline rank against a real
multi-process gloo run of the same program (tests/support/oracles/dist.py's Pipeline), and the
errors that come before any trace. The cases marked ``heavy`` (more schedules, a decoder with
GPipe and a V schedule, bf16 on a decoder) run in ``.ci/run``'s heavy step."""

import functools

import pytest
import torch

from memsim.strategies import DDP, FSDP, PipelineParallel, TensorParallel, ZeRO, analyze
from memsim.tracer import StrategyError
from tests.support.oracles import dist

WIDTH = 32
INPUTS = {"input": ("float32", ["B", WIDTH])}


def _model(blocks=8):
    with torch.device("meta"):
        return dist.residual_mlp(blocks, WIDTH)


def _rank_report(report, rank):
    return next((rc.report for rc in report.ranks if rank in rc.ranks), report)


@pytest.mark.parametrize("schedule, world, micro, split, groups, sizes", [
    # fewer micro-batches than stages; the default split: 9 children over 2 stages
    pytest.param("GPipe", 2, 1, None, [[0, 1, 2, 3, 4], [5, 6, 7, 8]], (3, 10),
                 marks=pytest.mark.heavy),
    # as many, and the head's stage one child longer
    ("1F1B", 2, 2, ("4",), [[0, 1, 2, 3], [4, 5, 6, 7, 8]], (8, 24)),
    # two stages per rank, looped
    ("Interleaved1F1B", 2, 4, ("2", "4", "6"), [[0, 1], [2, 3], [4, 5], [6, 7, 8]], (16,)),
    # zero bubble, two stages per rank in a V (stages 0 and 3 on rank 0)
    ("ZBVZeroBubble", 2, 2, None, [[0, 1, 2], [3, 4], [5, 6], [7, 8]], (8,)),
    pytest.param("DualPipeV", 2, 4, None, [[0, 1, 2], [3, 4], [5, 6], [7, 8]], (8,),
                 marks=pytest.mark.heavy),
    # four ranks, micro-batches equal to twice the stages
    ("1F1B", 4, 8, ("2", "4", "6"), [[0, 1], [2, 3], [4, 5], [6, 7, 8]], (32,)),
])
def test_every_pipeline_rank_equals_a_real_gloo_run(schedule, world, micro, split, groups,
                                                     sizes):
    pp = PipelineParallel(pp=world, schedule=schedule, microbatches=micro, split=split)
    report = analyze(_model(), INPUTS, device="cpu", pp=pp)
    assert pp.groups(_model()) == groups
    assert sorted(r for rc in report.ranks for r in rc.ranks) == list(range(world))
    for b in sizes:
        real = dist.measure(functools.partial(dist.residual_mlp, 8, WIDTH),
                            functools.partial(dist.mlp_inputs, b, WIDTH),
                            strategy=dist.Pipeline(schedule, micro, groups), world_size=world)
        for rank, m in enumerate(real):
            got = _rank_report(report, rank).at(B=b)["train"]
            assert m.other == 0 and m.pipeline > 0, m.other_detail   # receive buffers
            assert (got["peak"], got["parameters"], got["gradients"], got["optimizer_states"],
                    got["activation_peak"]) == (m.peak, m.parameters, m.gradients,
                                                m.optimizer_states, m.activation_peak), (rank, b)


def test_a_rank_holds_only_its_own_stages():
    report = analyze(_model(), INPUTS, device="cpu",
                     pp=PipelineParallel(pp=2, schedule="GPipe", microbatches=2))
    block = sum(p.numel() for p in dist.ResidualBlock(WIDTH).parameters()) * 4
    head = (WIDTH * 10 + 10) * 4
    assert _rank_report(report, 0).at(B=4)["train"]["parameters"] == 5 * block
    assert _rank_report(report, 1).at(B=4)["train"]["parameters"] == 3 * block + head


@pytest.mark.parametrize("make, words", [
    (lambda: PipelineParallel(pp=2, schedule="Zigzag"), "unknown pipeline schedule"),
    (lambda: PipelineParallel(pp=2, schedule="Interleaved1F1B", microbatches=5),
     "5 over --pp 2 does not split into 2 rounds"),
    (lambda: PipelineParallel(pp=2, schedule="DualPipeV", microbatches=3), "at least 4"),
    (lambda: PipelineParallel(pp=0), "pp=0"),
    (lambda: PipelineParallel(pp=4, schedule="1F1B", microbatches=2), "at least 4"),
])
def test_bad_pipeline_settings_are_named(make, words):
    with pytest.raises(StrategyError, match=words):
        make()


@pytest.mark.parametrize("model, inputs, options, words", [
    (lambda: torch.nn.Linear(4, 4), {"input": ("float32", ["B", 4])}, {},
     "Linear is neither"),
    (lambda: _model(2), INPUTS, dict(schedule="Interleaved1F1B"), "needs 4 stages"),
    (_model, INPUTS, dict(split=("4", "zz")), "zz, not one of the model's children"),
    (_model, {"input": ("float32", [6, WIDTH])}, dict(microbatches=4),
     "batch of input 'input' \\(6\\) does not split"),
])
def test_a_model_or_batch_the_pipeline_cannot_split_is_named(model, inputs, options, words):
    with torch.device("meta"):
        m = model()
    with pytest.raises(StrategyError, match=words):
        analyze(m, inputs, device="cpu", pp=PipelineParallel(pp=2, **options))


@pytest.mark.parametrize("options, words", [
    (dict(zero=ZeRO(stage=2, dp=2)), "does not combine with zero"),
    (dict(ddp=DDP(dp=2)), "does not combine with ddp"),
    (dict(fsdp=FSDP(dp=2, units=("0", "1"))), "FSDP units named by path are not taken"),
    (dict(tp=TensorParallel(2, {"*.fc1": "colwise"}, sequence_parallel=True)),
     "sequence parallelism \\(--sp\\) is not modelled with pipeline"),
])
def test_what_pipeline_parallelism_does_not_combine_with_is_named(options, words):
    with pytest.raises(StrategyError, match=words):
        analyze(_model(), INPUTS, device="cpu", pp=PipelineParallel(pp=2), **options)


@pytest.mark.parametrize("schedule, width, model", [
    # 33 rows over 2 ranks: uneven shards, each data-parallel rank traced
    ("1F1B", 33, "mlp"),
    # even shards: the data-parallel ranks of a pipeline rank alike; two stages per rank
    pytest.param("ZBVZeroBubble", 32, "mlp", marks=pytest.mark.heavy),
    pytest.param("1F1B", None, "llama", marks=pytest.mark.heavy),
])
def test_pipeline_with_fsdp2_equals_real_gloo_runs(schedule, width, model):
    """Pipeline 2 x FSDP2 2 over 4 gloo ranks (a (pp, dp) mesh, each stage's pieces and the
    stage fully_shard-ed over the rank's data-parallel group, as torchtitan builds them):
    every rank's figures equal."""
    pp = PipelineParallel(pp=2, schedule=schedule, microbatches=2)
    if model == "mlp":
        make = functools.partial(dist.residual_mlp, 8, width)
        inputs, at = {"input": ("float32", ["B", width])}, dict(B=8)
        data = functools.partial(dist.mlp_inputs, 8, width)
    else:
        make = functools.partial(dist.llama_model, layers=4)
        inputs, at = LM, dict(B=4, S=16)
        data = functools.partial(dist.llama_inputs, 4, 16)
    with torch.device("meta"):
        report = analyze(make(), inputs, device="cpu", pp=pp, fsdp=FSDP(dp=2))
        groups = pp.groups(make())
    classes = [rc.ranks for rc in report.ranks]
    assert classes == ([(0,), (1,), (2,), (3,)] if width == 33 else [(0, 1), (2, 3)])
    real = dist.measure(make, data, strategy=dist.Pipeline(schedule, 2, groups, dp=2,
                                                            fsdp=dist.FSDP2()), world_size=4)
    for rank, m in enumerate(real):
        got = _rank_report(report, rank).at(**at)["train"]
        assert m.other == 0, m.other_detail
        assert (got["peak"], got["parameters"], got["gradients"], got["optimizer_states"],
                got["activation_peak"]) == (m.peak, m.parameters, m.gradients,
                                            m.optimizer_states, m.activation_peak), rank


def test_checkpointed_blocks_in_pipeline_stages_equal_a_real_run():
    blocks = ["1", "5"]    # one block in each rank's stage
    pp = PipelineParallel(pp=2, schedule="1F1B", microbatches=2)
    report = analyze(_model(), INPUTS, device="cpu", pp=pp, checkpoint=blocks)
    plain = analyze(_model(), INPUTS, device="cpu", pp=pp)
    real = dist.measure(functools.partial(dist.with_checkpointing,
                                          functools.partial(dist.residual_mlp, 8, WIDTH), blocks),
                        functools.partial(dist.mlp_inputs, 8, WIDTH),
                        strategy=dist.Pipeline("1F1B", 2, pp.groups(_model())), world_size=2)
    for rank, m in enumerate(real):
        got = _rank_report(report, rank).at(B=8)["train"]
        assert (got["peak"], got["activation_peak"]) == (m.peak, m.activation_peak)
    assert _rank_report(report, 0).at(B=8)["train"]["activation_peak"] < \
        _rank_report(plain, 0).at(B=8)["train"]["activation_peak"]


LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def _llama(layers=4):
    with torch.device("meta"):
        return dist.llama_model(attn="sdpa", layers=layers)


@pytest.mark.parametrize("schedule, micro, split, points", [
    # its layers split evenly, the embeddings on the first rank, norm, head and loss on the last
    ("1F1B", 2, None, ({"B": 4, "S": 16}, {"B": 6, "S": 8})),
    pytest.param("GPipe", 4, ("model.layers.3",), ({"B": 8, "S": 12},),
                 marks=pytest.mark.heavy),
    # rank 0 holds the first stage (embeddings) and the last (head and loss) in a V
    pytest.param("ZBVZeroBubble", 2, None, ({"B": 4, "S": 16},), marks=pytest.mark.heavy),
])
def test_a_hugging_face_decoder_by_its_layers_equals_a_real_gloo_run(schedule, micro, split,
                                                                      points):
    pp = PipelineParallel(pp=2, schedule=schedule, microbatches=micro, split=split)
    report = analyze(_llama(), LM, device="cpu", pp=pp)
    assert "layers of LlamaForCausalLM" in " ".join(report.notes)
    for pt in points:
        real = dist.measure(functools.partial(dist.llama_model, "sdpa", 4),
                            functools.partial(dist.llama_inputs, pt["B"], pt["S"]),
                            strategy=dist.Pipeline(schedule, micro, pp.groups(_llama())),
                            world_size=2)
        for rank, m in enumerate(real):
            got = _rank_report(report, rank).at(**pt)["train"]
            assert (got["peak"], got["parameters"], got["gradients"], got["optimizer_states"],
                    got["activation_peak"]) == (m.peak, m.parameters, m.gradients,
                                                m.optimizer_states, m.activation_peak), (rank, pt)


def test_a_decoder_input_the_pipeline_does_not_pass_is_named():
    with pytest.raises(StrategyError, match="not attention_mask"):
        analyze(_llama(), {**LM, "attention_mask": ("int64", ["B", "S"])}, device="cpu",
                pp=PipelineParallel(pp=2))
    with pytest.raises(StrategyError, match="model.layers.9, not one of the model's layers"):
        analyze(_llama(), LM, device="cpu",
                pp=PipelineParallel(pp=2, split=("model.layers.9",)))


@pytest.mark.parametrize("model, inputs, real_model, real_inputs, point", [
    (_model, INPUTS, functools.partial(dist.residual_mlp, 8, WIDTH),
     functools.partial(dist.mlp_inputs, 8, WIDTH), {"B": 8}),
    pytest.param(_llama, LM, functools.partial(dist.llama_model, "sdpa", 4),
                 functools.partial(dist.llama_inputs, 4, 16), {"B": 4, "S": 16},
                 marks=pytest.mark.heavy),
])
def test_bf16_autocast_around_the_schedule_equals_a_real_run(model, inputs, real_model,
                                                             real_inputs, point):
    pp = PipelineParallel(pp=2, schedule="1F1B", microbatches=2)
    report = analyze(model(), inputs, device="cpu", pp=pp, precision="bf16-mixed")
    real = dist.measure(real_model, real_inputs, world_size=2, autocast=torch.bfloat16,
                        strategy=dist.Pipeline("1F1B", 2, pp.groups(model())))
    for rank, m in enumerate(real):
        got = _rank_report(report, rank).at(**point)["train"]
        assert (got["peak"], got["activation_peak"]) == (m.peak, m.activation_peak), rank


def test_a_precision_the_pipeline_does_not_model_is_named():
    with pytest.raises(StrategyError, match="'16-mixed' is not modelled with pipeline"):
        analyze(_model(), INPUTS, device="cpu", pp=PipelineParallel(pp=2),
                precision="16-mixed")


def test_the_verdict_is_about_the_rank_whose_peak_is_largest_at_the_point(capsys):
    """Rank 1 (the large parameters) has the largest peak at the example sizes, rank 0 (the
    wide activations) at B = 1000: the verdict and the figures shown are rank 0's, and the
    largest batch that fits is the least over both ranks."""
    from memsim.cli import main

    args = ["analyze", "tests.support.zoo:pipeline_two_ways", "--input", "input=float32[B,4]",
            "--device", "cpu", "--pp", "2", "--pp-schedule", "GPipe", "--microbatches", "2",
            "--pp-split", "3", "--json"]
    with torch.device("meta"):
        from tests.support import zoo
        report = analyze(zoo.pipeline_two_ways(), {"input": ("float32", ["B", 4])},
                         device="cpu", pp=PipelineParallel(pp=2, schedule="GPipe",
                                                           microbatches=2, split=("3",)))
    peaks = {r: _rank_report(report, r).at(B=1000)["train"]["peak"] for r in (0, 1)}
    assert report.rank == 1 and peaks[0] > peaks[1]
    cap = peaks[0] + 10_000
    assert main(args + ["--at", "B=1000", "--memory", f"{cap}B", "--margin", "0"]) == 0
    import json
    doc = json.loads(capsys.readouterr().out)
    assert doc["train"]["peak"]["bytes"] == peaks[0]
    assert any("rank 0's peak is the largest" in n for n in doc["notes"])
    assert doc["verdict"]["fits"] is True, doc["verdict"]
    # a card rank 0's peak just exceeds: rank 1's would fit, the step does not
    assert main(args + ["--at", "B=1000", "--memory", f"{peaks[0] - 1}B", "--margin",
                        "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"]["fits"] is False, doc["verdict"]
    # at B = 4 rank 1 is the largest, and rank 0 grows faster: the largest batch is rank 0's
    cap = _rank_report(report, 1).at(B=4)["train"]["peak"] + 5_000_000
    assert main(args + ["--at", "B=4", "--memory", f"{cap}B", "--margin", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not any("rank 0's peak is the largest" in n for n in doc["notes"])
    fits = [b for b in range(4, 4000, 2) if all(
        _rank_report(report, r).at(B=b)["train"]["peak"] <= cap for r in (0, 1))]
    alone = [b for b in range(4, 4000, 2) if _rank_report(report, 1).at(B=b)["train"]["peak"]
             <= cap]
    assert doc["verdict"]["largest_batch"] == max(fits) < max(alone), doc["verdict"]


def test_progress_names_the_rank_traced(capsys, monkeypatch):
    import memsim.cli as cli
    from memsim.cli import main
    monkeypatch.setattr(cli, "_PROGRESS_AFTER", 0.0)
    monkeypatch.setattr(cli, "_PROGRESS_EVERY", 0.0)
    assert main(["analyze", "tests.support.zoo:pipeline_two_ways", "--input",
                 "input=float32[B,4]", "--device", "cpu", "--pp", "2", "--pp-schedule", "GPipe",
                 "--microbatches", "2", "--pp-split", "3", "--train"]) == 0
    raw = capsys.readouterr().err.splitlines()
    err = [line.split(" [trace ")[0] for line in raw]
    assert "memsim: rank 0 of 2: tracing zero_grad" in err, err
    assert "memsim: rank 1 of 2: tracing optimizer" in err, err
    # the ranks' traces are counted from the first: two ranks, the training step each
    assert any(ln.startswith("memsim: rank 0 of 2: tracing zero_grad [trace 1 of 2,")
               for ln in raw), raw


def test_what_a_micro_batch_keeps_for_its_backward_is_an_activation():
    """The schedule runs forward and backward inside one phase: what autograd saves there is
    labelled an activation (the breakdown at the peak), and a note says why "saved for
    backward" reads 0."""
    from tests.support import zoo
    with torch.device("meta"):
        model = zoo.pipeline_two_ways()
    report = analyze(model, {"input": ("float32", ["B", 4])}, device="cpu",
                     pp=PipelineParallel(pp=2, schedule="GPipe", microbatches=2, split=("3",)))
    rank0 = _rank_report(report, 0)
    sub, at = rank0.for_point({"B": 1000})
    live = sub.train.breakdown(at)
    assert live["activation"] > live["temporary"] > 0, live
    assert any("has no such moment here and reads 0" in n for n in report.notes)


@pytest.mark.heavy
@pytest.mark.parametrize("dp", [
    1,
    2,  # 8 gloo ranks: pipeline 2 x FSDP2 2 x TP 2
])
def test_pipeline_with_tensor_parallelism_equals_real_gloo_runs(dp):
    """A Hugging Face Llama over pipeline 2 x TP 2 (x FSDP2): each rank's layers sharded with
    parallelize_module over its tensor-parallel group (the model's own plan), then FSDP2 over
    its data-parallel group: every rank's figures equal a real gloo run's (B = 6: micro-batches
    of 3, the code path of odd micro-batches the example size traced)."""
    pp = PipelineParallel(pp=2, schedule="1F1B", microbatches=2)
    make = functools.partial(dist.llama_model, layers=4)
    fsdp = FSDP(dp=2) if dp > 1 else None
    with torch.device("meta"):
        report = analyze(make(), LM, device="cpu", pp=pp, tp=TensorParallel(2), fsdp=fsdp)
        groups = pp.groups(make())
    world = 4 * dp
    assert sorted(r for rc in report.ranks for r in rc.ranks) == list(range(world))
    real = dist.measure(make, functools.partial(dist.llama_inputs, 6, 16),
                        strategy=dist.Pipeline("1F1B", 2, groups, dp=dp, tp=2,
                                               fsdp=dist.FSDP2() if dp > 1 else None),
                        world_size=world)
    for rank, m in enumerate(real):
        got = _rank_report(report, rank).at(B=6, S=16)["train"]
        assert m.other == 0, m.other_detail
        assert (got["peak"], got["parameters"], got["gradients"], got["optimizer_states"],
                got["activation_peak"]) == (m.peak, m.parameters, m.gradients,
                                            m.optimizer_states, m.activation_peak), rank

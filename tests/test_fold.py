"""Folding a stack of repeated blocks (memsim.tracer.fold): the run derived from two short runs
equals, field by field, the run of the whole model traced block by block, on models nobody in
this project wrote, under each strategy; where the runs do not repeat, the model is traced
whole and says why."""

import pytest
import torch
import transformers

from memsim.strategies import DDP, FSDP, LoRA, TensorParallel
from memsim.strategies.compose import analyze
from memsim.tracer import fold, fold_stack, trace
from memsim.tracer.hf import adapt

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)


@pytest.fixture(autouse=True)
def _fold_small_stacks(monkeypatch):
    """Tiny stacks fold too (the default threshold is for speed, not correctness)."""
    monkeypatch.setattr(fold_stack, "MIN_UNITS", 6)


def _model(cls, cfg):
    with torch.device("meta"):
        return cls(cfg)


FAMILIES = {
    "gpt2": lambda: _model(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_layer=7, n_embd=32, n_head=4, vocab_size=64, n_positions=128)),
    "llama": lambda: _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=7, **SMALL)),
    # a sliding window shorter than the example sequence
    "mistral-window": lambda: _model(transformers.MistralForCausalLM, transformers.MistralConfig(
        num_hidden_layers=7, sliding_window=4, **SMALL)),
    # full attention in the first layers, then a sliding window: a prefix of distinct blocks
    "qwen2-window": lambda: _model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        num_hidden_layers=8, use_sliding_window=True, sliding_window=4, max_window_layers=2,
        **SMALL)),
    # sliding and full attention alternating: units of two blocks
    "gemma2-alternating": lambda: _model(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        num_hidden_layers=12, sliding_window=4, head_dim=8, **SMALL)),
    "mixtral-moe": lambda: _model(transformers.MixtralForCausalLM, transformers.MixtralConfig(
        num_hidden_layers=7, num_local_experts=4, num_experts_per_tok=2, **SMALL)),
}


def _both(model, inputs=LM, train=True, **kw):
    patches, limits = adapt(model, inputs)
    folded = trace(model, inputs, patches=patches, limits=limits, train=train, **kw)
    whole = trace(model, inputs, patches=patches, limits=limits, train=train, fold=False, **kw)
    return folded, whole


# every family's training step (its forward included); inference, the forward alone under
# no_grad, on two (the suite's 10-minute budget)
CASES = [(f, True) for f in sorted(FAMILIES)] + [("gpt2", False), ("llama", False)]
# the cases over half a minute on 2 cores: CI's heavy step
HEAVY = {("gemma2-alternating", True), ("qwen2-window", True), ("mixtral-moe", True),
         ("llama", True)}


@pytest.mark.parametrize("family,train", [
    pytest.param(f, t, marks=pytest.mark.heavy) if (f, t) in HEAVY else (f, t)
    for f, t in CASES], ids=[f"{'train' if t else 'inference'}-{f}" for f, t in CASES])
def test_folded_run_equals_the_whole_run(family, train):
    folded, whole = _both(FAMILIES[family](), train=train, device="cuda")
    assert folded.folded is not None and folded.folded.reason is None, folded.folded.describe()
    assert fold.difference(folded.run, whole.run) is None
    assert (folded.ranges, folded.guards) == (whole.ranges, whole.guards)


def test_folded_under_autocast():
    """bf16-mixed: autocast frees its cached weight casts in its hash table's order when it
    exits; recorded in the order they were made, the run folds (ViT's Linear layers have
    biases, each cast cached)."""
    m = _model(transformers.ViTForImageClassification, transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=7, num_attention_heads=4, intermediate_size=64,
        image_size=32, patch_size=16))
    folded, whole = _both(m, {"pixel_values": ("float32", ["B", 3, 32, 32])}, device="cuda",
                          precision="bf16-mixed")
    assert folded.folded.reason is None, folded.folded.describe()
    assert fold.difference(folded.run, whole.run) is None


def test_pattern_of_the_stack():
    """Blocks, a unit of two alternating blocks, a prefix of distinct ones."""
    assert fold_stack.find_stack(FAMILIES["llama"]()) == fold_stack.Stack("model.layers", 7, 0, 1)
    assert fold_stack.find_stack(FAMILIES["gemma2-alternating"]()) == \
        fold_stack.Stack("model.layers", 12, 0, 2)
    assert fold_stack.find_stack(FAMILIES["qwen2-window"]()) == \
        fold_stack.Stack("model.layers", 8, 2, 1)
    # too few blocks to gain anything
    short = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=5, **SMALL))
    assert fold_stack.find_stack(short) is None


def test_blocks_that_share_weights_are_not_folded():
    block = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(*[block] * 7)
    assert fold_stack.find_stack(model) is None


def test_a_checkpoint_plan_on_some_blocks_is_seen():
    """A plan on every other block makes units of two; on the first blocks only, a prefix of
    distinct blocks at least (a plan on the traced blocks only must not be copied to the
    others)."""
    from memsim.strategies.checkpoint import checkpointed

    m = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=12, **SMALL))
    with checkpointed(m, [f"model.layers.{i}" for i in range(0, 12, 2)]):
        assert fold_stack.find_stack(m) == fold_stack.Stack("model.layers", 12, 0, 2)
    with checkpointed(m, ["model.layers.0", "model.layers.1"]):
        stack = fold_stack.find_stack(m)
        assert stack is None or stack.prefix >= 2


@pytest.mark.parametrize("strategy", [
    "fsdp", "ddp-bf16-mixed", *(pytest.param(s, marks=pytest.mark.heavy)
                                for s in ("fsdp-tp", "tp", "lora-checkpoint"))])
def test_folded_under_strategies(strategy):
    # (pairs in one case each: the suite's 10-minute budget)
    kw = {"fsdp": dict(fsdp=FSDP(2)), "fsdp-tp": dict(fsdp=FSDP(2), tp=TensorParallel(2)),
          # TP alone on the CPU: on CUDA the foreach AdamW gets lists mixing sharded
          # parameters (DTensors) with plain ones, which DTensor's own dispatch refuses
          "tp": dict(tp=TensorParallel(2), device="cpu"),
          "ddp-bf16-mixed": dict(ddp=DDP(2), precision="bf16-mixed"),
          "lora-checkpoint": dict(lora=LoRA(r=4), checkpoint="blocks")}[strategy]
    kw.setdefault("device", "cuda")
    runs = []
    for f in (True, False):
        rep = analyze(FAMILIES["llama"](), LM, inference=False, explore=False, fold=f, **kw)
        runs.append(rep.train.trace)
    folded, whole = runs
    assert folded.folded is not None
    assert fold.difference(folded.run, whole.run) is None, folded.folded.describe()
    assert folded.folded.reason is None, folded.folded.describe()


def test_a_library_loop_is_not_folded():
    """DeepSpeed's engine fills its buckets across blocks: the pattern of a few blocks need
    not hold further on, so its step is traced whole."""
    pytest.importorskip("deepspeed")
    from memsim.strategies import ZeRO

    with torch.device("meta"):
        stack = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(7)])
    assert fold_stack.find_stack(stack) is not None
    rep = analyze(stack, {"input": ("float32", ["B", 16])}, device="cpu", inference=False,
                  explore=False, zero=ZeRO(3, dp=2))
    assert rep.train.trace.folded is None


@pytest.mark.heavy
def test_the_peak_by_depth_is_exact_at_other_depths(device="cuda"):
    """The formula in the depth L derived from the 7-block folded trace equals the peak of
    models of 5 and 9 blocks traced block by block (CUDA: the allocator's rounding too)."""
    import sympy

    from memsim.analysis.memory import depth_peak, step_memory

    def llama(n):
        return _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(
            num_hidden_layers=n, **SMALL))

    m = llama(7)
    patches, limits = adapt(m, LM)
    folded = trace(m, LM, patches=patches, limits=limits, device=device)
    assert folded.folded.reason is None
    depth = depth_peak(step_memory(folded))
    assert depth is not None and str(depth.symbol) == "L" and depth.low == 5
    B, S = folded.symbols["B"], folded.symbols["S"]
    for n in (5, 9):
        m = llama(n)
        patches, limits = adapt(m, LM)
        whole = step_memory(trace(m, LM, patches=patches, limits=limits, device=device,
                                  fold=False))
        # at B=8, S=16 the peak is in forward, with the previous step's output alive (its
        # KV cache grows with the depth: tracer/previous.py)
        for b, s in ((2, 3), (7, 128), (8, 16)):
            assert int(depth.peak.xreplace({B: b, S: s, depth.symbol: n})) == \
                whole.value("peak", {"B": b, "S": s})
    assert sympy.Symbol("L", integer=True, positive=True) in depth.peak.free_symbols


def test_the_command_line_says_how_it_traced(tmp_path, capsys):
    """--json: the note, and the peak by depth; --no-fold: every block traced, no depth."""
    import json

    from memsim.cli import main

    (tmp_path / "m.py").write_text(
        "import transformers\n"
        "def model():\n"
        "    return transformers.LlamaForCausalLM(transformers.LlamaConfig(\n"
        f"        num_hidden_layers=7, **{SMALL!r}))\n")
    args = ["analyze", f"{tmp_path / 'm.py'}:model", "--input", "input_ids=int64[B,S]",
            "--input", "labels=int64[B,S]", "--device", "cpu", "--at", "B=2,S=8", "--train",
            "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert any("derived from the first and proven equal" in n for n in doc["notes"])
    depth = doc["train"]["by_depth"]
    assert (depth["symbol"], depth["stack"], depth["blocks"], depth["min"]) == \
        ("L", "model.layers", 7, 5)
    assert main(args + ["--no-fold"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "by_depth" not in plain["train"]
    assert plain["train"]["peak"] == doc["train"]["peak"]


@pytest.mark.heavy
def test_run_b_traced_in_a_child_process_equals_run_b_traced_here(monkeypatch):
    """Run B (one unit more) is traced in a forked child beside run A where the platform allows
    (``memsim.tracer.trace._fork_traced``, :mod:`memsim.tracer.fork`); the folded trace is the same either way, and a child
    that fails gives no trace, so that the run is traced here."""
    import importlib
    import os
    import sys
    T = importlib.import_module("memsim.tracer.trace")
    fork = importlib.import_module("memsim.tracer.fork")
    if not sys.platform.startswith("linux"):
        pytest.skip("run B is forked on Linux only")
    model, inputs = FAMILIES["llama"](), LM
    patches, limits = adapt(model, inputs)
    forks = []
    real = T._fork_traced
    monkeypatch.setattr(fork, "parallel", lambda: True)  # the suite turns it off (conftest)
    monkeypatch.setattr(T, "_fork_traced", lambda *a, **k: forks.append(1) or real(*a, **k))
    child = trace(model, inputs, patches=patches, limits=limits, device="cuda")
    assert forks and child.folded.reason is None
    monkeypatch.setattr(fork, "parallel", lambda: False)
    here = trace(model, inputs, patches=patches, limits=limits, device="cuda")
    assert fold.difference(child.run, here.run) is None
    assert fold.difference(child.folded.pair, here.folded.pair) is None
    # a child that fails (it exits 1 with nothing sent): no trace from it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os._exit(1)
    os.close(w)
    assert fork.joined((pid, r)) is None
    # a child no longer wanted (run A failed) is stopped and reaped, not left blocked on its
    # pipe for the rest of the process
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        import time
        time.sleep(60)
        os._exit(0)
    os.close(w)
    fork.abandon((pid, r))
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@pytest.mark.heavy
def test_a_point_below_the_range_is_traced_beside_the_analysis(monkeypatch):
    """``points=`` (the CLI passes its ``--at``): a size of 1 among them, which
    ``for_point`` would trace after the analysis, is traced in a forked child beside it
    (``Retracer.beside``). The child's report, under a strategy too, equals the one traced
    afterwards; it can trace again itself; a child that fails leaves the point to be traced
    here; a child nobody asks is stopped when its analysis is dropped."""
    import gc
    import importlib
    import os
    import sys

    from memsim.analysis import explore as E
    fork = importlib.import_module("memsim.tracer.fork")
    if not sys.platform.startswith("linux"):
        pytest.skip("forked on Linux only")
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=2, **SMALL))
    at = {"B": 1, "S": 8}

    def report(parallel: bool, **kw):
        monkeypatch.setattr(fork, "parallel", lambda: parallel)  # off in the suite (conftest)
        return analyze(model, LM, device="cpu", inference=False, explore=False,
                       points=[at], **kw)

    for kw in ({}, {"fsdp": FSDP(2)}):
        rep = report(True, **kw)
        assert [type(v) for v in rep.retracer.cache.values()] == [E._Beside]
        sub, pt = rep.for_point(at)
        here, pt2 = report(False, **kw).for_point(at)
        assert sub.fixed == here.fixed == {"B": 1} and type(sub) is type(here) and pt == pt2
        assert sub.at(**pt) == here.at(**pt) and sub.notes == here.notes
        if not kw:
            want = here.at(**pt)
    # the child's report traces again with its own retracer (S = 1: below its range)
    (a, pa), (b, pb) = sub.for_point({"S": 1}), here.for_point({"S": 1})
    assert a.fixed == b.fixed == {"B": 1, "S": 1} and a.at(**pa) == b.at(**pb)
    # a child that fails sends nothing: the point is traced here
    monkeypatch.setattr(E, "_portable", lambda report: 1 / 0)
    got, pt = report(True).for_point(at)
    assert got.at(**pt) == want
    # a child nobody asks for is stopped and reaped with its analysis
    rep = report(True)
    (pid, _), = [v._child for v in rep.retracer.cache.values()]
    del rep
    gc.collect()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)

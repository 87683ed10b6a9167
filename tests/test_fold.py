"""Folding a stack of repeated blocks (memsim.tracer.fold): the run derived from two short runs
equals, field by field, the run of the whole model traced block by block, on models nobody in
this project wrote, under each strategy; where the runs do not repeat, the model is traced
whole and says why."""

import pytest
import torch
import transformers

from memsim.strategies import DDP, FSDP, LoRA, TensorParallel
from memsim.strategies.api import analyze
from memsim.tracer import fold, trace
from memsim.tracer.hf import adapt

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)


@pytest.fixture(autouse=True)
def _fold_small_stacks(monkeypatch):
    """Tiny stacks fold too (the default threshold is for speed, not correctness)."""
    monkeypatch.setattr(fold, "MIN_UNITS", 7)


def _model(cls, cfg):
    with torch.device("meta"):
        return cls(cfg)


FAMILIES = {
    "gpt2": lambda: _model(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_layer=8, n_embd=32, n_head=4, vocab_size=64, n_positions=128)),
    "llama": lambda: _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=8, **SMALL)),
    # a sliding window shorter than the example sequence
    "mistral-window": lambda: _model(transformers.MistralForCausalLM, transformers.MistralConfig(
        num_hidden_layers=8, sliding_window=4, **SMALL)),
    # full attention in the first layers, then a sliding window: a prefix of distinct blocks
    "qwen2-window": lambda: _model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        num_hidden_layers=9, use_sliding_window=True, sliding_window=4, max_window_layers=2,
        **SMALL)),
    # sliding and full attention alternating: units of two blocks
    "gemma2-alternating": lambda: _model(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        num_hidden_layers=14, sliding_window=4, head_dim=8, **SMALL)),
    "mixtral-moe": lambda: _model(transformers.MixtralForCausalLM, transformers.MixtralConfig(
        num_hidden_layers=8, num_local_experts=4, num_experts_per_tok=2, **SMALL)),
}


def _both(model, inputs=LM, train=True, **kw):
    patches, limits = adapt(model, inputs)
    folded = trace(model, inputs, patches=patches, limits=limits, train=train, **kw)
    whole = trace(model, inputs, patches=patches, limits=limits, train=train, fold=False, **kw)
    return folded, whole


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("train", [True, False], ids=["train", "inference"])
def test_folded_run_equals_the_whole_run(family, train):
    folded, whole = _both(FAMILIES[family](), train=train, device="cuda")
    assert folded.folded is not None and folded.folded.reason is None, folded.folded.describe()
    assert fold.difference(folded.run, whole.run) is None
    assert (folded.ranges, folded.guards) == (whole.ranges, whole.guards)


def test_pattern_of_the_stack():
    """Blocks, a unit of two alternating blocks, a prefix of distinct ones."""
    assert fold.find_stack(FAMILIES["llama"]()) == fold.Stack("model.layers", 8, 0, 1)
    assert fold.find_stack(FAMILIES["gemma2-alternating"]()) == \
        fold.Stack("model.layers", 14, 0, 2)
    assert fold.find_stack(FAMILIES["qwen2-window"]()) == fold.Stack("model.layers", 9, 2, 1)
    # too few blocks to gain anything
    short = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=6, **SMALL))
    assert fold.find_stack(short) is None


def test_blocks_that_share_weights_are_not_folded():
    block = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(*[block] * 8)
    assert fold.find_stack(model) is None


def test_a_checkpoint_plan_on_some_blocks_is_seen():
    """A plan on every other block is a unit of two; on the first blocks only, no pattern:
    either way the run is the whole model's (a plan on the traced blocks only must not be
    copied to the others)."""
    from memsim.strategies.checkpoint import checkpointed

    m = FAMILIES["llama"]()
    with checkpointed(m, [f"model.layers.{i}" for i in range(0, 8, 2)]):
        assert fold.find_stack(m) == fold.Stack("model.layers", 8, 0, 2) or \
            fold.find_stack(m) is None
        folded, whole = _both(m, device="cuda")
        assert fold.difference(folded.run, whole.run) is None
    with checkpointed(m, ["model.layers.0", "model.layers.1"]):
        stack = fold.find_stack(m)
        assert stack is None or stack.prefix >= 2


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp-tp", "ddp", "lora", "checkpoint",
                                      "bf16-mixed"])
def test_folded_under_strategies(strategy):
    kw = {"fsdp": dict(fsdp=FSDP(2)), "fsdp-tp": dict(fsdp=FSDP(2), tp=TensorParallel(2)),
          "ddp": dict(ddp=DDP(2)), "lora": dict(lora=LoRA(r=4)),
          "checkpoint": dict(checkpoint="blocks"),
          "bf16-mixed": dict(precision="bf16-mixed")}[strategy]
    runs = []
    for f in (True, False):
        rep = analyze(FAMILIES["llama"](), LM, device="cuda", inference=False, explore=False,
                      fold=f, **kw)
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

    rep = analyze(FAMILIES["llama"](), LM, device="cpu", inference=False, explore=False,
                  zero=ZeRO(3, dp=2))
    assert rep.train.trace.folded is None


def test_the_report_figures_are_the_whole_models():
    from memsim.analysis import analyze as plain

    m = FAMILIES["gpt2"]()
    a = plain(m, LM, device="cuda")
    b = plain(m, LM, device="cuda", fold=False)
    assert a.train.peak == b.train.peak and a.inference.peak == b.inference.peak
    assert a.train.breakdown({"B": 3, "S": 50}) == b.train.breakdown({"B": 3, "S": 50})

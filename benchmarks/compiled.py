"""Benchmark: ``--compiled`` predictions against real CPU ``torch.compile`` (Inductor) steps.

For each zoo model and two Hugging Face models built from small configs, at two points each,
prints memsim's compiled prediction (traced with the point as example sizes, as torch.compile
compiles for the shape it is called with) next to a real ``torch.compile(model, fullgraph=True,
dynamic=False)`` AdamW step on CPU (``analysis.measure.measure_compiled_train``): bytes saved
for backward and the peak, with the gap. Run on demand (Inductor compiles C++ kernels; about
5 minutes on 2 cores with a cold cache)::

    python -m benchmarks.compiled [names...]     # mlp cnn block_softmax block_sdpa ...
    python -m benchmarks.compiled --plan blocks tiny_gpt gpt2 llama   # with checkpointing

``--plan NAME`` (a named plan of ``strategies.checkpoint``) checkpoints those modules in both
the prediction and the real run (``torch.compile`` turns each region into recomputation).

HF models: ``model.loss_type`` is set, because transformers' fallback path logs a warning that
``torch.compile(fullgraph=True)`` refuses (a graph break on ``logger.warning_once``).
"""

import sys
import time

import torch

from memsim.analysis import analyze
from memsim.strategies.checkpoint import apply_checkpointing, checkpointed, named_plan

from tests.support import zoo
from tests.support.oracles.measure import example_inputs, materialize, measure_compiled_train


def _lm(m):
    m.loss_type = "ForCausalLM"
    return m


def gpt2():
    import transformers as T
    return _lm(T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                              n_positions=64, bos_token_id=0, eos_token_id=0)))


def llama():
    import transformers as T
    return _lm(T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)))


LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"]), "use_cache": False}
SEQ = {"x": ("float32", ["B", "S", 32])}
TWO = [dict(B=2, S=16), dict(B=4, S=64)]
CASES = {
    "mlp": (zoo.MLP, {"x": ("float32", ["B", 16])}, [dict(B=8), dict(B=256)]),
    "cnn": (zoo.CNN, {"x": ("float32", ["B", 3, 16, 16])}, [dict(B=4), dict(B=16)]),
    "block_softmax": (zoo.Block, SEQ, TWO),
    "block_sdpa": (lambda: zoo.Block(sdpa=True), SEQ, TWO),
    "block_dropout": (lambda: zoo.Block(dropout=0.1), SEQ, TWO),
    "tiny_gpt": (zoo.TinyGPT, {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])},
                 [dict(B=2, S=16), dict(B=4, S=32)]),
    "gpt2": (gpt2, LM, [dict(B=2, S=16), dict(B=4, S=32)]),
    "llama": (llama, LM, [dict(B=2, S=16), dict(B=4, S=32)]),
}


def main(names, plan_name="none"):
    torch.set_num_threads(1)
    print("| model | point | saved: memsim | saved: compiled run | peak: memsim | "
          "peak: compiled run | peak gap |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        factory, inputs, points = CASES[name]
        for pt in points:
            t0 = time.time()
            with torch.device("meta"):
                model = factory()
            plan = named_plan(model, plan_name)
            with checkpointed(model, plan):
                got = analyze(model, inputs, device="cpu", compiled=True, inference=False,
                              hints=pt).at(**pt)["train"]
            t1 = time.time()
            torch.manual_seed(0)
            real_model = apply_checkpointing(materialize(factory()), plan)
            real = measure_compiled_train(real_model, example_inputs(inputs, pt))
            gap = (got["peak"] - real.peak) / real.peak * 100
            at = ",".join(f"{k}={v}" for k, v in pt.items())
            label = name if not plan else f"{name}, {plan_name}"
            print(f"| {label} | {at} | {got['saved_activations']:,} | {real.saved:,} | "
                  f"{got['peak']:,} | {real.peak:,} | {gap:+.2f}% |", flush=True)
            print(f"  (memsim {t1 - t0:.1f} s, compile+run {time.time() - t1:.1f} s)",
                  file=sys.stderr)


if __name__ == "__main__":
    args = sys.argv[1:]
    plan_name = "none"
    if args[:1] == ["--plan"]:
        plan_name, args = args[1], args[2:]
    main(args or list(CASES), plan_name)

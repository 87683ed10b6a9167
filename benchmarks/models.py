"""Popular model families, built from their configs: what memsim does with each, against a real
run.

    python -m benchmarks.models              # about 7 minutes on 2 cores
    python -m benchmarks.models mamba gru    # some of them

Each family is built from a small config of its own class (transformers, diffusers; no
weights), analysed on the meta device (``--device cpu``, fp32, AdamW, the plain loop), then
materialized at the same small size and run for real on the CPU
(``tests/support/oracles/measure.py``: live tensor storages, one warm-up step). Per model it prints
how the formulas were obtained (``traced``: symbolic in every symbol; ``fitted in S``: a symbol the
model's code pins, fitted from traces with it fixed, see ``analysis/fitted.py``), the analysis time,
and the training and inference peaks predicted and measured at two points of sizes that were not
traced, and the verdict (exact, differs, or refused with the error's type). Families whose sizes
depend on tensor values (``bounded``: docs/data-dependent.md) are run for real on data that makes
the bound hold (labels given, a router forced to the same experts). The table in
docs/accuracy.md ("Model families") is this script's output.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import transformers as T

from memsim.analysis import analyze

from tests.support import hf_models as hf, zoo
from tests.support.oracles.measure import (example_inputs, materialize, measure_inference,
                                           measure_train)

T.logging.set_verbosity_error()
LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def _diffusers_unet():
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8)


class _UNetLoss(torch.nn.Module):
    """The denoising loss of a diffusers UNet (its forward returns a dataclass)."""

    def __init__(self):
        super().__init__()
        self.unet = _diffusers_unet()

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states).sample.float().pow(2).mean()


def _diffusers_vae():
    from diffusers import AutoencoderKL
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                         layers_per_block=1, norm_num_groups=8, sample_size=16)


class _VAELoss(torch.nn.Module):
    """A diffusers VAE's reconstruction loss (the posterior's mode: no sampling)."""

    def __init__(self):
        super().__init__()
        self.vae = _diffusers_vae()

    def forward(self, sample):
        return (self.vae(sample).sample - sample).pow(2).mean()


def _sgd(ps):
    return torch.optim.SGD(ps, lr=1e-3)


def _seq2seq(cls, cfg):
    return lambda: cls(cfg)


MODELS = {
    "resnet": ("ResNet (transformers)", lambda: T.ResNetForImageClassification(T.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
        num_labels=10)), {"pixel_values": ("float32", ["B", 3, 32, 32]),
                          "labels": ("int64", ["B"])}, [{"B": 3}, {"B": 20}]),
    "convnext": ("ConvNeXt (transformers)", lambda: T.ConvNextForImageClassification(
        T.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)),
        {"pixel_values": ("float32", ["B", 3, 32, 32]), "labels": ("int64", ["B"])},
        [{"B": 3}, {"B": 20}]),
    "vit": ("ViT (transformers)", lambda: T.ViTForImageClassification(T.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=10)),
        {"pixel_values": ("float32", ["B", 3, 32, 32]), "labels": ("int64", ["B"])},
        [{"B": 3}, {"B": 20}]),
    "unet": ("UNet2DCondition (diffusers)", _UNetLoss,
             {"sample": ("float32", ["B", 4, 16, 16]), "timestep": 10,
              "encoder_hidden_states": ("float32", ["B", "S", 32])},
             [{"B": 2, "S": 9}, {"B": 3, "S": 20}]),
    "whisper": ("Whisper (transformers)", lambda: T.WhisperForConditionalGeneration(
        T.WhisperConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                        max_source_positions=32, max_target_positions=64,
                        decoder_start_token_id=1, pad_token_id=0)),
        {"input_features": ("float32", ["B", 8, 64]), "labels": ("int64", ["B", "S"])},
        [{"B": 2, "S": 9}, {"B": 3, "S": 20}]),
    "t5": ("T5 (transformers)", lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0)), {"input_ids": ("int64", ["B", "S"]),
                                     "labels": ("int64", ["B", "S"])},
        [{"B": 2, "S": 9}, {"B": 3, "S": 20}]),
    "bart": ("BART (transformers)", lambda: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64)), LM,
        [{"B": 2, "S": 9}, {"B": 3, "S": 20}]),
    "wav2vec2": ("wav2vec2, no SpecAugment (transformers)",
                 lambda: T.Wav2Vec2ForSequenceClassification(T.Wav2Vec2Config(
                     hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                     conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                     num_conv_pos_embedding_groups=4, num_labels=3, vocab_size=32,
                     mask_time_prob=0.0, layerdrop=0.0)),
                 {"input_values": ("float32", ["B", "S"]), "labels": ("int64", ["B"])},
                 [{"B": 2, "S": 400}, {"B": 3, "S": 1000}]),
    "llama": ("Llama (transformers)", lambda: T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)), LM,
        [{"B": 2, "S": 9}, {"B": 3, "S": 40}]),
    "qwen2": ("Qwen2 (transformers)", lambda: T.Qwen2ForCausalLM(T.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)), LM,
        [{"B": 2, "S": 9}, {"B": 3, "S": 40}]),
    "gemma2": ("Gemma2, window 16 (transformers)", lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=128,
        sliding_window=16)), dict(LM, use_cache=False), [{"B": 2, "S": 9}, {"B": 3, "S": 40}]),
    "mixtral": ("Mixtral MoE (transformers)", lambda: T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256)), LM,
        [{"B": 2, "S": 9}, {"B": 3, "S": 40}]),
    "qwen3next": ("Qwen3-Next, DeltaNet + MoE (transformers)",
                  lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
                      hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      layer_types=["linear_attention", "full_attention"],
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=100, max_position_embeddings=64, linear_num_value_heads=4,
                      linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16)), LM,
                  [{"B": 2, "S": 9}, {"B": 3, "S": 64}]),
    "mamba": ("Mamba (transformers, slow scan)", lambda: T.MambaForCausalLM(T.MambaConfig(
        vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
        conv_kernel=4, time_step_rank=4)), LM, [{"B": 2, "S": 9}, {"B": 3, "S": 40}]),
    "lstm": ("LSTM LM (nn.LSTM, oneDNN)", zoo.LSTMLM, {"x": ("int64", ["B", "S"])},
             [{"B": 3, "S": 40}, {"B": 25, "S": 60}]),
    "gru": ("GRU LM (nn.GRU)", zoo.GRULM, {"x": ("int64", ["B", "S"])},
            [{"B": 3, "S": 40}, {"B": 25, "S": 60}]),
    # sizes that depend on tensor values (docs/data-dependent.md): each real run's data makes
    # the bound hold (every label given, every token routed to the same experts...)
    "deberta-v2": ("DeBERTa-v2, default classification loss (nonzero)", hf.deberta_v2_classifier,
                   {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B"])},
                   [{"B": 2, "S": 9}, {"B": 3, "S": 16}]),
    "modernbert": ("ModernBERT, sparse prediction (x[mask])", hf.modernbert_sparse, LM,
                   [{"B": 2, "S": 9}, {"B": 3, "S": 16}]),
    "qwen2-moe": ("Qwen2-MoE, eager expert loop (routing: max)", hf.qwen2_moe_eager, LM,
                  [{"B": 2, "S": 8}, {"B": 3, "S": 6}], dict(real=hf.qwen2_moe_forced)),
    "jetmoe": ("JetMoE, tokens per expert as sizes (routing: max)", hf.jetmoe, LM,
               [{"B": 2, "S": 8}, {"B": 3, "S": 6}], dict(real=hf.jetmoe_forced)),
    "hubert": ("HuBERT CTC (masked_select, ctc_loss, a raising check)", hf.hubert_ctc,
               {"input_values": ("float32", ["B", "L"]), "labels": ("int64", ["B", "S"])},
               [{"B": 2, "L": 400, "S": 5}, {"B": 3, "L": 560, "S": 9}],
               dict(options={"hints": {"L": 400}}, inputs=lambda pt, x: dict(
                   x, labels=torch.ones(pt["B"], pt["S"], dtype=torch.long)))),
    "led": ("LED, global attention read with .item() (both branches)", hf.led,
            dict(LM, global_attention_mask=("int64", ["B", "S"])),
            [{"B": 2, "S": 16}, {"B": 3, "S": 24}],
            dict(inputs=lambda pt, x: dict(x, global_attention_mask=torch.ones(
                pt["B"], pt["S"], dtype=torch.long)))),
    "dinov2": ("DINOv2, symbolic image size", hf.dinov2,
               {"pixel_values": ("float32", ["B", 3, "H", "H"]), "labels": ("int64", ["B"])},
               [{"B": 2, "H": 24}, {"B": 3, "H": 40}]),
    "segformer": ("SegFormer, symbolic image size", hf.segformer,
                  {"pixel_values": ("float32", ["B", 3, "H", "H"]),
                   "labels": ("int64", ["B", "H", "H"])},
                  [{"B": 2, "H": 24}, {"B": 2, "H": 37}]),
    # the rest of issue 43's pass: families that pin a symbol, change themselves, or need an
    # example size of their own
    "pegasus": ("Pegasus, encoder S and decoder T (transformers)", lambda: hf.pegasus(64),
                {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "T"])},
                [{"B": 2, "S": 9, "T": 5}, {"B": 3, "S": 20, "T": 64}]),
    "bigbird": ("BigBird, block-sparse attention (changes itself)", hf.bigbird, LM,
                [{"B": 2, "S": 16}, {"B": 3, "S": 72}]),
    "dbrx": ("DBRX, eager expert loop (routing: max)", hf.dbrx, LM,
             [{"B": 2, "S": 8}, {"B": 3, "S": 6}], dict(real=hf.dbrx_forced)),
    "transformer": ("nn.Transformer, padding and causal masks", zoo.TorchTransformer,
                    {"src": ("float32", ["B", "S", 32]), "tgt": ("float32", ["B", "T", 32]),
                     "src_key_padding_mask": ("bool", ["B", "S"])},
                    [{"B": 2, "S": 9, "T": 5}, {"B": 3, "S": 20, "T": 12}],
                    dict(inputs=lambda pt, x: dict(x, src_key_padding_mask=torch.zeros(
                        pt["B"], pt["S"], dtype=torch.bool)))),
    "unet-bf16": ("U-Net with GroupNorm, bf16-mixed, SGD", zoo.GroupNormUNet,
                  {"x": ("float32", ["B", 3, "H", "H"]), "y": ("float32", ["B", 3, "H", "H"])},
                  [{"B": 3, "H": 32}, {"B": 2, "H": 24}],
                  dict(options={"precision": "bf16-mixed", "optimizer": "sgd"},
                       real_options={"precision": "bf16-mixed", "optimizer": _sgd})),
    "swin": ("Swin, symbolic image size", hf.swin,
             {"pixel_values": ("float32", ["B", 3, "H", "H"]), "labels": ("int64", ["B"])},
             [{"B": 2, "H": 32}, {"B": 3, "H": 48}]),
    "mobilenetv2": ("MobileNetV2, symbolic image size", hf.mobilenet_v2,
                    {"pixel_values": ("float32", ["B", 3, "H", "H"]),
                     "labels": ("int64", ["B"])},
                    [{"B": 2, "H": 32}, {"B": 3, "H": 48}]),
    "reformer": ("Reformer, its fixed length of 64", hf.reformer,
                 {"input_ids": ("int64", ["B", 64]), "labels": ("int64", ["B", 64])},
                 [{"B": 2}, {"B": 5}]),
    "funnel": ("Funnel (S pinned by arange)", hf.funnel, LM,
               [{"B": 2, "S": 9}, {"B": 3, "S": 40}]),
    "rwkv": ("RWKV (a loop over S)", hf.rwkv, LM, [{"B": 2, "S": 9}, {"B": 3, "S": 40}]),
    "clip": ("CLIP, contrastive loss (B pinned by arange)", hf.clip,
             {"input_ids": ("int64", ["B", "S"]), "pixel_values": ("float32", ["B", 3, 32, 32]),
              "return_loss": True},
             [{"B": 2, "S": 9}, {"B": 5, "S": 20}]),
    "gpt-neo": ("GPT-Neo, global and local attention (transformers)", hf.gpt_neo, LM,
                [{"B": 2, "S": 9}, {"B": 3, "S": 40}]),
    "lora": ("Llama with peft's LoRA (get_peft_model)", hf.llama_lora, LM,
             [{"B": 2, "S": 9}, {"B": 3, "S": 40}]),
    "vae": ("AutoencoderKL (diffusers)", _VAELoss, {"sample": ("float32", ["B", 3, "H", "H"])},
            [{"B": 2, "H": 16}, {"B": 3, "H": 24}]),
    "message-passing": ("message passing, index_add and scatter_add in N and E",
                        zoo.MessagePassing, {"x": ("float32", ["N", 16]),
                                             "src": ("int64", ["E"]), "dst": ("int64", ["E"])},
                        [{"N": 9, "E": 20}, {"N": 30, "E": 100}]),
    "masked": ("x[x > 0], masked_select, torch.where(mask)", zoo.MaskedSum,
               {"x": ("float32", ["B", 16])}, [{"B": 3}, {"B": 8}],
               dict(inputs=lambda pt, x: dict(x, x=x["x"].abs() + 0.1))),
    "gemma3": ("Gemma-3 with its SigLIP tower, sizes fixed (token ids given)",
               hf.gemma3_vision, hf.gemma3_vision_inputs(), [{}]),
    "bigru": ("bidirectional GRU LM (nn.GRU)", lambda: zoo.GRULM(bidirectional=True),
              {"x": ("int64", ["B", "S"])}, [{"B": 3, "S": 40}, {"B": 25, "S": 60}]),
}


def real(factory, inputs, point, extra=None) -> tuple[int, int]:
    """The real run's training and inference peaks (``extra``: the real model's factory and
    inputs where the data must make a bound hold, the real step's options)."""
    extra = extra or {}
    torch.manual_seed(0)
    model = materialize(extra.get("real", factory)())
    x = example_inputs(inputs, point)
    if "inputs" in extra:
        x = extra["inputs"](point, x)
    kw = extra.get("real_options", {})
    return (measure_train(model, x, **kw).peak,
            measure_inference(model, x, kw.get("precision", "32-true")))


def run(key: str) -> dict:
    """One family's entry of the results: how its formulas were obtained, the analysis time,
    and per point the peaks predicted and measured; or why it was refused."""
    name, factory, inputs, points, *more = MODELS[key]
    extra = more[0] if more else {}
    try:
        with torch.device("meta"):
            model = factory()
        t0 = time.perf_counter()
        report = analyze(model, inputs, device="cpu", **extra.get("options", {}))
    except Exception as e:  # a family memsim cannot analyse yet: say so, go on
        return {"name": name, "refused": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    took = time.perf_counter() - t0
    how = "traced" if report.basis == "exact" else report.basis
    if any(n.startswith("data-dependent size") or "not known in a symbolic run" in n
           for n in report.notes):
        how += ", bounded"
    out = {"name": name, "formulas": how, "seconds": round(took, 1), "points": []}
    for pt in points:
        shown, at = report.for_point(pt)
        got = shown.at(**at)
        try:
            tr, inf = real(factory, inputs, pt, extra)
        except Exception as e:  # the real run itself fails: say so, go on
            return {"name": name, "refused": f"the real run failed: {type(e).__name__}: "
                    f"{str(e).splitlines()[0]}"}
        mine = [got["train"]["peak"], got["inference"]["peak"] if "inference" in got else None]
        verdict = "exact" if mine == [tr, inf] else "differs"
        if mine[1] is None and mine[0] == tr:
            verdict = "train exact, inference refused"   # its trace failed (a note says why)
        if verdict == "differs" and "bounded" in how and mine[0] >= tr and (
                mine[1] is None or mine[1] >= inf):
            verdict = "upper bound"   # a bound the real run's data does not reach
        out["points"].append({"point": pt, "train": [mine[0], tr], "inference": [mine[1], inf],
                              "verdict": verdict})
    return out


def _point(pt: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in pt.items()) or "the sizes given"


def _pair(pair) -> str:
    mine, theirs = pair
    return f"{'-' if mine is None else format(mine, ',')} / {theirs:,}"


def _verdicts(entry: dict) -> str:
    """``exact at B=3; B=20``, or each point's verdict where they differ."""
    points = entry["points"]
    if len({p["verdict"] for p in points}) == 1:
        return f"{points[0]['verdict']} at " + "; ".join(_point(p["point"]) for p in points)
    return "; ".join(f"{p['verdict']} at {_point(p['point'])}" for p in points)


def table(results: dict, full: bool = False, every: bool = False) -> str:
    """The results as a GitHub table: a row per family (the README's), or with ``full`` a row
    per point with both peaks (docs/accuracy.md's); with ``every``, families not in
    ``results`` too (as not measured)."""
    from tabulate import tabulate
    rows = []
    for key in MODELS:
        e = results.get(key)
        if e is None and not every:
            continue
        if e is None:
            rows.append([MODELS[key][0], "not measured", "-"] + (["-"] * 3 if full else [])
                        + ["-"])
            continue
        if "refused" in e:
            rows.append([e["name"], e["refused"], "-"] + (["-"] * 3 if full else [])
                        + ["refused"])
            continue
        if not full:
            rows.append([e["name"], e["formulas"], f"{e['seconds']:.1f}", _verdicts(e)])
            continue
        for p in e["points"]:
            rows.append([e["name"], e["formulas"], f"{e['seconds']:.1f}", _point(p["point"]),
                         _pair(p["train"]), _pair(p["inference"]), p["verdict"]])
    headers = (["model", "formulas", "analysis (s)", "point", "train peak: memsim / real",
                "inference peak: memsim / real", "verdict"] if full else
               ["model", "formulas", "analysis (s)", "against real runs"])
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


RESULTS = Path(__file__).with_name("models.json")
# the generated tables sit between these lines in each page
BEGIN = "<!-- generated by python3 -m benchmarks.models --write: do not edit -->"
END = "<!-- end of generated table -->"
PAGES = {"README.md": False, "docs/accuracy.md": True}   # page -> full table


def generated(text: str) -> str:
    """The table between :data:`BEGIN` and :data:`END` in a page's text."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write(results: dict) -> None:
    """Save the results and put their tables into the README and docs/accuracy.md."""
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    root = Path(__file__).resolve().parent.parent
    for page, full in PAGES.items():
        path = root / page
        text = path.read_text()
        head, rest = text.split(BEGIN, 1)
        path.write_text(head + BEGIN + "\n" + table(results["families"], full, every=True) + "\n"
                        + END + rest.split(END, 1)[1])


def main(argv: list[str]) -> None:
    import argparse
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("families", nargs="*", choices=[[]] + list(MODELS), metavar="FAMILY",
                   help=f"some of: {', '.join(MODELS)} (default: all)")
    p.add_argument("--write", action="store_true",
                   help="merge the results into benchmarks/models.json and regenerate the "
                   "tables of the README and docs/accuracy.md from it")
    args = p.parse_args(argv)
    keys = args.families or list(MODELS)
    results = {}
    for k in keys:
        results[k] = run(k)
        print("\n".join(table({k: results[k]}, full=True).splitlines()[2:]), flush=True)
    print()
    print(table(results, full=True))
    if args.write:
        saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"families": {}}
        merged = {**saved["families"], **results}
        saved["families"] = {k: merged[k] for k in MODELS if k in merged}
        saved["environment"] = _environment()
        write(saved)


def _environment() -> str:
    import platform

    import transformers
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, Python "
            f"{platform.python_version()}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main(sys.argv[1:])

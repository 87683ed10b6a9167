"""Hugging Face GPT-2 and Llama from small configs: prediction == real eager CPU run."""

import functools

import pytest

from tests.support.predict import check, grid, predict

T = pytest.importorskip("transformers")

from tests.support.hf_models import (LM, bigbird, gemma3_vision, gpt2, llama,  # noqa: E402
                                     pegasus, qwen3_next)


@pytest.mark.slow
@pytest.mark.parametrize("factory", [gpt2, llama], ids=["gpt2", "llama"])
def test_causal_lm_matches_real_run(factory):
    report = predict(factory, LM)
    assert report.ranges["S"] == (2, 64)  # the model's own position limit
    check(report, factory, LM, grid(B=(2, 3, 5), S=(4, 9, 16)))


def bloom():
    return T.BloomForCausalLM(T.BloomConfig(hidden_size=64, n_layer=2, n_head=4,
                                            vocab_size=100, bos_token_id=0, eos_token_id=0))


def test_bloom_alibi_matches_real_run():
    """BLOOM adds its ALiBi bias with baddbmm, broadcast from (B*H, 1, S): torch's meta kernel
    fails on symbolic sizes, memsim's rule allocates the one output the kernel does."""
    report = predict(bloom, LM)
    check(report, bloom, LM, grid(B=(2, 3), S=(4, 9, 16)))


def deepseek_v2():
    """Multi-head latent attention, rotary frequencies made with torch.polar, a first dense
    layer then routed and shared experts."""
    return T.DeepseekV2ForCausalLM(T.DeepseekV2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=100, max_position_embeddings=64, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_shared_experts=1))


def test_deepseek_v2_matches_real_run():
    """torch.polar's fake kernel pinned S (no DeepSeek-V2 could be analysed); memsim's rule
    allocates the one complex output the kernels do."""
    report = predict(deepseek_v2, LM)
    check(report, deepseek_v2, LM, grid(B=(2, 3), S=(4, 9, 16)))


def bart():
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64))


def marian():
    return T.MarianMTModel(T.MarianConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=0))


@pytest.mark.parametrize("factory", [bart, marian], ids=["bart", "marian"])
def test_encoder_decoder_own_ones_mask_matches_real_run(factory):
    """BART's and Marian's decoders make their padding mask with ``torch.ones`` when none is
    given, and sdpa's mask code drops the causal (B, 1, S, S) mask after checking that it is
    all ones (``padding_mask.all()``). Under fake tensors the check read "tracing, keep it",
    and each decoder layer's attention kept a 4·B·S² mask for backward that the real run never
    makes (8·B·S² B over at B=3, S=20). ``tracer/known.py`` follows the ones."""
    report = predict(factory, LM)
    check(report, factory, LM, grid(B=(2, 3), S=(5, 20)))


def wav2vec2(**kw):
    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=3,
               vocab_size=32)
    return functools.partial(T.Wav2Vec2ForSequenceClassification,
                             T.Wav2Vec2Config(**dict(cfg, **kw)))


AUDIO = {"input_values": ("float32", ["B", "S"]), "labels": ("int64", ["B"])}


def test_wav2vec2_traced_past_its_convolution_at_larger_sizes_matches_real_run():
    """Raw audio: the feature extractor's first kernel (10 samples) is longer than the example
    size S = 7, and the model itself fails there. memsim traces again with S larger (and B as
    given) and the formulas hold from the sizes the model's guards allow. LayerDrop
    (``layerdrop=0.1``, wav2vec2's default) draws per layer at random: the trace runs every
    layer, the most memory a step takes, and says so; the real runs compared are those where
    no layer is skipped."""
    report = predict(wav2vec2(mask_time_prob=0.0), AUDIO)
    assert report.ranges["S"][0] <= 400 and any("LayerDrop (p=0.1)" in n for n in report.notes)
    check(report, wav2vec2(mask_time_prob=0.0, layerdrop=0.0), AUDIO,
          [{"B": 2, "S": 400}, {"B": 3, "S": 1000}])


def test_spec_augment_is_a_typed_error():
    """SpecAugment (wav2vec2's default ``mask_time_prob=0.05``) draws its masks with numpy from
    concrete lengths: past the convolution's size failure, the error names it and the setting
    that turns it off, where numpy raised an IndexError."""
    from memsim.tracer import DataDependentError
    with pytest.raises(DataDependentError, match="SpecAugment") as e:
        predict(wav2vec2(), AUDIO)
    assert "mask_time_prob=0" in str(e.value) and "Kernel size" in str(e.value)


def longformer():
    return T.LongformerForMaskedLM(T.LongformerConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=100, max_position_embeddings=80, attention_window=4))


@pytest.mark.slow
@pytest.mark.heavy
def test_longformer_matches_real_run():
    """Longformer pads its mask of ones to a multiple of the window (zeros), makes it 0 or the
    dtype's minimum, and asks ``(mask > 0).any().item()`` for global attention: False, from
    the values' bounds (tracer/known.py); it counts its chunks with ``torch.div`` of sizes
    and reads them back with ``.item()``: sizes. S = 22 is padded, S = 24 is not (its own
    code path, traced when asked for)."""
    report = predict(longformer, LM)
    check(report, longformer, LM, [{"B": 3, "S": 22}, {"B": 2, "S": 24}])


@pytest.mark.slow
@pytest.mark.heavy
def test_qwen3_next_matches_real_run():
    """linalg.solve_triangular's meta kernel fails on symbolic sizes (a rule makes its
    output); where S is a multiple of the chunk, F.pad pads nothing and ATen returns a clone
    with the input's (transposed) strides, which later matmuls copy: S = 64 is its own code
    path (each Gated DeltaNet layer read 32,768 B per sequence under a real run there when
    F.pad was always a new contiguous tensor)."""
    report = predict(qwen3_next, LM)
    check(report, qwen3_next, LM, [{"B": 2, "S": 9}, {"B": 3, "S": 64}, {"B": 2, "S": 33}])


_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               image_size=32, patch_size=8)                  # 16 patches: 16 image tokens


def llava():
    return T.LlavaForConditionalGeneration(T.LlavaConfig(
        text_config=dict(_TEXT, model_type="llama"),
        vision_config=dict(_VISION, model_type="clip_vision_model"), image_token_index=99,
        vision_feature_layer=-1))


def paligemma():
    return T.PaliGemmaForConditionalGeneration(T.PaliGemmaConfig(
        text_config=dict(_TEXT, model_type="gemma", head_dim=8),
        vision_config=dict(_VISION, model_type="siglip_vision_model"), image_token_index=99,
        projection_dim=32))


VLM = {"input_ids": ("int64", ["B", "S"]), "pixel_values": ("float32", ["B", 3, 32, 32]),
       "labels": ("int64", ["B", "S"])}


def _image_then_text(pt: dict) -> dict:
    """A real batch: each sequence starts with its image's 16 tokens (id 99), then text."""
    import torch
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 98, (pt["B"], pt["S"]), generator=g)
    ids[:, :16] = 99
    return {"input_ids": ids, "pixel_values": torch.randn(pt["B"], 3, 32, 32, generator=g),
            "labels": torch.randint(0, 98, (pt["B"], pt["S"]), generator=g)}


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("factory", [llava, paligemma], ids=["llava", "paligemma"])
def test_vision_language_model_matches_real_run(factory):
    """A vision-language model checks that its input ids hold as many image tokens as its
    images have features (a value: DataDependentError), then masked_scatter puts the features
    there (its meta kernel failed on symbolic sizes) and its backward masked_selects them
    (a data-dependent size). The check is taken to hold, as in every run that goes past it
    (a note says so), and the source's size is the selection's. LLaVA's ``list(image
    features)`` pins B: fitted, and checked here at B = 6."""
    report = predict(factory, VLM, inference=False)
    assert any("the model's check of its inputs' values at" in n for n in report.notes), \
        report.notes
    check(report, factory, VLM, [{"B": 2, "S": 20}, {"B": 3, "S": 40}, {"B": 6, "S": 33}],
          real_inputs=_image_then_text)


@pytest.mark.slow
class _BoxLoss(__import__("torch").nn.Module):
    """A user's module around DETR: a loss on the predicted boxes (DETR's own loss matches
    boxes to labels with scipy, from values)."""

    def __init__(self):
        super().__init__()
        self.detr = T.DetrForObjectDetection(T.DetrConfig(
            use_timm_backbone=False, use_pretrained_backbone=False,
            backbone_config=T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                           depths=[1, 1], out_features=["stage2"]),
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=5))

    def forward(self, pixel_values):
        return self.detr(pixel_values=pixel_values).pred_boxes.pow(2).mean()


def test_detr_inside_a_users_module_matches_real_run():
    """DETR caches its position embeddings with Hugging Face's lru_cache, whose key hashes the
    symbolic shape (TypeError), and its encoder clamps activations ``if not
    torch.isfinite(h).all()`` (a value). Inside a user's module, Hugging Face's patches apply:
    the cache keys sizes by their expressions and keeps its entry as the real one does, and
    the check is taken to hold, as in a healthy step (a note says so)."""
    inputs = {"pixel_values": ("float32", ["B", 3, 32, 32])}
    report = predict(_BoxLoss, inputs, inference=False)
    assert any("check that its values are finite" in n for n in report.notes), report.notes
    check(report, _BoxLoss, inputs, [{"B": 2}, {"B": 3}])


def test_gpt2_eager_attention_with_padding_mask():
    """A padded attention mask: HF materializes the (B, 1, S, S) mask in the real run too."""
    def factory():
        m = gpt2()
        m.config._attn_implementation = "eager"
        return m
    inputs = dict(LM, attention_mask=("int64", ["B", "S"]))
    report = predict(factory, inputs)
    check(report, factory, inputs, grid(B=(2, 4), S=(3, 8, 17)))


@pytest.mark.slow
@pytest.mark.parametrize("factory", [gpt2, llama], ids=["gpt2", "llama"])
def test_without_cache_no_packed_mask(factory):
    """use_cache=False: HF's packed-sequence check would build a (B,1,S,S) mask under fake
    tensors that the real run drops (tracer.hf.eager_like keeps them on the same path)."""
    inputs = dict(LM, use_cache=False)
    report = predict(factory, inputs)
    check(report, factory, inputs, grid(B=(2, 3), S=(5, 12, 20)))


@pytest.mark.slow
def test_batch_of_one_matches_real_run():
    report = predict(gpt2, LM, inference=False)
    check(report, gpt2, LM, [{"B": 1, "S": 9}, {"B": 1, "S": 16}, {"B": 3, "S": 1}])


@pytest.mark.slow
@pytest.mark.parametrize("factory", [gpt2, llama], ids=["gpt2", "llama"])
def test_all_ones_mask_matches_real_run(factory):
    """attention_mask=...:ones: sdpa drops the (B, 1, S, S) mask as the real run does."""
    ones = dict(LM, attention_mask=("int64", ["B", "S"], "ones"))
    report = predict(factory, ones)
    check(report, factory, ones, grid(B=(2, 3), S=(5, 16)))


@pytest.mark.slow
@pytest.mark.parametrize("factory", [gpt2, llama], ids=["gpt2", "llama"])
def test_padded_mask_matches_real_run(factory):
    """A padded attention mask (zeros): sdpa gets the (B, 1, S, S) mask, and Llama repeats K/V
    for it, in the trace as in the real run."""
    padded = dict(LM, attention_mask=("int64", ["B", "S"]))
    report = predict(factory, padded, inference=False)
    check(report, factory, padded, [{"B": 2, "S": 5}, {"B": 3, "S": 16}])


@pytest.mark.slow
def test_activation_checkpointing_matches_real_run():
    """Hugging Face's own (non-reentrant) checkpointing: the recomputed forward's activations
    come back transiently during backward, in the trace as in the real run."""
    def factory():
        m = llama()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m
    report = predict(factory, LM, inference=False)
    check(report, factory, LM, grid(B=(2, 3), S=(5, 16)))
    plain = predict(llama, LM, inference=False)
    pt = {"B": 3, "S": 16}
    assert report.at(**pt)["train"]["saved_activations"] < \
        plain.at(**pt)["train"]["saved_activations"]


@pytest.mark.parametrize("factory", [gpt2, llama], ids=["gpt2", "llama"])
def test_dropped_outputs_match_real_run(factory):
    """The loop Hugging Face's Trainer runs: compute_loss returns the loss only, so the logits
    are released once the loss exists (keep_outputs=False, --drop-outputs)."""
    report = predict(factory, LM, keep_outputs=False, inference=False)
    check(report, factory, LM, grid(B=(2, 3), S=(5, 16)), keep_outputs=False)


def _mha_llama(cache: bool):
    return T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=50, max_position_embeddings=128, use_cache=cache))


def test_previous_steps_output_is_alive_until_the_loop_rebinds_it():
    """A loop rebinds ``out`` and ``loss``: the previous step's output, with Hugging Face's KV
    cache (``use_cache=True``, its configs' default, which training keeps), is alive until the
    forward returns, and its loss until the new loss exists (tracer/previous.py). Here that
    makes the peak, in forward: the prediction equals a real run whose previous step's output
    is held so (tests/support/oracles/measure.py), and is above the same model's without a
    cache."""
    on, off = (functools.partial(_mha_llama, c) for c in (True, False))
    report = predict(on, LM, inference=False)
    check(report, on, LM, grid(B=(3,), S=(40, 100)))
    at = report.at(B=3, S=40)["train"]["peak"]
    assert at > predict(off, LM, inference=False).at(B=3, S=40)["train"]["peak"]
    ghosts = [s for s in report.train.trace.run.storages if s.op.startswith("<previous")]
    assert {s.op for s in ghosts} == {"<previous output>", "<previous loss>"}
    # logits, and per layer the cache's keys and values: 1 + 2 * 2 storages, and the loss
    assert len(ghosts) == 1 + 2 * 2 + 1


def test_inference_loop_holds_the_previous_output():
    """An evaluation loop rebinds ``out = model(**batch)`` too: the previous forward's logits
    and KV cache (``use_cache=True`` in ``eval()``) are alive until the next forward returns.
    Kept and dropped, the prediction equals a real loop of two forwards (the second measured,
    tests/support/oracles/measure.py); kept is above dropped by exactly the previous output's
    storages: fp32 logits (B, S, 50), per layer the cache's keys and values (B, 4, S, 16), and
    the loss (the inputs have labels)."""
    on = functools.partial(_mha_llama, True)
    peaks = {}
    for keep in (True, False):
        report = predict(on, LM, keep_outputs=keep, inference=True, train=False)
        check(report, on, LM, grid(B=(3,), S=(40, 100)), keep_outputs=keep)
        peaks[keep] = report.at(B=3, S=40)["inference"]["peak"]
        ghosts = [s for s in report.inference.trace.run.storages
                  if s.op.startswith("<previous")]
        assert {s.op for s in ghosts} == ({"<previous output>"} if keep else set())
    assert peaks[True] - peaks[False] == 4 * (3 * 40 * 50 + 2 * 2 * 3 * 4 * 40 * 16 + 1)


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_peft_wrapped_llama_matches_real_run(keep):
    """A Llama wrapped by peft's own get_peft_model (LoRA on q_proj and v_proj, the base
    frozen), with the Trainer's loop (the output dropped) and the plain one."""
    peft = pytest.importorskip("peft")

    def factory():
        return peft.get_peft_model(llama(), peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    report = predict(factory, LM, keep_outputs=keep, inference=False)
    check(report, factory, LM, grid(B=(2, 3), S=(5, 16)), keep_outputs=keep)


def test_cli_drop_outputs_and_a_misspelled_input(capsys):
    import json

    from memsim.cli import main

    args = ["analyze", f"{__file__}:gpt2", "--input", "input_ids=int64[B,S]", "--at", "B=2,S=16",
            "--device", "cpu", "--train", "--json"]
    assert main(args + ["--input", "labels=int64[B,S]", "--drop-outputs"]) == 0
    dropped = json.loads(capsys.readouterr().out)
    assert main(args + ["--input", "labels=int64[B,S]"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert (dropped["outputs"], kept["outputs"]) == ("dropped", "kept")
    want = predict(gpt2, LM, keep_outputs=False, inference=False).at(B=2, S=16)["train"]["peak"]
    assert dropped["train"]["peak"]["bytes"] == want < kept["train"]["peak"]["bytes"]
    # GPT-2's forward swallows unknown keywords: a typo must not trace a step without a loss
    assert main(args + ["--input", "lables=int64[B,S]"]) == 2
    err = capsys.readouterr().err
    assert "'lables'" in err and "did you mean 'labels'" in err


def mistral(window=16):
    """A sliding window of 16 positions in 128."""
    return T.MistralForCausalLM(T.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128,
        sliding_window=window))


@pytest.mark.parametrize("window", [16, pytest.param(32, marks=pytest.mark.heavy)])
def test_sliding_window_regimes_match_real_runs(window):
    """Below the window HF's cache keeps the whole sequence and attention is causal; past it,
    the cache keeps the window's last positions and a (B, 1, S, S) mask is built; at S =
    window - 1 exactly, the slice that keeps them is the whole dimension (a path of one size).
    The trace's guard S <= window - 2 is crossed (it was reported as the model's limit): every
    side is traced and equals real runs, up to the model's 128 positions. With a window of 32
    the guard is crossed at S = 31, the size whose guards pin S (a prime, as the sizes traced
    past a guard are): it was taken as the model's own limit, S <= 30."""
    factory = functools.partial(mistral, window)
    report = predict(factory, LM)
    w = window
    assert report.ranges["S"] == (2, w - 2) and report.extent["S"] == (2, 128)
    assert [(g.symbol, g.lo, g.hi) for g in report.regimes] == [("S", w, 128)]
    assert any(f"S = {w - 1}..{w - 1}" in n for n in report.notes), report.notes
    check(report, factory, LM, grid(B=(2, 3), S=(9, w - 2, w - 1, w, 40, 128)))


def test_sliding_window_regimes_under_a_strategy():
    """A strategy's report crosses the same guard: past the window it answers from the regime
    traced symbolically (nothing fixed), equal to a real run of the checkpointed model."""
    import torch

    from memsim import analyze
    from memsim.strategies.checkpoint import apply_checkpointing, blocks

    with torch.device("meta"):
        model = mistral()
    inputs = dict(LM, use_cache=False)   # a cache updated again in recomputation would not fit
    report = analyze(model, inputs, device="cpu", checkpoint="blocks", inference=False)
    sub, pt = report.for_point({"B": 2, "S": 40})
    assert sub.fixed == {} and sub.strategy["checkpoint"] == "blocks"

    def checkpointed():
        m = mistral()
        return apply_checkpointing(m, blocks(m))

    check(report, checkpointed, inputs, [{"B": 2, "S": 40}])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_mixtral_experts_match_real_run(precision):
    """transformers' MoE experts run torch._grouped_mm, whose meta kernel refused fp32
    ("Expected inputs of BF16 type") although the CPU run works: a Mixtral from config, top-2
    of 4 experts, equal to real runs in every precision."""
    def factory():
        return T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=256))
    report = predict(factory, LM, precision=precision)
    check(report, factory, LM, grid(B=(2, 3), S=(8, 17)), precision=precision)


def mamba2():
    return T.Mamba2ForCausalLM(T.Mamba2Config(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
        n_groups=1, state_size=8, chunk_size=16, expand=2))


@pytest.mark.slow
@pytest.mark.heavy   # 35 s on 2 cores: in .ci/run's heavy step, out of the default run's budget
def test_mamba2_scan_over_one_chunk_matches_real_run():
    """transformers' Mamba-2 scan without its CUDA kernels (``torch_forward``: Mamba2, Bamba,
    FalconH1, Zamba2) pads S to whole chunks with F.pad on a transposed tensor. ATen makes
    that output channels-last (``suggest_memory_format``); memsim's pad rule made it
    contiguous. With one chunk (S <= chunk_size) the CPU's later reshapes then view where the
    trace copied, B x chunk x heads x head_dim x 4 bytes per layer too many (Zamba2's config
    in benchmarks/lm_families.py at B=2, S=9: 262,144 B; read until then as a size-1 path
    without a guard). Equal to real runs with one chunk and with two."""
    report = predict(mamba2, LM)
    check(report, mamba2, LM, [{"B": 2, "S": 9}, {"B": 3, "S": 20}])


@pytest.mark.heavy
def test_a_model_that_changes_itself_is_traced_as_given_every_time():
    """BigBird's forward replaces its attention modules with full attention the first time it
    sees a short sequence, and keeps them: memsim's first trace (S = 7) made every later trace
    full attention, and sizes past 56 were answered for the full-attention model. Each trace now
    starts from the model as given, the change is named in the notes, and a full-attention
    size (S = 16) and a block-sparse one (S = 72) equal real runs of a fresh model, with no
    hint."""
    report = predict(bigbird, LM, inference=False)
    changed = [n for n in report.notes if n.startswith("the model changed itself")]
    assert len(changed) == 1 and "bert.encoder.attention_type: 'original_full' (was " \
        "'block_sparse')" in changed[0], report.notes
    check(report, bigbird, LM, [{"B": 2, "S": 16}, {"B": 3, "S": 72}])


def test_decoder_positions_and_text_config_limits():
    """Positions bound every sequence the model has them for: an encoder-decoder's decoder
    length too (Pegasus' 40 positions serve S and T; a real run at T = 41 raises IndexError, so
    the range ends at 40 and a point past it is refused before any trace), and a limit that
    sits in the text config (Gemma-3's ``text_config.max_position_embeddings``)."""
    import torch

    from memsim.tracer import OutOfRangeError
    from memsim.tracer.hf import limits
    seq2seq = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "T"])}
    with torch.device("meta"):
        model = pegasus()
        gemma3 = gemma3_vision()
    assert limits(model, seq2seq) == {"S": 40, "T": 40}
    assert limits(gemma3, LM) == {"S": 96}
    with torch.device("meta"):   # encoder and decoder positions apart
        led = T.LEDForConditionalGeneration(T.LEDConfig(
            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
            max_encoder_position_embeddings=128, max_decoder_position_embeddings=48,
            attention_window=[8]))
    assert limits(led, seq2seq) == {"S": 128, "T": 48}
    with pytest.raises(IndexError):   # the real model has no 41st position
        real = pegasus()
        real(input_ids=torch.zeros(1, 4, dtype=torch.long),
             labels=torch.zeros(1, 41, dtype=torch.long))
    report = predict(pegasus, seq2seq, inference=False)
    assert report.ranges["S"][1] == 40 and report.ranges["T"][1] == 40, report.ranges
    with pytest.raises(OutOfRangeError, match="T=41"):
        report.at(B=2, S=8, T=41)
    check(report, pegasus, seq2seq, [{"B": 2, "S": 8, "T": 40}])

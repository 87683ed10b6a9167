"""Small Hugging Face models the tests and benchmarks share: each a factory (call it under
``torch.device("meta")`` for memsim, as is for a real run) taking ``LM``'s inputs. Importing this
module imports transformers (a test imports it with ``pytest.importorskip``)."""

import torch
import transformers as T

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                          n_positions=64, bos_token_id=0, eos_token_id=0))


def llama():
    return T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64))


def qwen3_next():
    """Gated DeltaNet layers (a causal conv, the chunked delta rule solved with
    linalg.solve_triangular, S padded to 64-token chunks) and a full-attention layer, MoE."""
    return T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        layer_types=["linear_attention", "full_attention"],
        num_key_value_heads=2, head_dim=8, vocab_size=100, max_position_embeddings=64,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16))


# sizes that depend on tensor values (tests/test_data_dependent.py) and image sizes
# (tests/test_vision_sizes.py); benchmarks/models.py runs them too

def deberta_v2_classifier():
    return T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64, num_labels=3))


def modernbert_sparse():
    return T.ModernBertForMaskedLM(T.ModernBertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64, sparse_prediction=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))


def hubert_ctc():
    return T.HubertForCTC(T.HubertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=20, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
        layerdrop=0.0))


def led():
    return T.LEDForConditionalGeneration(T.LEDConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
        max_encoder_position_embeddings=128, max_decoder_position_embeddings=64,
        attention_window=[8]))


def qwen2_moe_eager():
    config = T.Qwen2MoeConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    config._experts_implementation = "eager"   # the loop over the experts hit
    return T.Qwen2MoeForCausalLM(config)


def routed_hook(spread: bool):
    """A real run's routing forced: every token to experts 0 and 1 (``spread=False``), or token
    t's slot j to expert (2 t + j) mod 4 (each expert an equal share). The router's indices are
    overwritten in place (``.data``: no new memory, autograd's saved copy untouched)."""
    def hook(module, args, out):
        idx = out[2].data
        if spread:
            tokens = torch.arange(idx.numel()).remainder_(module.num_experts)
            idx.view(-1).copy_(tokens)
        else:
            for j in range(idx.shape[-1]):
                idx[:, j].fill_(j)
    return hook


def jetmoe():
    return T.JetMoeForCausalLM(T.JetMoeConfig(
        hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=100,
        max_position_embeddings=64))


def forced_logits_hook(spread: bool):
    """A router's logits overwritten in place so that its top-k picks experts 0..k-1 for every
    token (or (k t + j) mod n for token t's slot j): fills only, no new memory."""
    def hook(module, args, out):
        logits, k = out.data, 2
        logits.fill_(-1e4)
        for t in range(logits.shape[0]):
            for j in range(k):
                e = (k * t + j) % logits.shape[1] if spread else j
                logits[t, e:e + 1].fill_(1e4 - j)
    return hook


def dinov2():
    return T.Dinov2ForImageClassification(T.Dinov2Config(
        image_size=32, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=3))


def segformer():
    return T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
        hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
        mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=3))


def qwen2_moe_forced(spread: bool = False):
    """:func:`qwen2_moe_eager` whose routers are forced (:func:`routed_hook`): the real run of
    a routing bound."""
    return _routers_forced(qwen2_moe_eager(), spread)


def _logits_forced(model, spread: bool):
    """``model`` with every ``router.layer``'s logits forced (:func:`forced_logits_hook`)."""
    for name, m in model.named_modules():
        if name.endswith("router.layer"):
            m.register_forward_hook(forced_logits_hook(spread))
    return model


def jetmoe_forced(spread: bool = False):
    """:func:`jetmoe` whose routers' logits are forced (:func:`forced_logits_hook`)."""
    return _logits_forced(jetmoe(), spread)


# families of issue 43's pass that benchmarks/models.py runs beside the ones above
def bigbird():
    """Block-sparse attention over blocks of 8 with one random block: too short a sequence
    (S <= (5 + 2 x 1) x 8 = 56) switches the model to full attention, for good."""
    return T.BigBirdForMaskedLM(T.BigBirdConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=100, max_position_embeddings=256, block_size=8, num_random_blocks=1,
        attention_type="block_sparse"))


def pegasus(positions: int = 40):
    return T.PegasusForConditionalGeneration(T.PegasusConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
        max_position_embeddings=positions, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, bos_token_id=0))


def funnel():
    """Funnel's pooling: its relative positions are ``torch.arange`` of S (S pinned)."""
    return T.FunnelForMaskedLM(T.FunnelConfig(
        vocab_size=100, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64,
        num_decoder_layers=1, max_position_embeddings=128))


def rwkv():
    """RWKV's WKV recurrence in Python (no CUDA kernel on the CPU): a loop over S."""
    return T.RwkvForCausalLM(T.RwkvConfig(
        vocab_size=100, context_length=128, hidden_size=32, num_hidden_layers=2,
        attention_hidden_size=32, intermediate_size=64))


def clip():
    """CLIP's contrastive loss: ``arange(len(logits))`` pins B."""
    return T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=32),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, image_size=32, patch_size=8),
        projection_dim=16))


def mobilenet_v2():
    return T.MobileNetV2ForImageClassification(T.MobileNetV2Config(
        depth_multiplier=0.25, image_size=32, num_labels=10))


def swin():
    """Patches of 4, windows of 4: the image is padded to whole patches and windows."""
    return T.SwinForImageClassification(T.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, num_labels=10))


def reformer():
    """Local and LSH attention over chunks of 8, axial positions 8 x 8: training takes exactly
    64 tokens."""
    return T.ReformerModelWithLMHead(T.ReformerConfig(
        vocab_size=100, hidden_size=32, attention_head_size=8, num_attention_heads=4,
        feed_forward_size=64, attn_layers=["local", "lsh"], axial_pos_shape=[8, 8],
        axial_pos_embds_dim=[16, 16], max_position_embeddings=64, local_attn_chunk_length=8,
        lsh_attn_chunk_length=8, num_buckets=4, is_decoder=True, pad_token_id=0,
        eos_token_id=1))


def dbrx():
    """DBRX's eager expert loop (clip_qkv set)."""
    config = T.DbrxConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=100,
                          attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
                          ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2))
    # transformers reads the rope base from the attention config, which does not hold it
    config.attn_config.rope_theta = config.rope_parameters["rope_theta"]
    return T.DbrxForCausalLM(config)


def dbrx_forced(spread: bool = False):
    """:func:`dbrx` whose routers' logits are forced (:func:`forced_logits_hook`)."""
    return _logits_forced(dbrx(), spread)


def gpt_neo():
    """GPT-Neo: global and local (window 8) attention layers."""
    return T.GPTNeoForCausalLM(T.GPTNeoConfig(
        vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=8,
        max_position_embeddings=64, intermediate_size=64))


def llama_lora():
    """:func:`llama` wrapped by peft's ``get_peft_model`` (rank 4 on q_proj and v_proj): the
    user's own LoRA model, analysed as it is."""
    import peft
    return peft.get_peft_model(llama(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def gemma3_vision():
    """Gemma-3 with its SigLIP tower (one layer each): images of 28 x 28 in patches of 14, 4
    tokens per image."""
    return T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         vocab_size=300, max_position_embeddings=96),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4))


def gemma3_vision_inputs(batch: int = 2, seq: int = 12) -> dict:
    """Gemma-3's inputs with the image's 4 tokens at positions 1-4 of each row: the token ids
    given as tensors (an input spec has sizes, not values), the image a spec, no loss on the
    image's tokens."""
    image = 262144   # Gemma3Config's image_token_id
    ids = torch.full((batch, seq), 5, dtype=torch.long)
    ids[:, 1:5] = image
    labels = ids.masked_fill(ids == image, -100)   # no loss on the image's tokens
    return {"input_ids": ids, "pixel_values": ("float32", [batch, 3, 28, 28]),
            "labels": labels, "token_type_ids": (ids == image).long()}


def _routers_forced(model, spread: bool):
    """``model`` with every decoder layer's ``mlp.gate`` forced (:func:`routed_hook`)."""
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(routed_hook(spread))
    return model


def qwen3_moe(experts: int = 4):
    """A small Qwen3-MoE (its experts through ``grouped_mm``, transformers' default), whose
    configuration publishes an expert-parallel plan."""
    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=experts, num_experts_per_tok=2, max_position_embeddings=64, head_dim=8))


def qwen3_moe_forced(spread: bool = False, experts: int = 4):
    """:func:`qwen3_moe` whose routers are forced (:func:`routed_hook`)."""
    return _routers_forced(qwen3_moe(experts), spread)


def qwen3_moe_wide(experts: int = 32):
    """One Qwen3-30B-A3B-shaped layer (hidden 2048, 32 heads of 128, 4 key-value heads, experts
    of 768, top-8), ``experts`` of its 128 experts, a small vocabulary."""
    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        vocab_size=256, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=experts, num_experts_per_tok=8, max_position_embeddings=4096))


def qwen3_moe_wide_forced(spread: bool = False):
    """:func:`qwen3_moe_wide` whose routers are forced (:func:`routed_hook`)."""
    return _routers_forced(qwen3_moe_wide(), spread)


def mixtral_moe():
    """A small Mixtral (top-2 of 4 experts through ``grouped_mm``)."""
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64))


def mixtral_moe_forced(spread: bool = False):
    """:func:`mixtral_moe` whose routers are forced (:func:`routed_hook`)."""
    return _routers_forced(mixtral_moe(), spread)

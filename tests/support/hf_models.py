"""Small Hugging Face models the tests and benchmarks share: each a factory (call it under
``torch.device("meta")`` for memsim, as is for a real run) taking ``LM``'s inputs. Importing this
module imports transformers (a test imports it with ``pytest.importorskip``)."""

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

"""The seed scenario: a 13B-parameter Llama-style model, bf16 mixed precision, activation
checkpointing of every decoder layer, micro-batch 4 (no download, no weights: built on meta).

    memsim analyze examples/llama13b.py:model --input input_ids=int64[B,S] \
        --input labels=int64[B,S] --at B=4,S=4096 --precision bf16-mixed --train \
        --gpu h100-80gb

The target setup, 8 GPUs with DeepSpeed ZeRO-3 (DeepSpeed's own engine, traced per rank):

    memsim analyze examples/llama13b.py:model --input input_ids=int64[B,S] \
        --input labels=int64[B,S] --at B=4,S=4096 --precision bf16-master --train \
        --gpu h100-80gb --zero 3 --dp 8
"""

import transformers


def model():
    """Llama-2-13B layout: 40 layers, hidden 5120, 40 heads, MLP 13824, 32000 tokens, 4096
    positions; Hugging Face's own (non-reentrant) activation checkpointing on every layer."""
    cfg = transformers.LlamaConfig(hidden_size=5120, intermediate_size=13824,
                                   num_hidden_layers=40, num_attention_heads=40,
                                   num_key_value_heads=40, vocab_size=32000,
                                   max_position_embeddings=4096)
    m = transformers.LlamaForCausalLM(cfg)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m

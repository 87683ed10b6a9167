"""A small GPT-2 built from its config (no download, no weights: memsim builds it on meta).

    memsim analyze examples/gpt2.py:model --input input_ids=int64[B,S] \
        --input labels=int64[B,S] --at B=8,S=1024
"""

import transformers


def model():
    """GPT-2 124M layout (12 layers, hidden 768, 12 heads, 50257 tokens, 1024 positions)."""
    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                  n_positions=1024)
    return transformers.GPT2LMHeadModel(cfg)

"""Causal language models of many Hugging Face families, from small configs of their own
classes: does memsim's training step equal a real CPU run? Run on demand (about 5 minutes on
2 cores):

    python -m benchmarks.lm_families            # every family below
    python -m benchmarks.lm_families Bamba Zamba2

Each model (2 layers, hidden 64, vocabulary 128, fp32) is analysed on the meta device with
symbolic ``B`` and ``S`` (``--device cpu``, AdamW, the plain loop), then materialized and run
for real (``tests/support/oracles/measure.py``: live tensor storages) at B=2, S=9 and B=3,
S=20, sizes that were not traced; every figure the oracle has must be equal
(``tests/support/predict.py::check``).
Mamba-2 layers scan in chunks of 16 here (Zamba2's of 256): S=9 is one chunk, S=20 two. A
line per family: ``exact``, ``DIFFER`` (the first figure that differs) or ``ERROR`` (what
failed), with the analysis time. ``benchmarks/models.py`` is the table of families (docs/accuracy.md)
against real runs at other points, inference included; this one is wider and train only.
"""

from __future__ import annotations

import sys
import time

import transformers as T

from tests.support.predict import check, predict

T.logging.set_verbosity_error()
LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
POINTS = [{"B": 2, "S": 9}, {"B": 3, "S": 20}]
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
ROUTED = dict(MOE, n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1)
MAMBA2 = dict(mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16)
# family: its config's fields beyond BASE (its classes: family + Config, and MODEL_CLASS below)
FAMILIES = {
    "Llama": {}, "Mistral": dict(sliding_window=8), "Qwen3": dict(head_dim=16),
    "Gemma3Text": dict(head_dim=16, sliding_window=8),
    "Llama4Text": dict(head_dim=16, num_local_experts=2, intermediate_size_mlp=128,
                       attention_chunk_size=8, interleave_moe_layer_step=1),
    "Phi3": dict(pad_token_id=0), "StableLm": {}, "Cohere": {},
    "Cohere2": dict(sliding_window=8), "Olmo2": {}, "Olmo3": dict(sliding_window=8),
    "Granite": {}, "Ernie4_5": dict(head_dim=16), "SmolLM3": dict(pad_token_id=0),
    "Starcoder2": {}, "GPTNeoX": {}, "Exaone4": dict(sliding_window=8),
    "HunYuanDenseV1": dict(head_dim=16), "SeedOss": dict(head_dim=16), "Apertus": {},
    "GraniteMoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "Olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "Qwen3Moe": dict(MOE, num_experts=4, head_dim=16),
    "Phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "GptOss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"]),
    "Glm4Moe": dict(ROUTED, head_dim=16),
    "Dots1": dict(ROUTED, head_dim=16, n_shared_experts=1),
    "DeepseekV3": dict(ROUTED, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    "Jamba": dict(num_experts=2, num_experts_per_tok=1, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
    "Lfm2": dict(layer_types=["conv", "full_attention"]),
    "Mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=8, chunk_size=16,
                   expand=2),
    "Bamba": dict(MAMBA2, mamba_n_heads=8, mamba_d_head=16, attn_layer_indices=[1]),
    "FalconH1": dict(MAMBA2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, head_dim=16),
    "Zamba2": dict(mamba_d_state=8, mamba_ngroups=1, mamba_headdim=16, n_mamba_heads=8,
                   chunk_size=256, num_mem_blocks=1, layers_block_type=["mamba", "hybrid"],
                   use_mem_rope=False, attention_head_dim=16, adapter_rank=8,
                   use_shared_attention_adapter=False),
}

# the causal-LM class where it is not family + ForCausalLM
MODEL_CLASS = {"Gemma3Text": "Gemma3ForCausalLM", "Llama4Text": "Llama4ForCausalLM"}


def factory(family: str):
    def build():
        cfg = getattr(T, f"{family}Config")(**{**BASE, **FAMILIES[family]})
        return getattr(T, MODEL_CLASS.get(family, f"{family}ForCausalLM"))(cfg)
    return build


def run(family: str) -> str:
    if not hasattr(T, MODEL_CLASS.get(family, f"{family}ForCausalLM")):
        return "absent from this transformers"
    build = factory(family)
    t0 = time.perf_counter()
    try:
        report = predict(build, LM)
        took = time.perf_counter() - t0
        check(report, build, LM, POINTS)
    except AssertionError as e:
        return f"DIFFER: {str(e)[:300]}"
    except Exception as e:  # noqa: BLE001 (a probe: every failure is a finding, named)
        return f"ERROR: {type(e).__name__}: {str(e)[:300]}"
    return f"exact (analysis {took:.1f} s)"


def main(argv: list[str]) -> None:
    names = argv or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    print(f"transformers {T.__version__}; points {POINTS}")
    for name in names:
        print(f"{name:>16}: {run(name)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

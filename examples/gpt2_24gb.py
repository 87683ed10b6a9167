"""GPT-2 (124M) full fine-tuning on a 24 GB card: the largest batch at S=1024, with and without
activation checkpointing.

    python examples/gpt2_24gb.py            # the question: an RTX 4090 (24 GB)
    python examples/gpt2_24gb.py --small    # a 2-layer, 64-wide GPT-2 on the CPU, a 16 MiB budget

Modelled (traced): Hugging Face's GPT2LMHeadModel built from its config on the meta device (no
download, no weights), bf16 mixed precision (fp32 weights, forward and loss under autocast),
torch's AdamW in steady state, a Trainer-style loop (the output is released once the loss exists:
``keep_outputs=False``, the CLI's ``--drop-outputs``), activation checkpointing of every block
(``checkpoint="blocks"``: ``torch.utils.checkpoint`` on each ``GPT2Block``, traced with its
recomputation), CUDA's kernel choices, and the caching allocator's reserve (replayed). Assumed:
the CUDA context and cuBLAS workspace (PyTorch's defaults); not measured on a GPU. B and S are
symbols: one trace per configuration; the largest batch is solved from the formula at S=1024 (the
model's own limit is 1024 positions, so S cannot grow past it).
"""

import argparse
import time

import torch
import transformers

import memsim
from memsim.analysis.budget import against
from memsim.analysis.gpus import gpu
from memsim.render import largest, verdict


def config(small: bool = False) -> dict:
    if small:
        return dict(gpt2=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64),
                    device="cpu", point={"B": 4, "S": 32})
    return dict(gpt2=dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
                device="cuda", point={"B": 8, "S": 1024})


INPUTS = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def main(small: bool = False) -> None:
    c = config(small)
    start = time.perf_counter()
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**c["gpt2"]))
    n = sum(p.numel() for p in model.parameters())
    card = None if small else gpu("rtx-4090")
    pt = c["point"]
    print(f"GPT-2: {c['gpt2']['n_layer']} layers, hidden {c['gpt2']['n_embd']}, {n:,} parameters; "
          f"full fine-tuning, bf16-mixed, AdamW, output dropped after the loss (Trainer), "
          f"device {c['device']}")
    print("against " + ("a 16 MiB budget (CPU: the exact peak of live tensors)" if small else
                        f"{card.name} ({card.mib:,} MiB); fits when total <= 90% of it"))
    for label, ckpt in (("no checkpointing", None), ("checkpointing every block", "blocks")):
        report = memsim.analyze(model, INPUTS, device=c["device"], precision="bf16-mixed",
                                keep_outputs=False, inference=False, checkpoint=ckpt)
        bud = against(report, pt, gpu=card, capacity=16 * 2 ** 20 if small else None)
        print(f"  {label}, B={pt['B']}, S={pt['S']}: {verdict(bud)}")
        print(f"    largest batch that fits at S={pt['S']}: {largest(bud, 'batch')}")
    print(f"(analysed in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny configuration that runs in seconds")
    main(p.parse_args().small)

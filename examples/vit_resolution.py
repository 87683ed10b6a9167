"""A vision transformer at growing resolution on an 80 GB card: the peak at each image size, and
the largest batch that fits at each.

    python examples/vit_resolution.py            # ViT-Large/16 at 224 ... 1024 on an H100 80GB
    python examples/vit_resolution.py --small    # a 2-layer, 32-wide ViT at 16 ... 48 on the CPU

Modelled (traced): Hugging Face's ViTForImageClassification (ViT-Large/16: hidden 1024, 24
layers, 16 heads, MLP 4096, patch 16, 1000 classes; no torchvision) built from its config on the
meta device, one configuration per resolution (the number of patches, (R/16)^2 + 1 tokens with
the class token, is fixed by the image size, so each resolution is its own trace with the batch B
as the symbol); the plain training loop with the labels passed in (the model's cross-entropy
loss), bf16 mixed precision (fp32 weights, forward under autocast), torch's AdamW in steady
state, CUDA's kernel choices (the attention as PyTorch's SDPA picks it) and the caching
allocator's reserve (replayed). Assumed: the CUDA context and cuBLAS workspace (PyTorch's
defaults); not measured on a GPU. The small form runs on the CPU, where the budget is the exact
peak of live tensors (a real CPU run gives the same bytes: tests/test_examples.py).
"""

import argparse
import time

import torch
import transformers

import memsim
from memsim.analysis.budget import against
from memsim.analysis.gpus import gpu
from memsim.render import largest, verdict

VIT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                 intermediate_size=4096, patch_size=16, num_labels=1000)
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            patch_size=8, num_labels=10)


def config(small: bool = False) -> dict:
    if small:
        return dict(vit=TINY, resolutions=(16, 32, 48), device="cpu", batch=4)
    return dict(vit=VIT_LARGE, resolutions=(224, 384, 512, 768, 1024), device="cuda", batch=32)


def model(resolution: int, small: bool = False) -> torch.nn.Module:
    """The ViT for one image size (on the current device: the script builds it on meta)."""
    return transformers.ViTForImageClassification(
        transformers.ViTConfig(image_size=resolution, **config(small)["vit"]))


def inputs(resolution: int) -> dict:
    return {"pixel_values": ("float32", ["B", 3, resolution, resolution]),
            "labels": ("int64", ["B"])}


def main(small: bool = False) -> None:
    c = config(small)
    start = time.perf_counter()
    transformers.logging.set_verbosity_error()
    card = None if small else gpu("h100-80gb")
    v = c["vit"]
    print(f"ViT: {v['num_hidden_layers']} layers, hidden {v['hidden_size']}, patch "
          f"{v['patch_size']}; bf16-mixed, AdamW, device {c['device']}, at B={c['batch']}")
    print("against " + ("a 2 MiB budget (CPU: the exact peak of live tensors)" if small else
                        f"{card.name} ({card.mib:,} MiB); fits when total <= 90% of it"))
    for res in c["resolutions"]:
        with torch.device("meta"):
            m = model(res, small)
        report = memsim.analyze(m, inputs(res), device=c["device"], precision="bf16-mixed",
                                inference=False)
        bud = against(report, {"B": c["batch"]}, gpu=card, capacity=2 * 2 ** 20 if small else None)
        tokens = (res // v["patch_size"]) ** 2 + 1
        print(f"  {res}x{res} ({tokens} tokens): {verdict(bud)}; largest batch: "
              f"{largest(bud, 'batch')}")
    print(f"(analysed in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny configuration that runs in seconds")
    main(p.parse_args().small)

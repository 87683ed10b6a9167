"""Your own CNN on a 24 GB card: what is the largest batch that fits at 224x224?

    python examples/own_cnn.py            # the question: an RTX 4090 (24 GB), 224x224 images
    python examples/own_cnn.py --small    # a tiny CNN on 32x32 images, CPU, a 4 MiB budget

Modelled (traced): the model below built on the meta device, the plain training loop
(``zero_grad``, forward, the loss, ``backward()``, ``optimizer.step()``; the loss is returned by
``forward``), fp32, torch's AdamW in steady state (moments present), BatchNorm's running
statistics, CUDA's kernel choices and 512-byte blocks, the caching allocator's reserve (the
step's allocations replayed through PyTorch 2.13's rules). Assumed: the CUDA context
(400 MiB on an Ada card) and cuBLAS workspace (PyTorch's defaults); cuDNN's convolution
workspaces are not modelled; nothing of this was measured on a GPU. The batch is a symbol: one
trace gives the peak as a formula in B, and the largest batch is solved from it (checked at the
answer and the next size). The small form runs on the CPU, where the budget is the exact peak of
live tensors (a real CPU run gives the same bytes: tests/test_examples.py).
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import memsim
from memsim.analysis.budget import against
from memsim.analysis.gpus import gpu
from memsim.render import largest, verdict


def stage(cin: int, cout: int) -> nn.Sequential:
    """Two 3x3 convolutions with BatchNorm and ReLU, then a 2x2 max-pool (VGG-style)."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True), nn.MaxPool2d(2))


class CNN(nn.Module):
    """Stages of conv-BN-ReLU x2 + max-pool, global average pooling, a linear classifier; the
    forward returns the cross-entropy loss."""

    def __init__(self, widths=(64, 128, 256, 512), classes=1000):
        super().__init__()
        chans = (3, *widths)
        self.features = nn.Sequential(*(stage(a, b) for a, b in zip(chans, chans[1:])))
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x, labels):
        x = F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        return F.cross_entropy(self.head(x), labels)


def config(small: bool = False) -> dict:
    """The question's sizes (the test builds the same model for its real CPU run)."""
    if small:
        return dict(widths=(8, 16), classes=10, image=32, device="cpu", batches=(4, 16, 64))
    return dict(widths=(64, 128, 256, 512), classes=1000, image=224, device="cuda",
                batches=(32, 64, 128, 256))


def inputs(small: bool = False) -> dict:
    c = config(small)
    return {"x": ("float32", ["B", 3, c["image"], c["image"]]), "labels": ("int64", ["B"])}


def main(small: bool = False) -> None:
    c = config(small)
    start = time.perf_counter()
    with torch.device("meta"):
        model = CNN(c["widths"], c["classes"])
    n = sum(p.numel() for p in model.parameters())
    report = memsim.analyze(model, inputs(small), device=c["device"], inference=False)
    card = None if small else gpu("rtx-4090")
    where = ("a 4 MiB budget (CPU: the exact peak of live tensors)" if small else
             f"{card.name} ({card.mib:,} MiB); fits when total <= 90% of it")
    print(f"own CNN: {len(c['widths'])} stages (conv-BN-ReLU x2, max-pool), {n:,} "
          f"parameters, {c['image']}x{c['image']} images, fp32, AdamW, device {c['device']}")
    print(f"against {where}")
    for b in c["batches"]:
        bud = against(report, {"B": b}, gpu=card, capacity=4 * 2 ** 20 if small else None)
        print(f"  B={b}: {verdict(bud)}")
    print(f"largest batch that fits at {c['image']}x{c['image']}: {largest(bud, 'batch')}")
    print(f"(analysed in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny configuration that runs in seconds")
    main(p.parse_args().small)

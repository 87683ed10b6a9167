"""Checkpointing plans on a CNN: a small ResNet (stem, 4 identical residual blocks with
BatchNorm, pool, linear), plans applied with torch.utils.checkpoint, re-traced, and compared with
a real eager CPU run of the same checkpointed model (byte for byte).

BatchNorm in train mode updates its running statistics in place; non-reentrant checkpointing
runs the block's forward again in backward, so a real run updates them twice. In place on
existing buffers: no new storage, so the memory figures are unaffected."""

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from memsim.strategies.checkpoint import apply_checkpointing, blocks, named_plan, optimal_plan

from tests.support.oracles.measure import example_inputs, measure_train
from tests.support.predict import check, predict

IMG = {"x": ("float32", ["B", 3, "H", 8])}
POINTS = [{"B": 2, "H": 8}, {"B": 3, "H": 12}]


class ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN, plus the skip, then ReLU."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, c=8, n=4, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU())
        self.layers = nn.ModuleList(ResBlock(c) for _ in range(n))
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.stem(x)
        for b in self.layers:
            x = b(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


@functools.lru_cache(maxsize=None)
def plain():
    return predict(ResNet, IMG, inference=False)


def with_plan(plan_name):
    def factory():
        m = ResNet()
        return apply_checkpointing(m, named_plan(m, plan_name))
    return factory


def test_blocks_found():
    m = ResNet()
    assert blocks(m) == [f"layers.{i}" for i in range(4)]
    assert named_plan(m, "every:2") == ["layers.0", "layers.2"]


def test_no_plan_matches_real_run():
    check(plain(), ResNet, IMG, POINTS)


@pytest.mark.parametrize("plan", ["blocks", "every:2"])
def test_named_plans_match_real_run(plan):
    report = predict(with_plan(plan), IMG, inference=False)
    check(report, with_plan(plan), IMG, POINTS)
    pt = POINTS[-1]
    assert report.at(**pt)["train"]["saved_activations"] < \
        plain().at(**pt)["train"]["saved_activations"]


_SHARED: dict = {}


# Real peaks at B 4, H 16 with the first 0, 1, 2, 3 blocks checkpointed: 396,388, 347,108,
# 297,828 and 248,548 B: at 95%, 85% and 70% of the first, 1, 2 and 3 blocks are needed
@pytest.mark.parametrize("frac,fewest", [(0.95, 1), (0.85, 2), (0.7, 3)])
def test_optimal_plan_fits_with_fewest_blocks_real_run(frac, fewest):
    """The blocks search's plan: leading blocks, as many as real runs need (the plan fits, one
    block fewer does not), its prediction equal to a real run of it, and its recompute FLOPs
    those of real steps (FlopCounterMode: the plan's step less the plain one)."""
    with torch.device("meta"):
        m = ResNet()
    pt = {"B": 4, "H": 16}
    none = plain()
    budget = int(none.at(**pt)["train"]["peak"] * frac)
    res = optimal_plan(m, IMG, pt, budget, device="cpu", base=none, cache=_SHARED,
                       search="blocks")
    assert res is not None and res.plan == blocks(m)[:fewest]
    assert res.report.at(**pt)["train"]["peak"] <= budget
    assert _real(fewest, **pt).peak <= budget < _real(fewest - 1, **pt).peak
    check(res.report, lambda: apply_checkpointing(ResNet(), res.plan), IMG, [pt])
    # per block, its two 3x3 convolutions (8 to 8 channels) recomputed over B*H*W = 4*16*8
    # pixels, 2*m*n*k each: 2 x 2*512*(8*9)*8 = 1,179,648
    assert res.report.train.evaluate(res.recompute_flops, pt) == fewest * 1_179_648 == \
        _real(fewest, **pt).flops - _real(0, **pt).flops


@functools.lru_cache(maxsize=None)
def _real(checkpointed: int, B: int, H: int) -> SimpleNamespace:
    """A real CPU step of the ResNet at ``B`` and ``H`` with its first ``checkpointed``
    blocks under non-reentrant torch.utils.checkpoint (wrapped here, not by memsim): its peak,
    and the FLOPs FlopCounterMode counts over a second step."""
    from torch.utils.checkpoint import checkpoint
    from torch.utils.flop_counter import FlopCounterMode

    def build():
        torch.manual_seed(0)
        m = ResNet()
        for b in m.layers[:checkpointed]:
            b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False)
        return m

    peak = measure_train(build(), example_inputs(IMG, {"B": B, "H": H})).peak
    x = torch.randn(B, 3, H, 8)
    with FlopCounterMode(display=False) as fc:
        build()(x).sum().backward()
    return SimpleNamespace(peak=peak, flops=fc.get_total_flops())

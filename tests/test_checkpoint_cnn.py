"""Checkpointing plans on a CNN: a small ResNet (stem, 4 identical residual blocks with
BatchNorm, pool, linear), plans applied with torch.utils.checkpoint, re-traced, and compared with
a real eager CPU run of the same checkpointed model (byte for byte).

BatchNorm in train mode updates its running statistics in place; non-reentrant checkpointing
runs the block's forward again in backward, so a real run updates them twice. In place on
existing buffers: no new storage, so the memory figures are unaffected."""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from oracle import check, predict
from memsim.strategies.checkpoint import apply_checkpointing, blocks, named_plan, optimal_plan

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


@pytest.mark.parametrize("frac", [0.95, 0.85, 0.7])
def test_optimal_plan_fits_with_fewest_blocks_real_run(frac):
    with torch.device("meta"):
        m = ResNet()
    pt = {"B": 4, "H": 16}
    none = plain()
    budget = int(none.at(**pt)["train"]["peak"] * frac)
    res = optimal_plan(m, IMG, pt, budget, device="cpu", base=none, cache=_SHARED,
                       search="blocks")
    assert res is not None and res.plan == blocks(m)[:len(res.plan)]
    k = len(res.plan)
    assert k >= 1
    assert res.report.at(**pt)["train"]["peak"] <= budget
    if k > 1:  # one block fewer does not fit
        fewer = _SHARED.get(k - 1)
        fewer = fewer.report if fewer is not None else predict(
            lambda: apply_checkpointing(ResNet(), blocks(ResNet())[:k - 1]), IMG,
            inference=False)
        assert fewer.at(**pt)["train"]["peak"] > budget
    check(res.report, lambda: apply_checkpointing(ResNet(), res.plan), IMG, [pt])
    assert res.recompute_flops != 0

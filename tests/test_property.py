"""Property: for random small MLP / conv stacks, prediction == a real eager CPU run."""

import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.predict import check, predict

ACTS = [nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU, lambda: nn.Dropout(0.2), nn.Identity]


@st.composite
def mlp_stacks(draw):
    widths = draw(st.lists(st.integers(1, 24), min_size=1, max_size=4))
    acts = draw(st.lists(st.sampled_from(range(len(ACTS))), min_size=len(widths),
                         max_size=len(widths)))
    d_in = draw(st.integers(1, 16))
    batch = draw(st.lists(st.integers(2, 40), min_size=3, max_size=3, unique=True))
    def factory():
        layers, d = [], d_in
        for w, a in zip(widths, acts):
            layers += [nn.Linear(d, w), ACTS[a]()]
            d = w
        return nn.Sequential(*layers)
    return factory, {"input": ("float32", ["B", d_in])}, [{"B": b} for b in batch]


@st.composite
def conv_stacks(draw):
    chans = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
    norm = draw(st.booleans())
    pool = draw(st.booleans())
    hw = draw(st.integers(6, 12))
    batch = draw(st.lists(st.integers(2, 9), min_size=3, max_size=3, unique=True))
    def factory():
        layers, c = [], 3
        for k in chans:
            layers.append(nn.Conv2d(c, k, 3, padding=1))
            if norm:
                layers.append(nn.BatchNorm2d(k))
            layers.append(nn.ReLU())
            c = k
        if pool:
            layers.append(nn.MaxPool2d(2))
        layers.append(nn.Flatten())
        return nn.Sequential(*layers)
    return factory, {"input": ("float32", ["B", 3, hw, hw])}, [{"B": b} for b in batch]


SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(mlp_stacks())
def test_random_mlps(case):
    factory, inputs, points = case
    check(predict(factory, inputs), factory, inputs, points)


@SETTINGS
@given(conv_stacks())
def test_random_convs(case):
    factory, inputs, points = case
    check(predict(factory, inputs), factory, inputs, points)

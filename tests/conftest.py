import os
import sys

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))


def grid(**axes):
    """Every combination of the given values: grid(B=(2, 3), S=(4, 9)) -> 4 points."""
    import itertools

    names = list(axes)
    return [dict(zip(names, vals)) for vals in itertools.product(*axes.values())]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield

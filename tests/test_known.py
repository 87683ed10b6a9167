"""memsim.tracer.known: which storages hold only ones, followed op by op (Hugging Face's mask
code drops a mask it can prove all ones; tests/test_hf.py checks that against real runs)."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memsim.tracer import known


class _Observed(TorchDispatchMode):
    """What the recorder does for each op: run it, then ``known.observe``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        known.observe(func, args, kwargs, out)
        return out


def test_ones_are_followed_through_copies_and_views_and_forgotten_when_written():
    with known.tracking(), FakeTensorMode(), _Observed():
        ones = torch.ones(3, 5)
        assert known.all_ones(ones)
        mask = ones.to(torch.bool)                  # a copy keeps the values
        assert known.all_ones(mask)
        assert known.all_ones(mask[:, 1:])          # a view shares the storage
        assert known.all_ones(mask[:, torch.arange(2)])  # an index reads only ones
        assert known.all_ones(torch.full((2,), 1.0)) and known.all_ones(ones.new_ones(4))
        assert not known.all_ones(torch.full((2,), 2.0))
        assert not known.all_ones(torch.zeros(3))
        assert not known.all_ones(mask + 0)          # arithmetic is not followed
        mask[:, 0] = False                           # a write through a view forgets the storage
        assert not known.all_ones(mask) and not known.all_ones(mask[:, 1:])
        given = torch.empty(2, 4)
        known.mark(given)                            # an input given with fill="ones"
        assert known.all_ones(given)
        given.add_(1)
        assert not known.all_ones(given)
    assert not known.all_ones(ones)                  # nothing is known outside a run

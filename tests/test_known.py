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
        assert not known.all_ones(mask + 1) and known.all_ones(mask + 0)  # shifted values
        assert not known.all_ones(ones.exp())        # other arithmetic is not followed
        mask[:, 0] = False                           # a write through a view forgets the storage
        assert not known.all_ones(mask) and not known.all_ones(mask[:, 1:])
        given = torch.empty(2, 4)
        known.mark(given)                            # an input given with fill="ones"
        assert known.all_ones(given)
        given.add_(1)
        assert not known.all_ones(given)
    assert not known.all_ones(ones)                  # nothing is known outside a run


def test_zeros_pools_reductions_and_a_healthy_steps_checks():
    """Zeros are followed too; max pooling, nearest resizing and max/min reductions keep a
    uniform value (CANINE pools its mask of ones, DETR resizes one); ``all``/``any`` and
    negation decide from it; a healthy step's finite checks (``torch.isfinite``, which is
    ``(x == x) * (x.abs() != inf)``, ``isnan``, ``isinf``) hold, and reading one is noted."""
    import torch.nn.functional as F
    with known.tracking() as run, FakeTensorMode(), _Observed():
        ones = torch.ones(3, 1, 8)
        assert known.value(torch.zeros(2)) == 0
        assert known.value(F.max_pool1d(ones, 4)) == 1
        assert known.value(F.interpolate(ones, size=5)) == 1             # nearest
        assert known.value(F.interpolate(ones, size=5, mode="linear")) is None
        assert known.value(ones.amax(-1)) == 1 and known.value(ones.max(-1).values) == 1
        assert known.value(ones.to(torch.bool).all()) == 1
        assert known.value(~torch.zeros(2, dtype=torch.bool)) == 1
        h = torch.empty(4, 8)                                             # no values known
        finite = torch.isfinite(h).all()
        assert known.value(finite) == 1 and not run.assumed               # noted when read
        assert known.value(torch.isnan(h).any()) == 0
        assert known.value(torch.isinf(h).any() | torch.isnan(h).any()) == 0
        assert known.read(finite) == 1 and len(run.assumed) == 1
        assert known.value(torch.isfinite(torch.zeros(3, dtype=torch.int64))) == 1
        assert known.value(ones > 0) == 1 and known.value(torch.zeros(2) >= 1) == 0
        assert known.read(ones == ones) == 1 and len(run.assumed) == 1   # known: no NaN


def test_a_distributions_check_of_its_parameters_holds_and_is_noted():
    """torch.distributions validates its parameters (``if not torch._is_all_true(valid)``):
    values a symbolic run does not have; the check holds in any run that goes past it (GroupViT
    draws Gumbel noise in training), and reading it is noted."""
    with known.tracking() as run, FakeTensorMode(), _Observed():
        loc, scale = torch.empty(3), torch.empty(3)
        valid = torch._is_all_true(scale > 0)
        assert known.value(valid) == 1 and not run.assumed
        assert known.read(valid) == 1 and "torch.distributions" in run.assumed[0]
        assert known.value(torch._is_all_true(torch.zeros(2, dtype=torch.bool))) == 0


def test_bounds_of_values_and_sizes_read_back():
    """Longformer's global-attention check: a mask of ones padded with zeros, clamped, made 0
    or the dtype's minimum by ``where``, is never > 0, though its values differ; an index
    known all False writes nothing; indices from ``arange`` are >= 0 (Hugging Face's
    bidirectional masks); ``torch.div`` of sizes gives a size back from ``.item()``."""
    import torch.nn.functional as F
    with known.tracking(), FakeTensorMode(), _Observed():
        ones = torch.ones(2, 6, dtype=torch.long)
        padded = F.pad(ones, (0, 2), value=0)
        assert known.value(padded) is None
        mask = padded.clamp(0, 1).to(torch.bool)
        ext = torch.where(mask, torch.zeros(()), torch.scalar_tensor(-3.4e38))
        assert known.value(ext) is None
        ext[padded == 2] = 3.4e38                       # no element is 2: nothing written
        assert known.value((ext > 0).flatten().any()) == 0
        assert known.value((ext <= 0).all()) == 1 and known.value((ext < 0).any()) is None
        idx = torch.arange(8)[None, :] + 0
        assert known.value(idx >= 0) == 1 and known.value(idx > 0) is None
        assert known.value(torch.ones((), dtype=torch.bool) & (idx >= 0)) == 1
        ext[mask] = 1.0                                 # a write forgets what was known
        assert known.value((ext > 0).any()) is None
        n = torch.div(8, 4, rounding_mode="trunc") - 1
        assert known.value(n) == 1 and known.value(n * 3) == 3

"""Where PyTorch's fake (meta) kernels make other tensors than its CPU kernels: a sweep.

memsim traces with fake tensors, so an op whose fake kernel sizes or lays out its output
otherwise than the real kernel gives other bytes (a loss that keeps a larger storage than its
scalar) or another path (a later view that copies in one and not in the other). For every
OpInfo of PyTorch's own test suite, its first samples in float32 on the CPU run twice: with
their inputs as given, and with every input of two or more dimensions transposed in its last
two (same values, the layout a ``transpose`` gives). Each runs with real tensors and under
``FakeTensorMode``, then takes the gradients of its outputs' sums. An output or gradient whose
storage size or strides differ is listed, with the ATen ops of the fake run that memsim has a
rule for (``tracer/kernels.py``; a rule makes the real kernel's tensors in a trace)::

    pip install expecttest                 # torch.testing._internal needs it
    python benchmarks/fake_kernels.py      # about 5 minutes on 2 cores

Strides of size-1 dimensions and of empty tensors are not compared (they do not change a
layout).
"""

from __future__ import annotations

import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _transposed(t):
    import torch
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dim() >= 2 \
            and t.shape[-1] > 1 and t.shape[-2] > 1:
        out = t.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
        return out.requires_grad_(t.requires_grad)
    return t


def _described(tensors) -> list:
    return [(tuple(t.shape), t.stride(), t.untyped_storage().nbytes()) for t in tensors]


def _run(fn, args, kwargs):
    """Outputs and gradients (of the outputs' sums) of ``fn(*args, **kwargs)``."""
    import torch
    from torch.utils._pytree import tree_flatten
    out = fn(*args, **kwargs)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    leaves = [t for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor) and t.requires_grad]
    diff = [t for t in outs if t.requires_grad]
    grads = []
    if diff and leaves:
        grads = [g for g in torch.autograd.grad([t.sum() for t in diff], leaves,
                                                allow_unused=True) if g is not None]
    return outs, grads


def main() -> None:
    sys.path.insert(0, ROOT)
    warnings.filterwarnings("ignore")
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    import memsim  # noqa: F401 - registers memsim's rules
    from memsim.tracer.rules import Kind, lookup

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    found: dict = {}
    for op in op_db:
        try:
            samples = list(op.sample_inputs("cpu", torch.float32,
                                            requires_grad=op.supports_autograd))[:4]
        except Exception:  # noqa: BLE001 - an OpInfo without float32 CPU samples
            continue
        for layout, change in (("as given", lambda t: t), ("transposed", _transposed)):
            for si in samples:
                args = tree_map(change, (si.input,) + tuple(si.args))
                kwargs = tree_map(change, dict(si.kwargs))
                try:
                    real = _run(op.op, args, kwargs)
                    mode, ops = FakeTensorMode(), Ops()
                    fake_in = tree_map(lambda t: mode.from_tensor(t)
                                       if isinstance(t, torch.Tensor) else t, (args, kwargs))
                    with mode, ops:
                        fake = _run(op.op, *fake_in)
                    pairs = [(w, a, b) for w, (ra, fa) in zip(("output", "gradient"),
                                                              zip(real, fake))
                             if len(ra) == len(fa)
                             for a, b in zip(_described(ra), _described(fa))]
                except Exception:  # noqa: BLE001 - a sample the real or fake kernel refuses
                    continue
                for what, a, b in pairs:
                    if a[0] != b[0] or 0 in a[0]:
                        continue
                    size = a[2] != b[2]
                    strides = [s for s, n in zip(a[1], a[0]) if n > 1] != \
                        [s for s, n in zip(b[1], b[0]) if n > 1]
                    if not (size or strides):
                        continue
                    key = (op.name, op.variant_test_name, what, "bytes" if size else "strides")
                    if key in found:
                        continue
                    rules = sorted({str(f) for f in ops.seen
                                    if lookup(Kind.ATEN, f, "cpu") is not None})
                    found[key] = (layout, a, b, rules)
    print("| op | what | differs | inputs | real (shape, strides, bytes) | fake | memsim rule |")
    print("|---|---|---|---|---|---|---|")
    for (name, variant, what, kind), (layout, a, b, rules) in sorted(found.items()):
        label = f"{name}.{variant}" if variant else name
        print(f"| {label} | {what} | {kind} | {layout} | {a} | {b} | "
              f"{', '.join(rules) if rules else 'none'} |")
    uncovered = sum(1 for v in found.values() if not v[3])
    print(f"\n{len(found)} differences, {uncovered} without a rule of memsim's among the ops")


if __name__ == "__main__":
    main()

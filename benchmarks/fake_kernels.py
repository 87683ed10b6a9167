"""Where PyTorch's fake (meta) kernels make other tensors than its CPU kernels: a sweep.

memsim traces with fake tensors, so an op whose fake kernel sizes or lays out its output
otherwise than the real kernel gives other bytes (a loss that keeps a larger storage than its
scalar) or another path (a later view that copies in one and not in the other). For every
OpInfo of PyTorch's own test suite, its first 4 samples in float32 on the CPU run with their
inputs as given, and with every input of two or more dimensions transposed in its last two
(same values, the layout a ``transpose`` gives); its first 4 samples with a non-empty input of
four or five dimensions run with those inputs channels-last. Each runs with real tensors,
under ``FakeTensorMode``, and under ``FakeTensorMode`` with memsim's ATen rules applied as its
recorder applies them (``tracer/kernels.py``; a rule makes the real kernel's tensors in a
trace), then takes the gradients of its outputs' sums. An output or gradient whose storage size or strides differ
between the real and the fake run is listed, with the ATen ops of the fake run that memsim has
a rule for, and whether the run with the rules equals the real one. A difference the rules
bring in (the real and fake runs equal, the rules' run not) is listed too: a rule of memsim's
that is wrong there::

    pip install expecttest                 # torch.testing._internal needs it
    python -m benchmarks.fake_kernels      # about 7 minutes on 2 cores
    python -m benchmarks.fake_kernels nn.functional.pad   # some OpInfos, by name

Strides of size-1 dimensions and of empty tensors are not compared (they do not change a
layout).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import warnings


def _transposed(t):
    import torch
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dim() >= 2 \
            and t.shape[-1] > 1 and t.shape[-2] > 1:
        out = t.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
        return out.requires_grad_(t.requires_grad)
    return t


def _channels_last(t):
    import torch
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dim() in (4, 5):
        fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
        return t.detach().contiguous(memory_format=fmt).requires_grad_(t.requires_grad)
    return t


class _Recorder:
    """What memsim's rules read of the recorder, for one op run outside a trace."""

    phase = None
    device = "cpu"
    module = None

    def scratch(self, t) -> None:
        pass


def _differ(a, b) -> str | None:
    """``"bytes"``, ``"strides"`` (of dimensions larger than 1) or None."""
    if a[2] != b[2]:
        return "bytes"
    if [s for s, n in zip(a[1], a[0]) if n > 1] != [s for s, n in zip(b[1], b[0]) if n > 1]:
        return "strides"
    return None


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
    warnings.filterwarnings("ignore")
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    import memsim  # noqa: F401 - registers memsim's rules
    from memsim.tracer import MemsimError
    from memsim.tracer.records import Phase
    from memsim.tracer.rules import Kind, lookup

    _Recorder.phase = Phase.FORWARD

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func)
            return func(*args, **(kwargs or {}))

    class Rules(TorchDispatchMode):
        """memsim's ATen rules for the CPU, applied as its recorder applies them."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            rule = lookup(Kind.ATEN, func, "cpu")
            if rule is None:
                return func(*args, **(kwargs or {}))
            return rule.value(_Recorder(), func, args, kwargs or {})

    def fake_run(fn, args, kwargs, *extra):
        mode = FakeTensorMode()
        fake_in = tree_map(lambda t: mode.from_tensor(t)
                           if isinstance(t, torch.Tensor) else t, (args, kwargs))
        with mode, contextlib.ExitStack() as stack:
            for m in extra:
                stack.enter_context(m)
            return _run(fn, *fake_in)

    def described(run):
        return [(w, x) for w, ts in zip(("output", "gradient"), run) for x in _described(ts)]

    torch.manual_seed(0)
    found: dict = {}
    only = set(sys.argv[1:])
    for op in op_db:
        if only and op.name not in only:
            continue
        try:
            every = list(itertools.islice(op.sample_inputs(
                "cpu", torch.float32, requires_grad=op.supports_autograd), 60))
        except Exception:  # noqa: BLE001 - an OpInfo without float32 CPU samples
            continue
        for layout, change in (("as given", lambda t: t), ("transposed", _transposed),
                               ("channels-last", _channels_last)):
            # the first 4 samples; channels-last: the first 4 with a non-empty 4-D or 5-D
            # tensor
            samples = every[:4] if layout != "channels-last" else [
                si for si in every if any(isinstance(t, torch.Tensor) and t.dim() in (4, 5)
                                          and t.numel() for t in tree_flatten(
                                              (si.input, si.args))[0])][:4]
            for si in samples:
                args = tree_map(change, (si.input,) + tuple(si.args))
                kwargs = tree_map(change, dict(si.kwargs))
                try:
                    real = described(_run(op.op, args, kwargs))
                    ops = Ops()
                    fake = described(fake_run(op.op, args, kwargs, ops))
                except Exception:  # noqa: BLE001 - a sample the real or fake kernel refuses
                    continue
                try:
                    ruled = described(fake_run(op.op, args, kwargs, Rules()))
                except MemsimError:     # a rule's own refusal (.item() in forward...)
                    ruled = fake
                except Exception as e:  # noqa: BLE001 - a rule that fails is a finding
                    ruled = f"the rules' run failed: {type(e).__name__}"
                if len(real) != len(fake):
                    continue
                rules = sorted({str(f) for f in ops.seen
                                if lookup(Kind.ATEN, f, "cpu") is not None})
                for i, ((what, a), (_, b)) in enumerate(zip(real, fake)):
                    if a[0] != b[0] or 0 in a[0]:
                        continue
                    c = ruled if isinstance(ruled, str) else \
                        (ruled[i][1] if len(ruled) == len(real) else "another number of tensors")
                    after = c if isinstance(c, str) else (_differ(a, c) or "same")
                    kind = _differ(a, b)
                    if kind is None and after == "same":
                        continue
                    kind = kind or f"only with memsim's rules ({after})"
                    key = (op.name, op.variant_test_name, what, kind)
                    if key not in found:
                        found[key] = (layout, a, b, rules, after)
    print("| op | what | differs | inputs | real (shape, strides, bytes) | fake | memsim rule "
          "| with the rules |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, variant, what, kind), (layout, a, b, rules, after) in sorted(found.items()):
        label = f"{name}.{variant}" if variant else name
        print(f"| {label} | {what} | {kind} | {layout} | {a} | {b} | "
              f"{', '.join(rules) if rules else 'none'} | {after} |")
    fake = [v for k, v in found.items() if not k[3].startswith("only")]
    uncovered = sum(1 for v in fake if not v[3])
    fixed = sum(1 for v in fake if v[4] == "same")
    brought = len(found) - len(fake)
    print(f"\n{len(fake)} differences of the fake kernels: {fixed} made equal by memsim's "
          f"rules, {uncovered} without a rule of memsim's among the ops; {brought} brought "
          "in by a rule")


if __name__ == "__main__":
    main()

"""The oracle: run the same step for real on CPU and count live tensor storages.

This is what memsim's predictions are tested against. It imports nothing of memsim: a real
eager run, real tensors, and a dispatch mode that adds each new untyped storage an op returns and
subtracts it when a ``weakref.finalize`` on the storage fires (the method of
``torch.distributed._tools.mem_tracker.MemTracker``, which the tests use as a cross-check).

The step is the plain loop, after one warm-up step so that optimizer state exists::

    opt.zero_grad(set_to_none=True)
    out = model(**inputs)     # the previous step's output is released here
    loss = loss_fn(out)       # the previous loss here
    loss.backward()
    opt.step()

The previous step's output and loss are those of one real forward, loss and backward run
before the measured step, held by ``out`` and ``loss`` when it starts, as a loop that rebinds
the names holds them. With ``keep_outputs=False`` the output is dropped once the loss is
computed (only the loss is kept, as Hugging Face's Trainer does).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .common import ChangeLog, default_loss, held_tensors


@dataclass(frozen=True)
class Measurement:
    """Bytes measured in one real run (CPU, live untyped storages)."""

    peak: int
    parameters: int
    gradients: int
    optimizer_states: int
    saved_at_backward: int  # all bytes live when backward starts, minus those live before forward
    # bytes autograd saved for backward (its saved-tensor pack hook saw them) still live when
    # backward starts, without parameters, buffers, inputs, gradients or optimizer states
    saved_activations: int = 0
    # most bytes live at once that are not parameters, gradients or optimizer states (old or
    # new): activations, temporaries, buffers, inputs, the output and the loss
    activation_peak: int = 0
    # per module path (the root left out): the bytes of saved_activations that ops inside the
    # module (or its submodules) saved
    saved_by_module: dict = field(default_factory=dict)
    # the live bytes after each change of the step (an allocation, a free or a resize of a
    # non-empty storage), in order, from the state it starts in
    series: list = field(default_factory=list)


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.cur = 0
        self.peak = 0
        self._fin: list = []
        self.log = ChangeLog()

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.live:
            n = st.nbytes()
            if n != self.live[key]:  # resized in place
                self.cur += n - self.live[key]
                self.log.resize(key, n - self.live[key])
                self.live[key] = n
                self.peak = max(self.peak, self.cur)
            return
        self.live[key] = st.nbytes()
        self.log.alloc(key, st.nbytes())
        self.cur += st.nbytes()
        self.peak = max(self.peak, self.cur)
        self._fin.append(weakref.finalize(st, self._drop, key))

    def token_of(self, t: torch.Tensor) -> int:
        return self.log.tokens[id(t.untyped_storage())]

    def _drop(self, key: int) -> None:
        n = self.live.pop(key)
        self.log.free(key, n)
        self.cur -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            # a FakeTensor (FlexAttention traces its score_mod graphs on a FakeTensorMode of its
            # own) has a meta storage: no memory
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
                self.add(t)
        return out

    def close(self):
        for f in self._fin:
            f.detach()


def _count_higher_order_ops() -> None:
    """FlexAttention's higher-order ops under the counting mode: a dispatch mode must say how
    it runs them. The counter runs what the eager op runs below autograd (its
    CompositeExplicitAutograd kernels, the unfused forward and backward) with itself active,
    so that each of their ATen ops is counted."""
    import importlib
    try:
        importlib.import_module("torch._higher_order_ops.flex_attention")
    except ImportError:  # pragma: no cover - older torch
        return
    fa = sys.modules["torch._higher_order_ops.flex_attention"]

    @fa.flex_attention.py_impl(_Counter)
    def _forward(mode, *args, **kwargs):
        with mode:
            return fa.sdpa_dense(*args, **kwargs)

    @fa.flex_attention_backward.py_impl(_Counter)
    def _backward(mode, *args, **kwargs):
        with mode:
            return fa.sdpa_dense_backward(*args, **kwargs)


_count_higher_order_ops()


def materialize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give a meta-device model real CPU storage with small random values (in place)."""
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model.to_empty(device="cpu")
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * 0.02)
                else:
                    t.zero_()
    return model


def _spec(value) -> tuple[torch.dtype, list, str | None] | None:
    """``(dtype, shape, fill)`` of a tensor input given as ``(dtype, shape[, fill])`` with
    ``dtype`` a name such as ``"int64"``, or None for a constant passed to ``forward``."""
    if not (isinstance(value, (tuple, list)) and len(value) in (2, 3)
            and isinstance(value[1], (tuple, list))):
        return None
    dtype = value[0] if isinstance(value[0], torch.dtype) else \
        getattr(torch, str(value[0]).removeprefix("torch."))
    return dtype, list(value[1]), value[2] if len(value) == 3 else None


def example_inputs(inputs: dict, point: dict[str, int], seed: int = 0) -> dict:
    """Concrete tensors for ``{name: (dtype, shape[, fill])}`` at ``point``: ints are 0 (an
    attention mask of zeros takes the padded path), floats random, ``fill="ones"`` ones."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in inputs.items():
        spec = _spec(value)
        if spec is None:
            out[name] = value
            continue
        dtype, dims, fill = spec
        shape = [point[d] if isinstance(d, str) else int(d) for d in dims]
        if fill == "ones":
            out[name] = torch.ones(shape, dtype=dtype)
        elif dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        elif dtype == torch.bool:
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            out[name] = torch.zeros(shape, dtype=dtype)
    return out


_MODES = {  # precision name -> (parameter dtype, autocast dtype, grad scaler, master weights)
    "32-true": (torch.float32, None, False, False),
    "bf16-mixed": (torch.float32, torch.bfloat16, False, False),
    "16-mixed": (torch.float32, torch.float16, True, False),
    "bf16-true": (torch.bfloat16, None, False, False),
    "16-true": (torch.float16, None, False, False),
    "bf16-master": (torch.bfloat16, None, False, True),
}


class MasterWeights(torch.optim.Optimizer):
    """Mixed-precision training with fp32 master weights, written here from the layout of
    DeepSpeed's BF16 optimizer and Megatron's distributed optimizer (not memsim's code): fp32
    copies of the bf16 parameters and fp32 gradient buffers exist from construction on; a step
    copies each gradient into its fp32 buffer, steps the masters with the inner optimizer and
    copies them back into the bf16 parameters in place."""

    def __init__(self, params, inner):
        params = list(params)
        super().__init__(params, {})
        self.masters = [torch.nn.Parameter(p.detach().float(), requires_grad=False)
                        for p in params]
        self.main_grads = [torch.zeros_like(m) for m in self.masters]
        self.inner = inner(self.masters)

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        for p, m, g in zip(params, self.masters, self.main_grads):
            if p.grad is not None:
                g.copy_(p.grad)
                m.grad = g
        self.inner.step()
        for p, m in zip(params, self.masters):
            p.copy_(m)
            m.grad = None


def _cast_inputs(inputs: dict, dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in inputs.items()}


def _reached(model: torch.nn.Module, inputs: dict, loss_fn, autocast) -> set[int]:
    """The ids of the parameters a training step's backward gives a gradient, from one
    forward and backward that are then dropped (gradients reset to None). A walk of the loss's
    graph misses parameters that a custom autograd function differentiates itself (Reformer's
    reversible layers), whose real optimizer state the steady step holds all the same."""
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = loss_fn(model(**inputs))
    loss.backward()
    found = {id(p) for p in model.parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return found


def measure_train(model: torch.nn.Module, inputs: dict, *, loss_fn=None, optimizer=None,
                  keep_outputs: bool = True, precision: str = "32-true",
                  accumulate: int = 1) -> Measurement:
    """Peak live bytes of one real CPU training step (steady state).

    ``precision`` as Lightning does it: ``*-true`` casts the model and floating inputs,
    ``*-mixed`` runs forward and loss under CPU autocast (fp16 with a GradScaler),
    ``bf16-master`` steps fp32 master weights (:class:`MasterWeights`). ``accumulate``
    micro-batches (the same inputs) per optimizer step.
    """
    param_dtype, autocast, use_scaler, master = _MODES[precision]
    loss_fn = loss_fn or default_loss
    if param_dtype != torch.float32:
        model.to(param_dtype)
        inputs = _cast_inputs(inputs, param_dtype)
    model.train()
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    factory = optimizer or (lambda ps: torch.optim.AdamW(ps))
    opt = MasterWeights(params, factory) if master else factory(params)
    # init_scale=1: the measured step is the steady-state one, where no gradient overflows and
    # the optimizer steps (with 2**16 the small test models overflow and the step is skipped)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if use_scaler else None
    if scaler is not None:
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    # the previous step's gradients and optimizer state, for the parameters a step reaches: one
    # that the forward never uses has no gradient in a real loop, and no state
    reached = _reached(model, inputs, loss_fn, autocast)
    for p in params:
        if id(p) in reached:
            p.grad = torch.zeros_like(p)
    opt.step()
    # the previous step's output and loss: a loop rebinds `out` and `loss`, so they are alive
    # into the measured step until its forward returns (the output) and its loss exists (the
    # loss); the previous step's backward has freed what autograd saved
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        prev_out = model(**inputs)
        prev_loss = loss_fn(prev_out)
        if accumulate > 1:
            prev_loss = prev_loss / accumulate
    (scaler.scale(prev_loss) if scaler is not None else prev_loss).backward()
    if not keep_outputs:
        prev_out = None
    c = _Counter()
    inner = opt.inner if master else opt
    states = [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    if master:
        states += list(opt.masters)
    saved: set[int] = set()
    by_module: dict[str, set[int]] = {}
    names: dict[int, str] = {}
    for name, mod in model.named_modules():
        names.setdefault(id(mod), name)
    stack: list[str] = []

    def pack(t):
        # a detached alias: the tensor itself would close a reference cycle (t -> grad_fn ->
        # saved t) for an op's saved output, which gc does not collect in time
        if id(t.untyped_storage()) in c.log.tokens:
            tok = c.token_of(t)
            saved.add(tok)
            for name in stack:
                by_module.setdefault(name, set()).add(tok)
        return t.detach()

    def enter(mod, args):
        stack.append(names.get(id(mod), ""))

    def leave(mod, args, out):
        stack.pop()

    from torch.nn.modules import module as _module

    with c:
        for t in list(model.parameters()) + list(model.buffers()):
            c.add(t)
        for p in params:
            if p.grad is not None:
                c.add(p.grad)
        for v in states + (list(opt.main_grads) if master else []):
            c.add(v)
        if scaler is not None:
            c.add(scaler._scale)
            c.add(scaler._growth_tracker)
        for v in inputs.values():
            if isinstance(v, torch.Tensor):
                c.add(v)
        at_start = c.cur
        for v in held_tensors(prev_out) + held_tensors(prev_loss):
            c.add(v)
        previous = c.cur - at_start   # freed by the time backward starts
        out, loss = prev_out, prev_loss
        del prev_out, prev_loss, v
        state = {c.token_of(t) for t in list(model.parameters())
                 + [p.grad for p in params if p.grad is not None]
                 + states + (list(opt.main_grads) if master else [])
                 + ([scaler._scale, scaler._growth_tracker] if scaler is not None else [])}
        fixed = state | {c.token_of(t) for t in list(model.buffers()) + [
            v for v in inputs.values() if isinstance(v, torch.Tensor)]}
        c.peak = c.cur
        start = len(c.log.changes)
        opt.zero_grad(set_to_none=True)
        before = c.cur
        for _ in range(accumulate):
            saved.clear()
            by_module.clear()
            hooks = [_module.register_module_forward_pre_hook(enter),
                     _module.register_module_forward_hook(leave, always_call=True)]
            try:
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None), \
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(**inputs)
                    loss = loss_fn(out)
                    if accumulate > 1:
                        loss = loss / accumulate
            finally:
                for h in hooks:
                    h.remove()
            at_backward = c.cur - before + previous
            previous = 0
            if not keep_outputs:
                del out
            # what autograd saved and still holds, without the model state, buffers and inputs
            skip = fixed | {c.token_of(p.grad) for p in params if p.grad is not None}
            live = {tok: c.live[key] for key, tok in c.log.tokens.items() if tok not in skip}
            saved_bytes = sum(live.get(tok, 0) for tok in saved)
            saved_by_module = {name: sum(live.get(tok, 0) for tok in toks)
                               for name, toks in by_module.items() if name}
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        grads = [p.grad for p in params if p.grad is not None]
        if master:
            grads += list(opt.main_grads)
        end_state = [v for st in inner.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor)]
        state |= {c.token_of(t) for t in grads + end_state}
        act_peak = c.log.peak_without(state)
    c.close()
    n = lambda ts: sum(t.untyped_storage().nbytes() for t in
                       {id(t.untyped_storage()): t for t in ts}.values())
    cur, series = sum(d for _, d in c.log.changes[:start]), []
    for _, d in c.log.changes[start:]:
        if d:
            cur += d
            series.append(cur)
    return Measurement(c.peak, n(model.parameters()), n(grads),
                       n(states + ([scaler._scale, scaler._growth_tracker] if scaler else [])),
                       at_backward, saved_bytes, act_peak,
                       {k: v for k, v in saved_by_module.items() if v}, series)


def measure_inference(model: torch.nn.Module, inputs: dict, precision: str = "32-true",
                      keep_outputs: bool = True) -> int:
    """Peak live bytes of a real CPU forward under ``torch.no_grad()`` in eval mode, in a loop
    that rebinds ``out = model(**inputs)`` (``keep_outputs``): the previous forward's output is
    alive until the next forward returns, so a first forward runs before the one measured.
    ``keep_outputs=False``: a loop that drops the output before the next forward."""
    param_dtype, autocast, _, _ = _MODES[precision]
    if param_dtype != torch.float32:
        model.to(param_dtype)
        inputs = _cast_inputs(inputs, param_dtype)
    model.eval()
    c = _Counter()
    with c:
        for t in list(model.parameters()) + list(model.buffers()):
            c.add(t)
        for v in inputs.values():
            if isinstance(v, torch.Tensor):
                c.add(v)
        c.peak = c.cur

        def forward():
            # autocast per forward, as memsim models it (Lightning's loop enters it per step):
            # its cache of cast weights ends with each forward
            with torch.no_grad(), torch.autocast("cpu", dtype=autocast,
                                                 enabled=autocast is not None):
                return model(**inputs)

        out = forward()
        if not keep_outputs:
            del out
            out = None
        c.peak = c.cur
        out = forward()
        del out
    c.close()
    model.train()
    return c.peak


@dataclass(frozen=True)
class CompiledMeasurement:
    """A real ``torch.compile(model, fullgraph=True, dynamic=False)`` training step on CPU."""

    peak: int    # most bytes live at once (see measure_compiled_train for how it is counted)
    saved: int   # bytes saved for backward (unique storages; no parameters, buffers or inputs)


def measure_compiled_train(model: torch.nn.Module, inputs: dict, loss_fn=None,
                           compile: bool = True) -> CompiledMeasurement:
    """One real ``torch.compile(model, fullgraph=True, dynamic=False)`` training step with
    Inductor (fp32, AdamW), after a warm-up step that compiles forward and backward.

    Inductor's kernels allocate in C++, out of a dispatch mode's sight, so the peak is the bytes
    live before the step (parameters, buffers, optimizer states, inputs; gradients are dropped
    first, as in :func:`measure_train`) plus the highest running sum of the profiler's CPU
    allocator events (``profile_memory``) during the step; it includes a few bytes of scalar
    temporaries that no tensor count sees. ``saved`` counts the unique storages autograd's
    saved-tensor hooks see (parameters and inputs excluded). ``compile=False`` counts an eager
    step the same way, which checks this counting against :func:`measure_train`'s.
    """
    from torch.profiler import ProfilerActivity, profile

    loss_fn = loss_fn or default_loss
    compiled = torch.compile(model, fullgraph=True, dynamic=False) if compile else model
    model.train()
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    opt = torch.optim.AdamW(params)
    loss_fn(compiled(**inputs)).backward()  # compiles forward and backward
    opt.step()
    opt.zero_grad(set_to_none=True)
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    before = list(model.parameters()) + list(model.buffers()) + states + [
        v for v in inputs.values() if isinstance(v, torch.Tensor)]
    skip = {id(t.untyped_storage()) for t in before}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if id(st) not in skip:
            saved[id(st)] = st.nbytes()
        return t

    def step():  # the output and the loss stay referenced to the end, as in measure_train
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = compiled(**inputs)
            loss = loss_fn(out)
        loss.backward()
        opt.step()
        return out, loss

    base = sum(st.nbytes() for st in
               {id(t.untyped_storage()): t.untyped_storage() for t in before}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda e: e.start_ns())
    cur = top = 0
    for e in events:
        cur += e.nbytes()
        top = max(top, cur)
    opt.zero_grad(set_to_none=True)
    return CompiledMeasurement(base + top, sum(saved.values()))

"""Measurement oracle for distributed training memory: a REAL step on CPU, N gloo ranks on loopback.

Each rank runs, in a fresh process, the steady-state training step (after warm-up steps, so that
gradients and optimizer state exist)::

    opt.zero_grad(set_to_none=True)
    out = model(**inputs)        # the last step's output is released here, as a loop rebinds
    loss = loss_fn(out)          # out.loss, else out if 0-dim, else first float tensor .sum()
    loss.backward()
    opt.step()

(the last warm-up step's output and loss held until the names are rebound), and counts live
tensor storages: a ``TorchDispatchMode`` adds each new untyped storage an op returns and a
``weakref.finalize`` on the storage subtracts it when it is released. Everything
reachable at the start (parameters, gradients of the warm-up step, optimizer state, buffers,
inputs, FSDP2's internal buffers, any other live tensor the garbage collector can see) is
registered before ``zero_grad``. The peak is the maximum of live bytes during the step.

Strategies (``strategy=`` of :func:`measure`):

* :class:`Plain` -- one process, no process group (the baseline);
* :class:`FSDP2` -- ``fully_shard`` on each block, then on the root;
* :class:`TP` -- ``parallelize_module`` with a plan ``{module-path pattern: style}``;
* :class:`DeepSpeed` -- ``deepspeed.initialize`` with a config dict (ZeRO 0-3, fp32/bf16) on
  DeepSpeed's CPU accelerator, over the same gloo group. Its step is DeepSpeed's own::

      out = engine(**inputs); loss = loss_fn(out); engine.backward(loss); engine.step()

  (``engine.step`` zeroes the gradients; 2 warm-up steps by default). Everything DeepSpeed
  keeps between steps (flat bit16 groups, fp32 master partitions, optimizer state, ZeRO-3's
  gradient partition buffer and reduce buckets) is a gc-visible tensor, registered at start.

Details that make the numbers exact and repeatable:

* DTensor (and any other wrapper subclass, e.g. ``AsyncCollectiveTensor``) ops are answered with
  ``NotImplemented`` so that the subclass desugars them into plain local ops, which the mode then
  sees: shards are counted once, as local tensors. Ops run under a fake mode (DTensor's sharding
  propagation) are ignored.
* ``UntypedStorage.resize_`` does not go through dispatch; FSDP2 uses it to allocate and free the
  unsharded parameters in place. It is patched for the duration of the step; a known storage
  whose ``nbytes`` changed is also re-read whenever an op returns it.
* gloo's worker thread may drop the last reference to a collective's buffers a moment after
  ``wait()`` returns, so the free would land at a random later point of the program. Every
  ``Work.wait`` and ``_c10d_functional.wait_tensor`` is followed by a short sleep (``settle_s``,
  1 ms) so the worker finishes first; frees that still arrive on a foreign thread are counted in
  ``foreign_frees`` (0 in a clean run).
* Python's cyclic GC is collected before and disabled during the step; each rank sets
  ``torch.set_num_threads(1)``; every configuration runs in a fresh spawned process.

Memory that never appears as a tensor storage visible to Python dispatch on the rank's main
thread is not counted: gloo's own scratch buffers, the allocator's overhead, the interpreter.

This file is self-contained (it is the oracle memsim's predictions are tested against) and must
not import memsim's tracer or analysis packages.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from .common import ChangeLog, default_loss, held_tensors

__all__ = [
    "Plain", "FSDP2", "TP", "DeepSpeed", "HFExperts", "RankMemory", "measure", "measure_step",
    "measure_deepspeed_step",
    "mlp_model", "mlp_inputs", "llama_model", "hf_causal_lm", "hf_model", "image_inputs",
    "llama_inputs", "LLAMA_TP_PLAN",
    "default_loss",
    "with_lora", "with_checkpointing", "in_dtype",
]


# --------------------------------------------------------------------------------------------
# Results and strategies


@dataclass
class RankMemory:
    """Bytes measured on one rank (live untyped storages, local shards only)."""

    rank: int
    world_size: int
    peak: int                 # max live bytes during the step
    start: int                # live bytes before zero_grad (everything registered below)
    end: int                  # live bytes after opt.step (out and loss still alive if kept)
    parameters: int           # local parameter storages (FSDP2: padded shards)
    gradients: int            # local gradient storages at start (from the warm-up step)
    optimizer_states: int     # local optimizer state storages (AdamW: exp_avg, exp_avg_sq, step)
    buffers: int
    inputs: int
    fsdp_internal: int        # FSDP2 buffers alive at start besides the shards (usually 0 bytes)
    other: int                # any other live tensor found by gc at start (should be 0)
    peak_phase: str           # zero_grad / forward / loss / backward / step
    phase_peaks: dict = field(default_factory=dict)   # max live bytes within each phase
    other_detail: list = field(default_factory=list)  # what those are (first 10)
    foreign_frees: int = 0    # frees delivered on a non-main thread (gloo); 0 in a clean run
    resizes: int = 0          # UntypedStorage.resize_ calls during the step (FSDP2 > 0)
    untracked_resizes: int = 0  # resize_ of an unknown non-empty storage (should be 0)
    optimizer: str = ""       # optimizer class and implementation it resolves to
    step_s: float = 0.0       # wall time of the measured step
    crosscheck: dict | None = None  # FSDPMemTracker figures for an identical step, if asked
    log: list = field(default_factory=list)  # (op, live bytes after it), if DIST_ORACLE_LOG=1
    attempts: int = 1         # runs needed to get one with foreign_frees == 0 (see retries)
    # most bytes live at once that are not parameters, gradients or optimizer states (those
    # at the start of the step and at its end) nor `other`
    activation_peak: int = 0
    previous: int = 0         # the last warm-up step's output and loss, alive until rebound
    # what pipeline stages and schedules hold into the step (receive buffers, the zero-bubble
    # schedules' input gradients), counted in the activation peak (Pipeline only)
    pipeline: int = 0


@dataclass
class Plain:
    """No distribution: one process, no process group."""


@dataclass
class FSDP2:
    """``fully_shard`` applied to each block, then to the root.

    ``blocks``: module paths (``"model.layers.0"``), or a picklable predicate
    ``(path, module) -> bool``, or ``None``: HF models' ``_no_split_modules`` classes, else the
    children of the root if it is a ``Sequential``/``ModuleList``, else the children of the
    first ``ModuleList`` found.
    """

    blocks: Sequence[str] | Callable[[str, nn.Module], bool] | None = None
    # or "not-last": every block but the last (torchtitan's train.py), the root True
    reshard_after_forward: bool | str = True
    mp_policy: Any = None  # torch.distributed.fsdp.MixedPrecisionPolicy, off by default
    # {parameter-name suffix: dim}: fully_shard's shard_placement_fn gives a parameter whose
    # name ends so Shard(dim) (torchtitan's Shard(1) for MoE experts); others Shard(0)
    shard_dims: dict = field(default_factory=dict)


@dataclass
class TP:
    """``parallelize_module(model, mesh, plan)``; plan values are style objects or the strings
    ``"colwise"``, ``"rowwise"``, ``"sequence"``. Keys may use ``*`` (fnmatch per path part)."""

    plan: dict = field(default_factory=lambda: dict(LLAMA_TP_PLAN))


@dataclass
class DDP:
    """``DistributedDataParallel(model, bucket_cap_mb=..., gradient_as_bucket_view=...)``.

    The Reducer's bucket tensors are owned by C++ (allocated at construction, before counting,
    and invisible to the garbage collector): their bytes are read from DDP's own logging data
    (``bucket_sizes``) and reported in ``RankMemory.other_detail`` as ``ddp_buckets=N``."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False


@dataclass
class FSDP2TP:
    """A 2-D mesh (dp, tp): ``parallelize_module`` on the tp dimension, then ``fully_shard``
    (each block, then the root) on the dp dimension; world size dp * tp."""

    dp: int = 2
    tp: int = 2
    plan: dict = field(default_factory=lambda: dict(LLAMA_TP_PLAN))
    fsdp: "FSDP2" = None


@dataclass
class DeepSpeed:
    """``deepspeed.initialize(model=, model_parameters=, optimizer=optimizer_fn(params),
    config=config)`` on the CPU accelerator over the ranks' gloo group; the step is
    ``out = engine(**inputs); loss = loss_fn(out); engine.backward(loss); engine.step()``
    (DeepSpeed zeroes the gradients in ``step``: the ``zero_grad`` phase is empty).

    ``config`` is DeepSpeed's config dict; missing keys get: ``train_micro_batch_size_per_gpu``
    and ``gradient_accumulation_steps`` 1 (unless ``train_batch_size`` is given),
    ``zero_allow_untested_optimizer`` True, ``steps_per_print`` 10**9,
    ``wall_clock_breakdown`` False. :func:`measure` runs 2 warm-up steps by default for this
    strategy. With ``bf16`` enabled the engine casts the model to bf16 but not the inputs: give
    an ``inputs_fn`` that returns bf16 float inputs."""

    config: dict = field(default_factory=dict)

    def full_config(self) -> dict:
        import copy
        cfg = copy.deepcopy(self.config)
        if "train_batch_size" not in cfg:
            cfg.setdefault("train_micro_batch_size_per_gpu", 1)
            cfg.setdefault("gradient_accumulation_steps", 1)
        cfg.setdefault("zero_allow_untested_optimizer", True)
        cfg.setdefault("steps_per_print", 10**9)
        cfg.setdefault("wall_clock_breakdown", False)
        return cfg


@dataclass
class Pipeline:
    """``torch.distributed.pipelining`` over the ranks: the model (an ``nn.Sequential``) split
    into the stages ``groups`` (child positions per stage, in order), stage ``s`` on rank
    ``s % world`` (``rank`` and ``2 world - 1 - rank`` for the V schedules), each a
    ``PipelineStage`` given its boundary shapes (static: computed from one micro-batch of the
    full model before the steps), the schedule ``torch.distributed.pipelining.<schedule>``
    with ``microbatches`` and the loss ``loss_fn(output)`` per micro-batch (its target a
    zero-byte placeholder); the step is ``opt.zero_grad(set_to_none=True);
    schedule.step(x on the first stage's rank, target=..., losses=[] on the last's,
    return_outputs=False); opt.step()`` (AdamW over the rank's stages). Every rank holds the
    inputs. What the stages and the schedule hold into the step (receive buffers) is
    ``pipeline``, counted in the activation peak; no device mesh is built (the stages talk over
    the default group).

    ``fsdp`` (with ``dp`` > 1) and ``tp`` > 1: a ``(world / (dp tp), dp, tp)`` mesh named
    ``("pp", "dp", "tp")``, rank ``(pp_rank * dp + dp_rank) * tp + tp_rank``; the whole
    model tensor-parallel first (``tp_plan``, :class:`TP`'s), then each stage's blocks (its
    children, or a decoder stage's layers) and the stage sharded with ``fully_shard`` over the
    rank's ``dp`` mesh, the stages talking over its ``pp`` group (as torchtitan builds
    them)."""

    schedule: str = "1F1B"
    microbatches: int = 2
    groups: Sequence[Sequence[int]] = ()
    dp: int = 1
    fsdp: Any = None   # an FSDP2 of the stages (dp > 1)
    tp: int = 1
    tp_plan: Any = None   # a TP plan (tp > 1): LLAMA_TP_PLAN by default


@dataclass
class HFExperts:
    """Hugging Face's own layout of a mixture of experts: ``DistributedConfig(ep_size=ep,
    fsdp_size=world)``, its meshes from ``initialize_distributed_mesh`` and the model laid out
    by ``maybe_distribute_model`` (the expert-parallel plan, then the FSDP2 plan), on the real
    weights every rank built alike."""

    ep: int = 2


# q/k/v/gate/up column-wise, o/down row-wise; embeddings, norms and LM head stay replicated.
# HF 5.24 LlamaAttention views projections as (*input_shape, -1, head_dim), so the local
# head count follows the shard width and num_heads needs no per-rank adjustment.
LLAMA_TP_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


# --------------------------------------------------------------------------------------------
# Test models (picklable factories: use functools.partial for arguments)


def mlp_model(width: int = 64, hidden: int = 256, blocks: int = 4) -> nn.Module:
    """``Sequential`` of ``blocks`` x (Linear(width, hidden), GELU, Linear(hidden, width))."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, hidden), nn.GELU(),
                                         nn.Linear(hidden, width)) for _ in range(blocks)])


class ResidualBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))``, ``fc1`` four times as wide."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.act = nn.Linear(width, 4 * width), nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def residual_mlp(blocks: int = 8, width: int = 32, classes: int = 10) -> nn.Module:
    """``Sequential`` of ``blocks`` residual blocks and a head ``Linear(width, classes)``: a
    model a pipeline splits by its children."""
    return nn.Sequential(*[ResidualBlock(width) for _ in range(blocks)],
                         nn.Linear(width, classes))


def mlp_inputs(batch: int = 8, width: int = 64) -> dict:
    return {"input": torch.randn(batch, width)}


def llama_model(attn: str = "eager", layers: int = 2, use_cache: bool = False,
                vocab: int = 128, hidden: int = 64, intermediate: int = 128, heads: int = 4,
                kv_heads: int = 2, positions: int = 64) -> nn.Module:
    """Small HF Llama from config (fp32). ``use_cache=False``: no KV cache in training."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads,
                      max_position_embeddings=positions, use_cache=use_cache)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg)


def hf_causal_lm(config: str, model: str, **extra) -> nn.Module:
    """A small Hugging Face causal LM from config (fp32), as :func:`llama_model`'s widths:
    ``config`` and ``model`` name transformers' classes (``"Qwen3Config"``,
    ``"Qwen3ForCausalLM"``); ``extra`` config fields (``head_dim``, ``sliding_window``,
    ``use_cache=True``...); eager attention unless ``attn_implementation`` says otherwise."""
    import transformers

    attn = extra.pop("attn_implementation", "eager")

    cfg = getattr(transformers, config)(**{
        **dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               use_cache=False), **extra})
    cfg._attn_implementation = attn
    return getattr(transformers, model)(cfg)


def hf_model(config: str, model: str, **fields) -> nn.Module:
    """A Hugging Face model from config (fp32): ``config`` and ``model`` name transformers'
    classes, ``fields`` the config's fields."""
    import transformers

    return getattr(transformers, model)(getattr(transformers, config)(**fields))


def image_inputs(batch: int = 2, size: int = 32, classes: int = 10) -> dict:
    return {"pixel_values": torch.randn(batch, 3, size, size),
            "labels": torch.randint(0, classes, (batch,))}


def llama_inputs(batch: int = 2, seq: int = 16, vocab: int = 128) -> dict:
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": ids.clone()}


def with_lora(model_fn: Callable[[], nn.Module], r: int = 4,
              targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> nn.Module:
    """``model_fn()`` with LoRA adapters from peft's own ``get_peft_model`` (``lora_alpha`` 2r,
    no dropout, base weights frozen). Module paths gain peft's ``base_model.model.`` prefix."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model_fn(), LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                                 target_modules=list(targets)))


def in_dtype(model_fn: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    """``model_fn()`` with its floating parameters and buffers cast to ``dtype``."""
    return model_fn().to(dtype)


def with_checkpointing(model_fn: Callable[[], nn.Module],
                       blocks: Sequence[str] | None = None) -> nn.Module:
    """``model_fn()`` with the ``forward`` of each block (module paths; ``None``: as
    :class:`FSDP2` finds them) wrapped in non-reentrant ``torch.utils.checkpoint`` in place, so
    that module hooks (FSDP2's all-gathers) stay outside the checkpointed region, as with
    ``checkpoint_wrapper`` applied before ``fully_shard``."""
    from torch.utils.checkpoint import checkpoint

    model = model_fn()
    for path in (_auto_blocks(model) if blocks is None else blocks):
        mod = model.get_submodule(path)
        mod.forward = functools.partial(checkpoint, mod.forward, use_reentrant=False)
    return model


def adamw(params):
    """Default optimizer: ``torch.optim.AdamW`` with torch defaults (foreach=None, fused=None)."""
    return torch.optim.AdamW(params)


# --------------------------------------------------------------------------------------------
# Counting live storages


def _plain_tensors(t: torch.Tensor):
    """The plain tensors inside ``t`` (recursing through DTensor and other wrapper subclasses)."""
    todo, out = [t], []
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            attrs, _ = x.__tensor_flatten__()
            todo.extend(getattr(x, a) for a in attrs if isinstance(getattr(x, a), torch.Tensor))
        else:
            out.append(x)
    return out


def _storages(t: torch.Tensor):
    for x in _plain_tensors(t):
        if x.device.type != "meta":
            yield x.untyped_storage()


class _StorageCounter(TorchDispatchMode):
    """Live bytes of untyped storages; see the module docstring."""

    def __init__(self, settle_s: float = 1e-3):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.fins: dict[int, weakref.finalize] = {}
        self.cur = 0
        self.peak = 0
        self.phase = "start"
        self.peak_phase = "start"
        self.phase_peaks: dict[str, int] = {}
        self.settle_s = settle_s
        self.main = threading.get_ident()
        self.lock = threading.RLock()
        self.foreign_frees = 0
        self.untracked_resizes = 0
        self.resizes = 0
        self._orig_resize = None
        self._orig_wait = None
        self._wait_tensor = torch.ops._c10d_functional.wait_tensor.default
        self.log = [] if os.environ.get("DIST_ORACLE_LOG") == "1" else None
        self.changes = ChangeLog()

    # bookkeeping ----------------------------------------------------------------------------
    def _bump(self):
        if self.cur > self.peak:
            self.peak = self.cur
            self.peak_phase = self.phase
        if self.cur > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.cur

    def set_phase(self, name: str):
        self.phase = name
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.cur)

    def see(self, st: torch.UntypedStorage) -> int:
        """Track ``st`` (or re-read its size if known); returns bytes newly added."""
        key, n = id(st), st.nbytes()
        with self.lock:
            old = self.sizes.get(key)
            if old is not None:
                if n != old:
                    self.sizes[key] = n
                    self.cur += n - old
                    self.changes.resize(key, n - old)
                    self._bump()
                return 0
            self.sizes[key] = n
            self.changes.alloc(key, n)
            self.fins[key] = weakref.finalize(st, self._free, key)
            self.cur += n
            self._bump()
            return n

    def track(self, t: torch.Tensor) -> int:
        return sum(self.see(st) for st in _storages(t))

    def tokens_of(self, ts) -> set[int]:
        """The tokens of the live storages of ``ts``."""
        tokens = self.changes.tokens
        return {tokens[id(st)] for t in ts if isinstance(t, torch.Tensor)
                for st in _storages(t) if id(st) in tokens}

    def _free(self, key: int):
        with self.lock:
            n = self.sizes.pop(key, 0)
            self.fins.pop(key, None)
            self.changes.free(key, n)
            self.cur -= n
            if threading.get_ident() != self.main and n:
                self.foreign_frees += 1

    def _resized(self, st, old_n: int):
        self.resizes += 1
        if id(st) not in self.sizes and old_n:
            # a live storage that was never registered: its bytes before the resize were not
            # counted, so from here on it counts in full (flagged: should not happen)
            self.untracked_resizes += 1
        self.see(st)

    # dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            return NotImplemented  # let DTensor & co. desugar into plain local ops
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is None:  # skip DTensor's sharding propagation under fake mode
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.track(t)
            if self.log is not None:
                self.log.append((str(func), self.cur))
        if func is self._wait_tensor and self.settle_s:
            time.sleep(self.settle_s)
        return out

    def __enter__(self):
        self._orig_resize = orig_resize = torch.UntypedStorage.resize_
        counter = self

        @functools.wraps(orig_resize)
        def resize_(st, size):
            old = st.nbytes()
            r = orig_resize(st, size)
            counter._resized(st, old)
            return r

        torch.UntypedStorage.resize_ = resize_
        try:
            from torch._C._distributed_c10d import Work
        except ImportError:
            Work = None
        if Work is not None:
            self._orig_wait = orig_wait = Work.wait

            def wait(work, *a, **k):
                r = orig_wait(work, *a, **k)
                if counter.settle_s:
                    time.sleep(counter.settle_s)
                return r

            Work.wait = wait
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        if self._orig_wait is not None:
            from torch._C._distributed_c10d import Work
            Work.wait = self._orig_wait
        return super().__exit__(*exc)

    def close(self):
        for f in list(self.fins.values()):
            f.detach()
        self.fins.clear()


# --------------------------------------------------------------------------------------------
# The measured step (runs inside a rank)


def _optimizer_tensors(opt) -> list:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _fsdp_internal_tensors(model: nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    out = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for fp in group.fsdp_params:
            for v in vars(fp).values():
                vs = v if isinstance(v, (list, tuple)) else [v]
                out += [x for x in vs if isinstance(x, torch.Tensor)]
    return out


def _device_mesh_tensors() -> list:
    """The tensors device meshes hold (their tables of ranks: host bookkeeping)."""
    from torch.distributed.device_mesh import DeviceMesh
    out = []
    with warnings.catch_warnings():  # isinstance() on torch.distributed.reduce_op warns
        warnings.simplefilter("ignore")
        found = [o for o in gc.get_objects() if isinstance(o, DeviceMesh)]
    for o in found:
        for v in vars(o).values():
            vs = v if isinstance(v, (list, tuple)) else [v]
            out += [x for x in vs if isinstance(x, torch.Tensor)]
    return out


def _live_tensors() -> list:
    with warnings.catch_warnings():  # isinstance() on torch.distributed.reduce_op warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def _resolved_optimizer(opt, params=None) -> str:
    """``params``: the tensors the step updates, if not ``opt.param_groups``' (ZeRO-3 empties
    those between steps)."""
    name = type(opt).__name__
    d = opt.defaults
    if d.get("fused"):
        return f"{name}(fused)"
    foreach = d.get("foreach")
    if foreach is None:
        from torch.optim.optimizer import _default_to_fused_or_foreach
        ps = params if params is not None else [p for g in opt.param_groups for p in g["params"]]
        _, foreach = _default_to_fused_or_foreach(ps, differentiable=False, use_fused=False)
        return f"{name}(foreach=None -> {'foreach' if foreach else 'for-loop'})"
    return f"{name}(foreach={foreach})"


def _one_step(model, inputs, opt, loss_fn, keep_outputs=True, counter=None, engine=None,
              accumulate=1, autocast=None, previous=None):
    """One training step; with a DeepSpeed ``engine`` (then ``model`` and ``opt`` are it),
    ``engine.backward`` and ``engine.step``, which zeroes the gradients itself: the
    ``zero_grad`` phase is empty. ``accumulate``: micro-batches (forward, loss / accumulate,
    backward) per optimizer step; ``autocast``: a dtype for CPU autocast over forward and
    loss. ``previous``: a list holding the last step's output and loss, emptied here, so that
    they are released where the loop rebinds ``out`` and ``loss``."""
    out, loss = previous or (None, None)
    if previous:
        previous.clear()
    ph = counter.set_phase if counter is not None else (lambda _: None)
    ph("zero_grad")
    if engine is None:
        opt.zero_grad(set_to_none=True)
    for _ in range(accumulate):
        ph("forward")
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = model(**inputs)
            ph("loss")
            loss = loss_fn(out)
            if accumulate > 1:
                loss = loss / accumulate
        if not keep_outputs:
            del out
            out = None
        ph("backward")
        if engine is None:
            loss.backward()
        else:
            engine.backward(loss)
    ph("step")
    opt.step()
    ph("end")
    return out, loss


# what the activation peak leaves out, at the start of the step and at its end; with "other",
# the tensors outside the step (the device mesh's rank table)
_MODEL_STATE = ("parameters", "gradients", "optimizer_states")


def _counted_step(groups_fn, step_fn, settle_s: float) -> dict:
    """Register what ``groups_fn()`` returns (``[(category, tensors)]``, ``other`` last) as live,
    then run ``step_fn(counter)`` under the storage counter; the figures as a dict."""
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    c = _StorageCounter(settle_s=settle_s)
    cats: dict[str, int] = {}
    try:
        with c:
            groups = groups_fn()
            other_detail = []
            for name, ts in groups:
                cats[name] = 0
                for t in ts:
                    n = c.track(t)
                    cats[name] += n
                    if n and name == "other" and len(other_detail) < 10:
                        other_detail.append(f"{type(t).__name__}{tuple(t.shape)} {t.dtype} {n} B")
            state = c.tokens_of(t for name, ts in groups if name in _MODEL_STATE for t in ts)
            state |= c.tokens_of(dict(groups)["other"]) - c.tokens_of(
                t for name, ts in groups if name != "other" for t in ts)
            del groups, ts, t  # hold no reference: the old gradients must die at zero_grad
            start = c.cur
            first = len(c.changes.changes)
            c.peak, c.peak_phase, c.phase_peaks = start, "start", {"start": start}
            t0 = time.perf_counter()
            out, loss = step_fn(c)
            step_s = time.perf_counter() - t0
            end = c.cur
            state |= c.tokens_of(t for name, ts in groups_fn() if name in _MODEL_STATE
                                 for t in ts)
            activation_peak = c.changes.peak_without(state, first)
        del out, loss
    finally:
        c.close()
        if gc_was:
            gc.enable()
    return dict(peak=c.peak, start=start, end=end, **cats, other_detail=other_detail,
                activation_peak=activation_peak,
                peak_phase=c.peak_phase, phase_peaks=dict(c.phase_peaks),
                foreign_frees=c.foreign_frees, resizes=c.resizes,
                untracked_resizes=c.untracked_resizes, step_s=round(step_s, 4), log=c.log or [])


def measure_step(model: nn.Module, inputs: dict, *, loss_fn=None, optimizer_fn=None,
                 keep_outputs: bool = True, warmup: int = 1, settle_s: float = 1e-3,
                 rank: int = 0, world_size: int = 1, crosscheck: bool = False,
                 accumulate: int = 1, autocast: torch.dtype | None = None) -> RankMemory:
    """Measure one steady-state step of an already prepared (sharded/parallelized) model in this
    process. Call it in a fresh process for the ``other`` figure to be meaningful."""
    loss_fn = loss_fn or default_loss
    model.train()
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    opt = (optimizer_fn or adamw)(params)
    held: list = []    # the last step's output and loss, released as the step rebinds them
    for _ in range(warmup):
        held[:] = _one_step(model, inputs, opt, loss_fn, keep_outputs, accumulate=accumulate,
                            autocast=autocast, previous=held)

    def groups():
        return [
            ("parameters", list(params) + [p for p in model.parameters() if not p.requires_grad]),
            ("gradients", [p.grad for p in params if p.grad is not None]),
            ("optimizer_states", _optimizer_tensors(opt)),
            ("buffers", list(model.buffers())),
            ("inputs", [v for v in inputs.values() if isinstance(v, torch.Tensor)]),
            ("fsdp_internal", _fsdp_internal_tensors(model)),
            ("previous", held_tensors(held)),
            ("other", _live_tensors()),
        ]

    figures = _counted_step(groups, lambda c: _one_step(model, inputs, opt, loss_fn, keep_outputs,
                                                         counter=c, accumulate=accumulate,
                                                         autocast=autocast, previous=held),
                            settle_s)
    result = RankMemory(rank=rank, world_size=world_size, **figures,
                        optimizer=_resolved_optimizer(opt))
    if crosscheck:
        result.crosscheck = _fsdp_mem_tracker_step(model, inputs, opt, loss_fn, keep_outputs)
    return result


def measure_pipeline_step(model: list, inputs: dict, p: Pipeline, *, loss_fn=None,
                          optimizer_fn=None, warmup: int = 1, settle_s: float = 1e-3,
                          rank: int = 0, world_size: int = 1,
                          autocast: torch.dtype | None = None, mesh=None) -> RankMemory:
    """One steady-state step of rank ``rank`` (see :class:`Pipeline`); ``model``: a list
    holding the whole model, emptied here (the other ranks' stages are dropped)."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    loss_fn = loss_fn or default_loss
    whole = model.pop()
    n = len(p.groups)
    v_shape = p.schedule in ("ZBVZeroBubble", "DualPipeV")
    stage_rank, ranks = rank // (p.dp * p.tp), world_size // (p.dp * p.tp)
    if p.tp > 1:
        whole = _apply_tp(whole, mesh["tp"], TP(plan=p.tp_plan or dict(LLAMA_TP_PLAN)))
    ids = ([stage_rank, n - 1 - stage_rank] if v_shape
           else list(range(stage_rank, n, ranks)))
    x = next(v for v in inputs.values() if isinstance(v, torch.Tensor))
    target = inputs.get("labels")
    if hasattr(whole, "base_model_prefix"):   # a Hugging Face decoder LM, by its layers
        mods, ins, outs = _decoder_stages(whole, p.groups, ids, x.tensor_split(p.microbatches)[0])

        def stage_loss(out, target):
            lm = next(m for m in mods if m.last).lm
            return lm.loss_function(logits=out, labels=target, vocab_size=lm.config.vocab_size)
    else:
        children = list(whole.children())
        with torch.no_grad():   # the boundary shapes, from one micro-batch
            h, outs = x.tensor_split(p.microbatches)[0], []
            ins = [torch.empty_like(h, device="meta")]
            for g in p.groups:
                for i in g:
                    h = children[i](h)
                outs.append(torch.empty_like(h, device="meta"))
            ins += outs[:-1]
            del h, g
        mods = [nn.Sequential(*[children[i] for i in p.groups[s]]) for s in ids]
        del children

        def stage_loss(out, target):
            return loss_fn(out)
    del whole
    group = None
    if mesh is not None:
        group = mesh["pp"].get_group()
    if p.dp > 1:
        for mod in mods:
            blocks = ([f"lm.{mod.lm.base_model_prefix}.layers.{j}" for j in range(len(
                getattr(mod.lm, mod.lm.base_model_prefix).layers))]
                if isinstance(mod, _DecoderStageModule) else None)
            _apply_fsdp2(mod, mesh["dp"], replace(p.fsdp or FSDP2(),
                                                             blocks=blocks))
    stages = [PipelineStage(mod, s, n, torch.device("cpu"),
                            input_args=ins[s].requires_grad_(s > 0 and ins[s].is_floating_point()),
                            output_args=outs[s].requires_grad_(True), group=group)
              for s, mod in zip(ids, mods)]
    model = nn.ModuleList(mods)
    cls = getattr(pipelining, "Schedule" + p.schedule)
    sched = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=p.microbatches,
                loss_fn=stage_loss)
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = (optimizer_fn or adamw)(params)

    def one_step(counter=None):
        ph = counter.set_phase if counter is not None else (lambda _: None)
        ph("zero_grad")
        opt.zero_grad(set_to_none=True)
        ph("forward")
        kw = dict(target=target if target is not None else x.new_empty(p.microbatches, 0),
                  losses=[]) if last else {}
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            sched.step(*((x,) if first else ()), return_outputs=False, **kw)
        del kw
        ph("step")
        opt.step()
        ph("end")
        return None, None

    for _ in range(warmup):
        one_step()
    def groups():
        return [
            ("parameters", list(model.parameters())),
            ("gradients", [q.grad for q in params if q.grad is not None]),
            ("optimizer_states", _optimizer_tensors(opt)),
            ("buffers", list(model.buffers())),
            ("inputs", [v for v in inputs.values() if isinstance(v, torch.Tensor)]),
            ("fsdp_internal", _fsdp_internal_tensors(model)),
            ("previous", []),
            ("pipeline", [t for t in live() if id(t) not in owned]),
            # not the constant torch.distributed.pipelining makes at import (sum_reducer's
            # 4-byte initial loss), which every process that imports it holds, nor the device
            # meshes' tables of ranks (host bookkeeping, on the CPU whatever the device)
            ("other", [t for t in live() if t is not reducer]),
        ]

    def owned_ids():
        return {id(t) for t in (*model.parameters(), *model.buffers(), *_optimizer_tensors(opt),
                                *(q.grad for q in params if q.grad is not None),
                                *(v for v in inputs.values() if isinstance(v, torch.Tensor)),
                                reducer)}

    from torch.distributed.pipelining.microbatch import sum_reducer
    reducer = sum_reducer.init_value
    meshes = {id(t) for t in _device_mesh_tensors()}

    def live():
        return [t for t in _live_tensors() if id(t) not in meshes]
    owned = owned_ids()
    figures = _counted_step(groups, one_step, settle_s)
    return RankMemory(rank=rank, world_size=world_size, **figures,
                      optimizer=_resolved_optimizer(opt))


class _DecoderStageModule(nn.Module):
    """A decoder LM's stage: a copy of the model keeping its stage's layers (and its
    embeddings on the first stage, its norm and head on the last), run by its own forward."""

    def __init__(self, lm, layers, first, last):
        super().__init__()
        base = getattr(lm, lm.base_model_prefix)
        base.layers = nn.ModuleList(layers)
        if not first:
            base.embed_tokens = nn.Identity()
        if not last:
            base.norm, lm.lm_head = nn.Identity(), nn.Identity()
        self.lm, self.first, self.last = lm, first, last

    def forward(self, x):
        kw = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if self.last:
            return self.lm(**kw, use_cache=False).logits
        return getattr(self.lm, self.lm.base_model_prefix)(**kw, use_cache=False).last_hidden_state


def _decoder_stages(lm, groups, ids, micro):
    """Rank ``ids``' stage modules of a Hugging Face decoder LM, and every stage's input and
    output shapes (meta), from one micro-batch of the whole model."""
    import copy

    with torch.no_grad():
        base = getattr(lm, lm.base_model_prefix)
        hidden = torch.empty_like(base(input_ids=micro, use_cache=False).last_hidden_state,
                                  device="meta")
        logits = torch.empty_like(lm(input_ids=micro, use_cache=False).logits, device="meta")
    n = len(groups)
    ins = [torch.empty_like(micro, device="meta")] + [hidden] * (n - 1)
    outs = [hidden] * (n - 1) + [logits]
    layers = list(base.layers)
    mods = []
    for s in ids:
        shell = copy.copy(lm)
        shell._modules = dict(lm._modules)
        inner = copy.copy(base)
        inner._modules = dict(base._modules)
        setattr(shell, lm.base_model_prefix, inner)
        mods.append(_DecoderStageModule(shell, [layers[i] for i in groups[s]], s == 0,
                                        s == n - 1))
    return mods, [t.clone() for t in ins], [t.clone() for t in outs]


def _ds_fp32_partitions(zopt) -> list:
    """ZeRO's fp32 master partitions: stage 1/2 ``single_partition_of_fp32_groups``, stage 3
    ``fp32_partitioned_groups_flat``."""
    out = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        out += [t for t in getattr(zopt, name, None) or [] if isinstance(t, torch.Tensor)]
    return out


def measure_deepspeed_step(model: nn.Module, inputs: dict, config: dict, *, loss_fn=None,
                           optimizer_fn=None, keep_outputs: bool = True, warmup: int = 2,
                           settle_s: float = 1e-3, rank: int = 0,
                           world_size: int = 1) -> RankMemory:
    """``deepspeed.initialize`` the model in this process (deepspeed.comm must be initialized,
    see :func:`_init_deepspeed`), run ``warmup`` steps, then measure one DeepSpeed step.

    Categories at start: ``parameters`` the module's parameter storages (ZeRO-1/2: the flat
    bit16 groups they view; ZeRO-3: the ``ds_tensor`` partitions plus the full data of the
    persistent parameters), ``gradients`` any ``.grad`` of those and of the fp32 partitions,
    plus ZeRO-3's persistent ``grad_partitions_flat_buffer``,
    ``optimizer_states`` the inner optimizer's state plus the fp32 master partitions,
    ``other`` the rest (ZeRO's bucket / reduction buffers...)."""
    deepspeed = _import_deepspeed()
    loss_fn = loss_fn or default_loss
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    optimizer = (optimizer_fn or adamw)(params)
    engine, zopt, _, _ = deepspeed.initialize(model=model, model_parameters=params,
                                              optimizer=optimizer, config=config)
    engine.train()
    inner = getattr(zopt, "optimizer", zopt)
    held: list = []    # the last step's output and loss, released as the step rebinds them
    for _ in range(warmup):
        held[:] = _one_step(engine, inputs, engine, loss_fn, keep_outputs, engine=engine,
                            previous=held)

    def groups():
        mparams = list(engine.module.parameters())
        fp32 = _ds_fp32_partitions(zopt)
        return [
            ("parameters", mparams + [p.ds_tensor for p in mparams
                                      if isinstance(getattr(p, "ds_tensor", None),
                                                    torch.Tensor)]),
            ("gradients", [p.grad for p in mparams + fp32 if p.grad is not None]
             + [t for t in [getattr(zopt, "grad_partitions_flat_buffer", None)]
                if isinstance(t, torch.Tensor)]),
            ("optimizer_states", _optimizer_tensors(inner) + fp32),
            ("buffers", list(engine.module.buffers())),
            ("inputs", [v for v in inputs.values() if isinstance(v, torch.Tensor)]),
            ("fsdp_internal", []),
            ("previous", held_tensors(held)),
            ("other", _live_tensors()),
        ]

    figures = _counted_step(groups, lambda c: _one_step(engine, inputs, engine, loss_fn,
                                                         keep_outputs, counter=c, engine=engine,
                                                         previous=held),
                            settle_s)
    if getattr(zopt, "overflow", False):  # inf/NaN gradients: DeepSpeed skipped the update
        figures["other_detail"].append("deepspeed overflow: optimizer step skipped")
    # the tensors the inner optimizer steps (ZeRO-3 empties its param_groups between steps)
    label = _resolved_optimizer(inner, _ds_fp32_partitions(zopt) or None)
    return RankMemory(rank=rank, world_size=world_size, **figures,
                      optimizer=f"{type(zopt).__name__}[{label}]")


def _import_deepspeed():
    """Import DeepSpeed on its CPU accelerator, without the shm comm op (which it would
    JIT-compile, ~170 s, when it creates its torch backend)."""
    os.environ["DS_ACCELERATOR"] = "cpu"  # read when the accelerator is first resolved
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    from deepspeed.accelerator import get_accelerator

    # not ``import deepspeed.comm.torch as dct``: deepspeed.comm has an attribute ``torch`` (the
    # torch package), which that statement binds instead of the submodule
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if get_accelerator().device_name() != "cpu":
        raise RuntimeError(f"DeepSpeed resolved the accelerator {get_accelerator().device_name()!r}"
                           " before DS_ACCELERATOR=cpu was set (was it imported earlier?)")
    return deepspeed


def _init_deepspeed(rank: int, world_size: int, port: int):
    """deepspeed.comm on top of the torch.distributed gloo group this rank already joined."""
    import logging

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    deepspeed = _import_deepspeed()
    from deepspeed.utils import logger
    logger.setLevel(logging.ERROR)
    # DeepSpeed calls all_gather_into_tensor / reduce_scatter_tensor: FutureWarning per call
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                                    verbose=False, rank=rank, world_size=world_size)


def _fsdp_mem_tracker_step(model, inputs, opt, loss_fn, keep_outputs) -> dict:
    """The same step under PyTorch's FSDPMemTracker (MemTracker for a non-FSDP model)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    gc.collect()
    if isinstance(model, FSDPModule):
        mt = FSDPMemTracker(model, opt)
        mt.track_inputs(tuple(inputs.values()))
    else:
        mt = MemTracker()
        mt.track_external(model, opt, *inputs.values())
    with mt:
        start = mt.get_tracker_snapshot("current")
        out, loss = _one_step(model, inputs, opt, loss_fn, keep_outputs)
    del out, loss
    dev = torch.device("cpu")
    peak = mt.get_tracker_snapshot("peak")
    return {"tool": type(mt).__name__,
            "start": int(start.get(dev, {}).get("Total", 0)),
            "peak": int(peak.get(dev, {}).get("Total", 0)),
            "peak_by_type": {str(k): int(v) for k, v in peak.get(dev, {}).items()}}


# --------------------------------------------------------------------------------------------
# Strategies applied inside a rank


def _auto_blocks(model: nn.Module) -> list[str]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        return [n for n, m in model.named_modules() if type(m).__name__ in names]
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return [n for n, _ in model.named_children()]
    for n, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            return [f"{n}.{c}" for c, _ in m.named_children()]
    return []


def _apply_fsdp2(model: nn.Module, mesh, s: FSDP2) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": mesh, "reshard_after_forward": s.reshard_after_forward}
    kw["mp_policy"] = s.mp_policy if s.mp_policy is not None else MixedPrecisionPolicy()
    if s.shard_dims:
        from torch.distributed.tensor import Shard
        placed = {p: Shard(d) for n, p in model.named_parameters()
                  for end, d in s.shard_dims.items() if n.endswith(end)}
        kw["shard_placement_fn"] = placed.get
    if s.blocks is None:
        paths = _auto_blocks(model)
    elif callable(s.blocks):
        paths = [n for n, m in model.named_modules() if n and s.blocks(n, m)]
    else:
        paths = list(s.blocks)
    if s.reshard_after_forward == "not-last":
        for i, p in enumerate(paths):
            fully_shard(model.get_submodule(p), **{**kw, "reshard_after_forward":
                                                   i < len(paths) - 1})
        fully_shard(model, **{**kw, "reshard_after_forward": True})
        return model
    for p in paths:
        fully_shard(model.get_submodule(p), **kw)
    fully_shard(model, **kw)
    return model


def _style(v):
    if not isinstance(v, str):
        return v
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)
    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "sequence": SequenceParallel}[v]()


def _apply_tp(model: nn.Module, mesh, s: TP) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, {k: _style(v) for k, v in s.plan.items()})


# --------------------------------------------------------------------------------------------
# Launching ranks


@dataclass
class _Job:
    model_fn: Callable[[], nn.Module]
    inputs_fn: Callable[[], dict]
    strategy: Any
    world_size: int
    port: int
    loss_fn: Any = None
    optimizer_fn: Any = None
    keep_outputs: bool = True
    warmup: int = 1
    settle_s: float = 1e-3
    seed: int = 0
    crosscheck: bool = False
    accumulate: int = 1
    autocast: Any = None
    attempt: int = 1  # a fresh store prefix per attempt: stale rendezvous keys hang gloo


def _rank_main(rank: int, job: _Job):
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", job.port, is_master=False, timeout=_timedelta(120))
    try:
        distributed = not isinstance(job.strategy, Plain)
        mesh = None
        if distributed:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"pg{job.attempt}", store),
                                    rank=rank,
                                    world_size=job.world_size, timeout=_timedelta(120))
            from torch.distributed.device_mesh import init_device_mesh
            if isinstance(job.strategy, DeepSpeed):
                _init_deepspeed(rank, job.world_size, job.port)
            elif isinstance(job.strategy, FSDP2TP):
                mesh = init_device_mesh("cpu", (job.strategy.dp, job.strategy.tp),
                                        mesh_dim_names=("dp", "tp"))
            elif isinstance(job.strategy, Pipeline):
                st = job.strategy
                if st.dp * st.tp > 1:
                    mesh = init_device_mesh("cpu", (job.world_size // (st.dp * st.tp), st.dp,
                                                    st.tp), mesh_dim_names=("pp", "dp", "tp"))
                # else the stages talk over the default group: no mesh
            elif not isinstance(job.strategy, HFExperts):   # its meshes are the library's
                mesh = init_device_mesh("cpu", (job.world_size,))
        torch.manual_seed(job.seed)  # same weights and inputs on every rank
        model = job.model_fn()
        inputs = job.inputs_fn()
        if isinstance(job.strategy, FSDP2):
            model = _apply_fsdp2(model, mesh, job.strategy)
        elif isinstance(job.strategy, TP):
            model = _apply_tp(model, mesh, job.strategy)
        elif isinstance(job.strategy, DDP):
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(
                model, bucket_cap_mb=job.strategy.bucket_cap_mb,
                gradient_as_bucket_view=job.strategy.gradient_as_bucket_view)
        elif isinstance(job.strategy, HFExperts):
            from transformers.distributed import DistributedConfig
            from transformers.distributed.utils import initialize_distributed_mesh
            config = DistributedConfig(ep_size=job.strategy.ep, fsdp_size=job.world_size,
                                       tp_size=1)
            _, meshes = initialize_distributed_mesh(config)
            model = type(model).maybe_distribute_model(model, config, meshes)
        elif isinstance(job.strategy, FSDP2TP):
            st = job.strategy
            model = _apply_tp(model, mesh["tp"], TP(plan=st.plan))
            model = _apply_fsdp2(model, mesh["dp"], st.fsdp or FSDP2())
        if isinstance(job.strategy, Pipeline):
            box = [model]
            del model   # the rank keeps its own stages only
            r = measure_pipeline_step(box, inputs, job.strategy, loss_fn=job.loss_fn,
                                      optimizer_fn=job.optimizer_fn, warmup=job.warmup,
                                      settle_s=job.settle_s, rank=rank,
                                      world_size=job.world_size, autocast=job.autocast,
                                      mesh=mesh)
        elif isinstance(job.strategy, DeepSpeed):
            r = measure_deepspeed_step(
                model, inputs, job.strategy.full_config(), loss_fn=job.loss_fn,
                optimizer_fn=job.optimizer_fn, keep_outputs=job.keep_outputs, warmup=job.warmup,
                settle_s=job.settle_s, rank=rank, world_size=job.world_size)
        else:
            r = measure_step(model, inputs, loss_fn=job.loss_fn, optimizer_fn=job.optimizer_fn,
                             keep_outputs=job.keep_outputs, warmup=job.warmup,
                             settle_s=job.settle_s, rank=rank, world_size=job.world_size,
                             crosscheck=job.crosscheck, accumulate=job.accumulate,
                             autocast=job.autocast)
        if isinstance(job.strategy, DDP):
            sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
            r.other_detail = list(r.other_detail) + [
                f"ddp_buckets={sum(int(x) for x in str(sizes).split(',') if x.strip())}"]
        payload = ("ok", asdict(r))
    except BaseException:
        payload = ("error", traceback.format_exc())
    import json
    store.set(f"result/{rank}", json.dumps(payload))
    if not isinstance(job.strategy, Plain) and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _timedelta(s):
    import datetime
    return datetime.timedelta(seconds=s)


_FORKSERVER_READY = False


def _configure_forkserver():
    """Ranks fork from one server process that imported torch (and, if present, HF Llama)
    once: ~2 s per 2-rank run instead of ~6-9 s with ``spawn``. Must run before the server
    starts, i.e. before the first forkserver child of this process."""
    global _FORKSERVER_READY
    if _FORKSERVER_READY:
        return
    import multiprocessing

    me = "__main__" if __name__ == "__main__" else __name__
    # deepspeed: measure() sets DS_ACCELERATOR=cpu in the environment the server starts with
    multiprocessing.set_forkserver_preload([
        "torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
        "transformers.models.llama.modeling_llama", "deepspeed", me])  # ImportErrors ignored
    _FORKSERVER_READY = True


def _run_ranks(mp, job: _Job, world_size: int, start_method: str, timeout_s: float) -> bool:
    """Run every rank to the end; False (the ranks killed) if they take over ``timeout_s``."""
    ctx = mp.start_processes(_rank_main, args=(job,), nprocs=world_size, join=False,
                             start_method=start_method)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
            return False
    return True


def measure(model_fn: Callable[[], nn.Module], inputs_fn: Callable[[], dict], *,
            strategy=None, world_size: int | None = None, loss_fn=None, optimizer_fn=None,
            keep_outputs: bool = True, warmup: int | None = None, settle_s: float = 1e-3,
            seed: int = 0, crosscheck: bool = False, accumulate: int = 1,
            autocast: torch.dtype | None = None, start_method: str = "forkserver",
            retries: int = 2, timeout_s: float = 600,
            run_timeout_s: float = 300) -> list[RankMemory]:
    """Run the step in ``world_size`` fresh processes (1 for :class:`Plain`) and return one
    :class:`RankMemory` per rank.

    ``model_fn()`` and ``inputs_fn()`` are called in each rank after ``torch.manual_seed(seed)``
    (identical weights and inputs on all ranks); with the ``spawn`` start method they and
    ``loss_fn``/``optimizer_fn(params)`` must be picklable (module-level functions or
    ``functools.partial``). ``crosscheck=True`` runs one more identical step under
    ``FSDPMemTracker`` (``MemTracker`` when not FSDP2) and stores its figures in
    ``RankMemory.crosscheck`` (not for :class:`DeepSpeed`). A run in which some free arrived on
    a gloo thread (so not in program order, see ``foreign_frees``), or whose ranks have not all
    finished after ``run_timeout_s``, is repeated up to ``retries`` times. ``warmup``: steps before the measured one; ``None``: 2 for
    :class:`DeepSpeed`, else 1. ``accumulate``: micro-batches per optimizer step (each
    ``loss / accumulate``, no ``no_sync``); ``autocast``: CPU autocast dtype over forward and
    loss (both not for :class:`DeepSpeed`, whose config says them).
    """
    import json

    import torch.distributed as dist
    import torch.multiprocessing as mp

    strategy = strategy if strategy is not None else Plain()
    if world_size is None:
        world_size = (1 if isinstance(strategy, Plain) else
                      strategy.dp * strategy.tp if isinstance(strategy, FSDP2TP) else 2)
    if isinstance(strategy, Plain) and world_size != 1:
        raise ValueError("Plain runs on one rank")
    if warmup is None:  # DeepSpeed creates some buffers lazily in its first steps
        warmup = 2 if isinstance(strategy, DeepSpeed) else 1
    if crosscheck and isinstance(strategy, DeepSpeed):
        raise ValueError("crosscheck is not available for DeepSpeed")
    if (accumulate != 1 or autocast is not None) and isinstance(strategy, DeepSpeed):
        raise ValueError("DeepSpeed's step: accumulation and precision are its config's")
    # the parent hosts the store on a free port picked by the OS: no port race
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=_timedelta(timeout_s))
    job = _Job(model_fn, inputs_fn, strategy, world_size, store.port, loss_fn, optimizer_fn,
               keep_outputs, warmup, settle_s, seed, crosscheck, accumulate, autocast)
    # DS_ACCELERATOR: the forkserver preloads deepspeed, which must resolve the CPU accelerator
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if start_method == "forkserver":
        _configure_forkserver()
    try:
        for attempt in range(1, retries + 2):
            for r in range(world_size):
                store.delete_key(f"result/{r}")
            job.attempt = attempt
            if not _run_ranks(mp, job, world_size, start_method, run_timeout_s):
                if attempt <= retries:
                    continue  # a rank hung (e.g. a lost gloo rendezvous): run them all again
                raise TimeoutError(f"the ranks did not finish within {run_timeout_s} s, "
                                   f"{attempt} times")
            results = []
            for r in range(world_size):
                status, data = json.loads(store.get(f"result/{r}"))
                if status != "ok":
                    raise RuntimeError(f"rank {r} failed:\n{data}")
                results.append(RankMemory(**{**data, "attempts": attempt}))
            if not any(r.foreign_frees for r in results):
                break
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results


# --------------------------------------------------------------------------------------------
# Demo


def _mib(n: int) -> str:
    return f"{n / 2**20:.4f} MiB"


def _demo():
    """Per-rank figures for the reference configurations, each run ``DIST_ORACLE_REPEATS``
    (default 2) times to check that the figures are identical."""
    mlp_in = functools.partial(mlp_inputs, batch=8)
    ll_in = functools.partial(llama_inputs, batch=2, seq=16)
    configs = [
        ("MLP plain 1 rank", mlp_model, mlp_in, Plain()),
        ("MLP FSDP2 2 ranks reshard_after_forward=True", mlp_model, mlp_in,
         FSDP2(reshard_after_forward=True)),
        ("MLP FSDP2 2 ranks reshard_after_forward=False", mlp_model, mlp_in,
         FSDP2(reshard_after_forward=False)),
        ("Llama plain 1 rank", llama_model, ll_in, Plain()),
        ("Llama FSDP2 2 ranks reshard_after_forward=True", llama_model, ll_in, FSDP2()),
        ("Llama TP2", llama_model, ll_in, TP()),
    ]
    repeats = int(os.environ.get("DIST_ORACLE_REPEATS", "2"))

    def key(rs):
        return [(r.peak, r.start, r.end, r.parameters, r.gradients, r.optimizer_states,
                 r.phase_peaks) for r in rs]

    for name, mf, inf, strat in configs:
        runs, walls = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runs.append(measure(mf, inf, strategy=strat, crosscheck=True))
            walls.append(time.perf_counter() - t0)
        same = all(key(r) == key(runs[0]) for r in runs)
        print(f"== {name}: wall {', '.join(f'{w:.1f}s' for w in walls)}; "
              f"repeatable: {same}; attempts {[r[0].attempts for r in runs]}; "
              f"{runs[0][0].optimizer}")
        for r in runs[0]:
            print(f"  rank {r.rank}: peak {r.peak} ({_mib(r.peak)}) in {r.peak_phase}; "
                  f"start {r.start}; end {r.end}; params {r.parameters} grads {r.gradients} "
                  f"optim {r.optimizer_states} buffers {r.buffers} inputs {r.inputs} "
                  f"other {r.other} {r.other_detail}; foreign_frees {r.foreign_frees}; "
                  f"step {r.step_s:.3f}s")
            print(f"    phase peaks {r.phase_peaks}")
            cc = r.crosscheck
            print(f"    {cc['tool']}: start {cc['start']} peak {cc['peak']}; "
                  f"ours - other - tool = {r.peak - r.other - cc['peak']}")
        if not same:
            for i, rs in enumerate(runs):
                print(f"  run {i}: {key(rs)}")
        sys.stdout.flush()


if __name__ == "__main__":
    _demo()

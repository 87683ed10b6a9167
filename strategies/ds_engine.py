"""DeepSpeed's own ZeRO engine, run inside the symbolic step (a :class:`memsim.tracer.Driver`).

``deepspeed.initialize`` builds the engine around the fake model on a fake process group, as
one rank of ``dp``; the step is the loop DeepSpeed users write::

    out = engine(**inputs)
    loss = loss_fn(out)
    engine.backward(loss)
    engine.step()          # reduces, steps the optimizer on this rank's partition, zeroes grads

so every buffer DeepSpeed allocates (flat 16-bit parameter groups, fp32 master partitions,
reduce buckets, stage 3's gathered parameters and prefetches, the step's flattened gradient
partitions) is a storage of the trace with its real lifetime. DeepSpeed runs with its CPU
accelerator (its code paths for streams and events are no-ops there); on CUDA it allocates the
same tensors. Modelling a GPU, the accelerator computes on the fake device ``cpu:1``, so that
what DeepSpeed places on ``cpu`` (ZeRO-Offload's partitions and buffers) is host memory
(:attr:`memsim.tracer.Driver.host_device`). What a fake tensor has no value for is answered as a
healthy step would: no overflow, equal lists on every rank (``scalar``). The client optimizer
is the one memsim is given (``zero_allow_untested_optimizer``); :func:`memsim.strategies.analyze`
gives torch's fused AdamW on CUDA in place of DeepSpeed's FusedAdam, torch's AdamW on the CPU.

deepspeed is an optional dependency (``pip install deepspeed``), imported when used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch

from memsim.tracer import Category, Driver, Precision, StrategyError
from memsim.tracer.recorder import outside_fake, real_meshes
from memsim.tracer.sources import calling_frame

__all__ = ["DeepSpeedDriver", "deepspeed_config"]


def deepspeed_config(zero, precision: Precision | str | None, tp: int = 1) -> dict:
    """The DeepSpeed config for :class:`~memsim.strategies.zero.ZeRO` settings at a memsim
    precision, with DeepSpeed's AutoTP over ``tp`` ranks when ``tp > 1``."""
    z = {"stage": zero.stage, "reduce_bucket_size": zero.reduce_bucket_size,
         "allgather_bucket_size": zero.allgather_bucket_size,
         "overlap_comm": zero.overlap, "contiguous_gradients": zero.contiguous_gradients,
         "sub_group_size": zero.sub_group_size}
    if zero.stage == 3:
        z.update(stage3_prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
                 stage3_param_persistence_threshold=zero.stage3_param_persistence_threshold,
                 stage3_max_live_parameters=zero.stage3_max_live_parameters,
                 stage3_max_reuse_distance=zero.stage3_max_reuse_distance)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_allow_untested_optimizer": True, "steps_per_print": 2**62,
           "wall_clock_breakdown": False, "zero_optimization": z}
    for key in ("offload_optimizer", "offload_param"):
        if getattr(zero, key) == "cpu":
            z[key] = {"device": "cpu"}
            # the client optimizer steps the host partitions (DeepSpeed's CPU Adam is a
            # compiled op; it allocates no step temporaries, torch's AdamW does, on the host)
            cfg["zero_force_ds_cpu_optimizer"] = False
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    prec = Precision.parse(precision)
    if prec in (Precision.BF16_MASTER, Precision.BF16_TRUE):
        cfg["bf16"] = {"enabled": True}
    elif prec is Precision.FP16_TRUE:
        cfg["fp16"] = {"enabled": True}
    elif prec is not Precision.TRUE32:
        raise StrategyError(
            f"precision {prec.value!r} under DeepSpeed ZeRO: DeepSpeed trains fp32 weights, or bf16 / "
            "fp16 weights with fp32 master partitions in its optimizer",
            hint="use precision '32-true', 'bf16-master' (DeepSpeed's bf16) or '16-true' "
                 "(its fp16)")
    return cfg


def _import_deepspeed():
    import warnings
    try:
        # its import warns, and its logger (made on import) writes to sys.stdout, where
        # memsim's JSON goes: point it at stderr
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            import deepspeed  # noqa: F401
    except ImportError as e:
        raise StrategyError("ZeRO is traced with DeepSpeed's own code, and deepspeed does not "
                            f"import here ({e})",
                            hint="pip install deepspeed (DS_BUILD_OPS=0 needs no compiler)"
                            ) from e
    return sys.modules["deepspeed"]


def _apply(self, fn, recurse=True):
    """``Module._apply`` as eager PyTorch runs it on plain tensors (``param.data = fn(param)``):
    torch swaps fake parameters instead, which fails while anything else references them."""
    if recurse:
        for m in self.children():
            m._apply(fn)
    for param in self._parameters.values():
        if param is None:
            continue
        with torch.no_grad():
            new = fn(param)
        if new is not param:
            param.data = new
            if hasattr(param, "fake_device"):  # a fake tensor keeps its device on the object
                param.fake_device = new.device
        if param.grad is not None:
            with torch.no_grad():
                g = fn(param.grad)
            if g is not param.grad:
                param.grad.data = g
    for key, buf in self._buffers.items():
        if buf is not None:
            self._buffers[key] = fn(buf)
    return self


# what DeepSpeed's ZeRO optimizers hold, by attribute name
_HOLDS = {Category.PARAMETER: ("bit16_groups_flat", "fp16_partitioned_groups_flat"),
          Category.OPTIMIZER_STATE: ("single_partition_of_fp32_groups",
                                     "fp32_partitioned_groups_flat"),
          Category.GRADIENT: ("grad_partitions_flat_buffer", "grads_in_partition", "ipg_buffer",
                              "averaged_gradients")}

# .item() reads in DeepSpeed's code, by the function that makes them: a healthy step has no
# overflow, no non-finite gradient, no parameter modified outside the engine
_ZERO_READS = ("overflow", "inf_or_nan", "invalid", "_exit")


# Modelling a GPU, the accelerator is the CPU as the fake device "cpu:1": what DeepSpeed keeps
# on "cpu" (ZeRO-Offload's host buffers, torch's step counters) stays apart from what it keeps
# on its accelerator, and its code takes the paths it takes when the two differ
GPU_DEVICE = "cpu:1"
_GPU = torch.device(GPU_DEVICE)


def _on_the_gpu(factory):
    """``factory`` (``torch.tensor``, ``torch.as_tensor``) asked for the fake GPU device
    ``cpu:1`` makes its tensor there: torch makes it on ``cpu``, as every CPU tensor made from
    data, where on a GPU it would be on the GPU (Hugging Face's KV cache starts as
    ``torch.tensor([], device=key_states.device)``, then concatenates the keys to it: the
    devices differed and the step failed)."""
    def made(data, *args, **kwargs):
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        t = factory(data, *args, **kwargs)
        if device is not None and torch.device(device) == _GPU and t.device != _GPU:
            # (.to() keeps a CPU tensor where it is: torch counts every CPU as one device)
            t = torch.empty(t.shape, dtype=t.dtype, device=_GPU).copy_(t).requires_grad_(
                t.requires_grad)
        return t

    return made


def _accelerator(cpu_accelerator, device: str):
    """DeepSpeed's CPU accelerator computing on the fake ``device``."""

    class Accelerator(cpu_accelerator):
        def device_name(self, device_index=None):
            return device

        def current_device_name(self):
            return device

        def is_fp16_supported(self):
            # DeepSpeed refuses fp16 on its CPU accelerator; a GPU has it (fp16 is traced, but
            # no CPU run can check it)
            return True

    return Accelerator()


class DeepSpeedDriver(Driver):
    """One rank of DeepSpeed ZeRO over ``world`` ranks (see the module docstring)."""

    # Stage 3's parameter coordinator (0.19.8) records its trace in the first step and
    # completes it at the start of the second (reset_step, a forward pre-hook of the root),
    # which prefetches as every later step does: the step after one warm-up step has the same
    # bytes as after two (all of tests/test_zero.py; a step traced before the trace completes
    # fails 11 of its 19 tests). One warm-up step is traced, its output and loss held into the
    # measured step until the loop rebinds them. Modelling CUDA, the caching allocator replay
    # (analysis/reserved.py) starts from the traced history, walks the measured step once more
    # (``replays``), then again until a walk changes neither a figure nor the cache's blocks;
    # every figure then equals that of two traced warm-ups or more (benchmarks/ds_warmups.py:
    # 2 of Llama-2-7B's layers, bf16, 8 ranks, 1 to 4 warm-ups, traced or replayed, at
    # B = 2, S = 512 and B = 4, S = 2048).
    warmup = 1
    replays = 0
    host_device = torch.device("cpu")

    def __init__(self, config: dict, world: int, rank: int = 0, gpu: bool = True):
        self.config, self.world, self.rank = config, world, rank
        # stages 0-2 allocate everything they keep in their first step: the replay's figures
        # after one warm-up step and after two agree (benchmarks/ds_warmups.py --stage 2;
        # tests/test_zero.py compares the bytes with real runs after two)
        if config.get("zero_optimization", {}).get("stage", 0) >= 3 and gpu:
            self.replays = 1
        self.device = GPU_DEVICE if gpu else "cpu"
        self.engine = None

    @contextlib.contextmanager
    def context(self):
        _import_deepspeed()
        import deepspeed.comm.comm  # noqa: F401
        import deepspeed.comm.torch  # noqa: F401
        import deepspeed.module_inject.layers  # noqa: F401
        import deepspeed.runtime.zero.utils  # noqa: F401
        import deepspeed.utils.groups  # noqa: F401
        # (deepspeed.comm's own name "torch" is the torch package: look the modules up)
        cc, dct, zu = (sys.modules[f"deepspeed.{m}"] for m in ("comm.comm", "comm.torch",
                                                                "runtime.zero.utils"))
        from deepspeed import accelerator as acc
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        env = {"LOCAL_RANK": str(self.rank), "RANK": str(self.rank),
               "WORLD_SIZE": str(self.world)}
        old_env = {k: os.environ.get(k) for k in env}
        saved = [(torch.nn.Module, "_apply", _apply),
                 (dct, "build_shm_op", lambda: None),  # a JIT-built op for CPU collectives
                 (zu, "assert_lst_len_same_as_other_ranks", _same_len),
                 (zu, "get_lst_from_rank0", _from_rank0),
                 (cc, "cdb", None),
                 (dct.TorchBackend, "init_device_mesh", _real_mesh(dct.TorchBackend))]
        # DeepSpeed's process-group and AutoTP state are module globals: fresh for each run
        groups = sys.modules["deepspeed.utils.groups"]
        saved += [(groups, k, {} if isinstance(v, dict) else None) for k, v in vars(groups).items()
                  if (k.isupper() and k.startswith("_") and k.endswith(("GROUP", "RANKS",
                                                                          "WORLD_SIZE", "RANK")))
                  or k in ("mesh_device", "mpu")]
        layers = sys.modules["deepspeed.module_inject.layers"]
        saved.append((layers, "DEEPSPEED_AUTOTP_MODE", layers.DEEPSPEED_AUTOTP_MODE))
        if self.device == GPU_DEVICE:
            saved += [(torch, "tensor", _on_the_gpu(torch.tensor)),
                      (torch, "as_tensor", _on_the_gpu(torch.as_tensor))]
        saved = [(obj, name, getattr(obj, name), new) for obj, name, new in saved]
        # ZeRO-3 swaps torch.nn.functional.linear for its own autograd function and leaves it
        # there ("this will persist unless manually reset"): a later analysis in the same
        # process then traced DeepSpeed's linear (TP x LoRA on Llama: 501,128 B, not 460,168)
        linear = torch.nn.functional.linear
        real_acc = acc.real_accelerator.ds_accelerator
        log = logging.getLogger("DeepSpeed")
        level = log.level
        try:
            os.environ.update(env)
            for obj, name, _, new in saved:
                setattr(obj, name, new)
            acc.set_accelerator(_accelerator(CPU_Accelerator, self.device))
            log.setLevel(logging.ERROR)
            with _quiet(), contextlib.redirect_stdout(sys.stderr):
                yield
        finally:
            log.setLevel(level)
            torch.nn.functional.linear = linear
            acc.real_accelerator.ds_accelerator = real_acc
            for obj, name, old, _ in reversed(saved):
                setattr(obj, name, old)
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def setup(self, model, params, optimizer):
        import deepspeed

        from .mesh import process_group

        process_group(self.world, self.rank)
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                                        verbose=False)
        try:
            with real_meshes():
                self.engine, *_ = deepspeed.initialize(model=model, model_parameters=params,
                                                       optimizer=optimizer(params),
                                                       config=self.config)
        except ValueError as e:
            if "tp_plan" not in str(e):
                raise
            # DeepSpeed's own limit (module_inject/tp_plan_converter.py): a real run stops here
            raise StrategyError(
                "DeepSpeed's AutoTP refuses the model's Hugging Face tensor-parallel plan: "
                + str(e).split(". ")[0],
                hint="a real DeepSpeed run fails the same way; PyTorch's tensor parallelism "
                     "reads this plan (--tp without --zero, or with --fsdp)") from e
        # AutoTP's one-time check that every TP rank got the same batch (it pickles the inputs)
        check = getattr(self.engine, "first_dataloader_check", None)
        if check is not None:
            check.remove()
        return self.engine

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def scalar(self, t):
        f = calling_frame(lambda name: "/deepspeed/" in name)
        if f is not None and any(k in f.f_code.co_name for k in _ZERO_READS):
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        return None

    def label(self, recorder):
        e = self.engine
        opt = e.optimizer
        for p in e.module.parameters():
            recorder.set_category(p, Category.PARAMETER)
            ds = getattr(p, "ds_tensor", None)
            if ds is not None:
                recorder.set_category(ds, Category.PARAMETER)
        for cat, names in _HOLDS.items():
            for name in names:
                for t in _tensors(getattr(opt, name, None)):
                    recorder.set_category(t, cat)
        _label_master_grads(opt, recorder)
        inner = getattr(opt, "optimizer", None)
        for state in (getattr(inner, "state", None) or {}).values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    recorder.set_category(v, Category.OPTIMIZER_STATE)

    def label_gradients(self, recorder):
        opt = self.engine.optimizer
        for p in self.engine.module.parameters():
            if p.grad is not None:
                recorder.set_category(p.grad, Category.GRADIENT)
        for name in _HOLDS[Category.GRADIENT]:
            for t in _tensors(getattr(opt, name, None)):
                recorder.set_category(t, Category.GRADIENT)
        _label_master_grads(opt, recorder)


def _label_master_grads(opt, recorder) -> None:
    """The fp32 master partitions' own gradients are gradients (ZeRO-Offload keeps one on the
    host for the CPU optimizer, besides the partition buffer the reduction writes)."""
    for name in _HOLDS[Category.OPTIMIZER_STATE]:
        for t in _tensors(getattr(opt, name, None)):
            if t.grad is not None:
                recorder.set_category(t.grad, Category.GRADIENT)


def _real_mesh(backend):
    """AutoTP's device mesh, built outside the fake mode (its rank table is real integers), on
    the CPU's device type: DeepSpeed names its accelerator's device, and torch refuses the fake
    GPU device's "cpu:1" ("Device type with index is not supported"); the mesh holds no
    tensor of the step."""
    def init_device_mesh(self, mesh_shape, mesh_dim_names):
        from torch.distributed.device_mesh import init_device_mesh as make
        return make("cpu", mesh_shape, mesh_dim_names=mesh_dim_names)

    return outside_fake(init_device_mesh)


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _same_len(lst) -> None:
    """DeepSpeed's check that every rank's list has rank 0's length: every simulated rank runs
    the same program, so it holds; the tensor it broadcasts is still made."""
    torch.tensor(len(lst), dtype=int, device="cpu")


def _from_rank0(lst):
    """Rank 0's copy of a list of ints (every simulated rank has the same)."""
    torch.tensor(lst, dtype=int, device="cpu")
    return list(lst)


@contextlib.contextmanager
def _quiet():
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        warnings.filterwarnings("ignore", module="deepspeed")
        warnings.filterwarnings("ignore", message=".*torch.jit.script_method.*is deprecated")
        # DeepSpeed calls torch.distributed's older collective names
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=".*(all_gather_into_tensor|reduce_scatter_tensor)")
        yield

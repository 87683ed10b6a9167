"""PyTorch's cache of fake kernels' results in a symbolic run: where it is on
(:func:`apply_policy`, :data:`FAKE_CACHE`), and its entries made only where a cached run is the
uncached one, event for event.
"""

from __future__ import annotations

import contextlib

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .recorder import as_expr, patched


# PyTorch's cache of fake kernels' results (on by default in FakeTensorMode). Each miss builds
# an entry and checks it with a second fake output, so the cache pays only where most ops hit
# it (about 70% or more, by the timings below). Over a model's symbolic sizes most miss
# (Qwen3-Next: 37% hits, 2.9-3.7 s without against 5.4-6.0 s with; Llama under FSDP2: 60%) and
# a plain run is traced without it. A library's loop hits it (DeepSpeed's ZeRO-3 over its flat
# buffers at Llama-2-7B's widths: 84%, 26.4 s with against 32.7 s without) and a driven run
# keeps it. A loop over time steps at fixed sizes hits it too (a fitted GRU: 78%, 12-13 s with
# against 14-16 s without), which this rule does not see. ``True``/``False`` force it either way;
# ``python -m benchmarks.fake_cache [--deepspeed]`` times them. Where it is on, an output whose
# remade storage is not the kernel's to the expression is not cached (:func:`_faithful_fake_cache`)
# and the run is the same event for event; the cache's keys add guards of their own
# (tests/test_symcache.py).
FAKE_CACHE: bool | None = None


def apply_policy(stack: contextlib.ExitStack, mode: FakeTensorMode, driven: bool) -> None:
    """Turn ``mode``'s cache on for a library's loop (``driven``) and off for a plain run, or
    as :data:`FAKE_CACHE` forces it; where it is on, its entries are faithful
    (:func:`_faithful_fake_cache`). Before ``mode`` is entered."""
    mode.cache_enabled = FAKE_CACHE if FAKE_CACHE is not None else driven
    if mode.cache_enabled:
        stack.enter_context(_faithful_fake_cache())


@contextlib.contextmanager
def _faithful_fake_cache():
    """PyTorch's cache of fake kernels' results remakes an op's output as ``empty_strided`` of
    its sizes and strides, whose storage is the span of those: by PyTorch's formula, not the
    kernel's. An entry is made only where the remade storage's size and offset are the
    kernel's (the same expressions once expanded), so that a cached run is the uncached one,
    event for event. Where they are not (CUDA attention's sliding-window mask in Mistral, padded
    to a multiple of 8 and sliced: ``Max(1, S - Mod(S, 8) + 8)`` in the span, equal for every
    S >= 1 but not provably so here; and any kernel whose output would not span its storage),
    the op runs each time."""
    from torch._subclasses.fake_tensor import _BypassDispatchCache
    last: list = []    # while an entry is made: the output PyTorch remakes from it

    def remaking(remade):
        def remake(self, *args, **kwargs):
            out = remade(self, *args, **kwargs)
            if last:
                last[0] = out
            return out
        return remake

    def checking(made):
        def checked(self, state, key, func, args, kwargs, output):
            # PyTorch checks a new entry by remaking the output from it once (``remake``); a
            # hit's output is not kept here (holding it would delay its release)
            last.append(None)
            try:
                info = made(self, state, key, func, args, kwargs, output)
                again = last[0]
            finally:
                last.clear()
            if info.metadata is not None and info.view_idx is None and not (
                    isinstance(again, torch.Tensor)
                    and _same_size(again.untyped_storage().nbytes(),
                                   output.untyped_storage().nbytes())
                    and _same_size(again.storage_offset(), output.storage_offset())):
                raise _BypassDispatchCache("remade storage is not the kernel's")
            return info
        return checked

    with patched(FakeTensorMode, "_output_from_cache_entry", remaking), \
            patched(FakeTensorMode, "_get_output_info_for_cache_entry", checking):
        yield


def _same_size(a, b) -> bool:
    """Whether two sizes are the same expression as the recorder records them
    (:func:`~memsim.tracer.recorder.as_expr`), or once expanded; no guard is added."""
    a, b = as_expr(a), as_expr(b)
    return a == b or sympy.expand(a - b) == 0

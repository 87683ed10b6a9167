"""Activation checkpointing's recomputation in a symbolic run: memsim's torch-function modes
entered again around the forward that backward recomputes.
"""

from __future__ import annotations

import contextlib

import torch

from .recorder import Recorder


@contextlib.contextmanager
def modes_in_recompute(recorder: Recorder | None = None):
    """Keep memsim's torch-function modes (CUDA kernel choices, CUDA autocast policy) on in the
    forward that non-reentrant activation checkpointing recomputes during backward.

    The autograd engine does not carry torch-function modes into backward, so the recomputed
    forward would otherwise pick CPU kernels (e.g. SDPA's math path) and fail checkpoint's
    metadata check. The modes active when a checkpointed region runs forward are entered again
    around its recomputation; a real run has no modes, and its kernel choice is the same both
    times. The recomputation stops early (an exception, once the tensors backward needs are
    back), which skips the forward hooks that pop ``recorder.module_stack``: the stack is cut
    back to its depth at the start of the recomputation when it ends.
    """
    import torch.utils.checkpoint as ckpt
    from torch.overrides import _get_current_function_mode_stack

    orig = ckpt._checkpoint_without_reentrant_generator

    def generator(fn, preserve_rng_state=True, context_fn=ckpt.noop_context_fn, *rest,
                  **kwargs):
        if torch.compiler.is_compiling():
            # --compiled: checkpoint as Dynamo rewrites it (nothing runs again eagerly).
            from .compiled import compiled_checkpoint
            return compiled_checkpoint(orig, fn, context_fn, rest, kwargs)
        modes = list(_get_current_function_mode_stack())

        def context():
            fwd, rec = context_fn()
            return fwd, _Recompute(rec, modes, recorder)

        return orig(fn, preserve_rng_state, context, *rest, **kwargs)

    ckpt._checkpoint_without_reentrant_generator = generator
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = orig


class _Recompute:
    """The recomputation context of one checkpointed region: the context ``context_fn`` gave
    (``rec``) with memsim's torch-function modes ``modes`` entered inside it, and
    ``recorder.module_stack`` cut back to its depth at the start when it ends.

    It holds ``rec`` as long as checkpoint holds it, as a real run does: ``recompute_fn``'s
    closure keeps its context, so for as long as the region's ``_CheckpointFrame`` lives (until
    backward has released every tensor the region saved). For selective checkpointing ``rec``
    is ``_CachedTorchDispatchMode``, whose ``storage`` keeps the outputs the policy saved; the
    recomputation stops early and never consumes the cached outputs backward does not need (a
    region's last matmul, say), which stay until the frame dies. A generator context manager
    (``contextlib.contextmanager``) would let go of ``rec`` when its generator finishes, right
    after the recomputation, and free those outputs too soon. Reusable, as ``rec`` is: a second
    backward (``retain_graph=True``) recomputes again."""

    def __init__(self, rec, modes: list, recorder: Recorder | None):
        self.rec = rec
        self.modes = modes
        self.recorder = recorder
        self._open: list[tuple[contextlib.ExitStack, int]] = []

    def __enter__(self):
        depth = len(self.recorder.module_stack) if self.recorder is not None else 0
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self.rec)
            for m in self.modes:
                stack.enter_context(m)
        except BaseException:
            stack.close()
            raise
        self._open.append((stack, depth))

    def __exit__(self, *exc):
        stack, depth = self._open.pop()
        try:
            return stack.__exit__(*exc)
        finally:
            if self.recorder is not None:
                del self.recorder.module_stack[depth:]

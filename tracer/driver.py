"""A training loop owned by a library (DeepSpeed's engine), in place of the plain one."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


class Driver:
    """A training loop owned by a library (DeepSpeed's engine), in place of the plain one.

    :func:`memsim.tracer.step.run_step` calls ``setup`` once inside the symbolic run (its
    allocations are the step's starting state), runs ``warmup`` whole steps, calls ``label`` to
    name what the library holds (:meth:`Recorder.set_category`), then records one step::

        out = call(**inputs)
        loss = loss_fn(out)
        driver.backward(loss)
        driver.step()
    """

    warmup = 2
    # more steps the caching-allocator replay walks (the measured step again) after the traced
    # warm-up steps and before the one it measures (:attr:`RunRecord.replays`)
    replays = 0
    device = "cpu"  # the (fake) device the engine computes on; the inputs are made there
    # the engine runs forward, loss and backward itself in what ``setup`` returns (a pipeline
    # schedule): the loop then calls only that, ``zero_grad`` before it and ``step`` after,
    # and the step's loss function is ``loss_fn``, set before ``setup``
    owns_backward = False
    loss_fn = None
    # the loop's precision applies around what ``setup`` returns (autocast, the parameters
    # cast for *-true), as the step's ``precision`` says; else the engine owns it
    precision_ok = False
    precision = None
    host_device = None  # where the engine puts host memory (offload), if it has any

    def context(self) -> contextlib.AbstractContextManager:
        """Entered around the whole symbolic run, outside the fake mode."""
        return contextlib.nullcontext()

    def prepare(self, model: torch.nn.Module, recorder) -> None:
        """Change the run's copy of the model before its parameters are made fake and
        registered (a pipeline rank drops the stages it does not hold)."""

    def setup(self, model: torch.nn.Module, params: list, optimizer: Callable) -> Callable:
        """Build the engine around ``model``; return what runs the forward."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Where the loop zeroes the gradients (an engine that does not do it in ``step``)."""

    def scalar(self, t: torch.Tensor):
        """The value the engine's code reads with ``.item()`` from ``t`` (a fake tensor has
        none), or None for memsim's default (:mod:`memsim.tracer.kernels`)."""
        return None

    def label(self, recorder) -> None:
        """Set the categories of what the engine holds (after the warm-up steps)."""

    def label_gradients(self, recorder) -> None:
        """Set the categories of the gradients the backward produced."""

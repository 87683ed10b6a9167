"""The previous step's output and loss, alive into the measured step as a Python loop keeps them.

A training loop rebinds its names, it does not delete them::

    for batch in loader:
        optimizer.zero_grad(set_to_none=True)
        out = model(**batch)     # the previous step's `out` is released here, once forward returns
        loss = loss_fn(out)      # the previous `loss` here, once the new one exists
        loss.backward()
        optimizer.step()

so in the steady state the previous step's output (logits, and whatever else it holds: a Hugging
Face model's KV cache, its hidden states) is alive through ``zero_grad`` and the whole forward,
and the previous loss until the new loss is computed. The plain loop's warm-up is synthetic (no
forward runs before the measured step), so the run gets, for each storage the measured step's
own output and loss hold at its end, one of the same size, category and stream that is alive
when the step starts (:attr:`Storage.op` ``"<previous output>"`` or ``"<previous loss>"``) and
released where the loop rebinds the name: as the first forward returns (before the loss
phase's mark), and as the first loss is computed (before the backward phase's mark). An
inference loop (``out = model(**batch)`` under ``torch.no_grad()``) rebinds ``out`` the same
way: the previous forward's output is alive through the forward and released as it returns,
after the new output exists (at the run's end). A library's loop
(:class:`~memsim.tracer.driver.Driver`) traces its warm-up step's forward, and keeps that
step's output and loss itself (:mod:`memsim.tracer.step`).
"""

from __future__ import annotations

import types

import torch

from .records import Category, Event, Phase, RunRecord, Storage

# what the previous step's output and loss cannot hold beyond what the step holds anyway
_STATE = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.BUFFER,
          Category.INPUT)
_OPAQUE = (torch.nn.Module, torch.optim.Optimizer, type, types.ModuleType, types.FunctionType,
           types.MethodType, types.BuiltinFunctionType, str, bytes, int, float, bool,
           type(None))


def reachable_tensors(obj, limit: int = 200_000) -> list[torch.Tensor]:
    """The tensors ``obj`` holds: through containers (dict, list, tuple, set), Hugging Face's
    ``ModelOutput`` (a dict) and objects' attributes (a ``DynamicCache`` and its layers); not
    into modules, optimizers, functions or tensors' own attributes. ``limit``: objects
    visited at most."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = [obj]
    while todo and len(seen) < limit:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, _OPAQUE):
            continue
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo.extend(o)
        else:
            attrs = getattr(o, "__dict__", None)
            if isinstance(attrs, dict):
                todo.extend(attrs.values())
            for name in getattr(type(o), "__slots__", ()):
                if isinstance(name, str) and hasattr(o, name):
                    todo.append(getattr(o, name))
    return found


def mark_held(run: RunRecord, sid_of, out, loss) -> None:
    """Flag the storages the measured step makes that ``out`` and ``loss`` hold at its end
    (:attr:`Storage.held`); ``sid_of`` maps a tensor to its storage id, ``out`` is None where
    the loop drops it after the loss."""
    made = _made_in_step_and_held(run)
    for what, obj in (("output", out), ("loss", loss)):
        for sid in storage_ids(obj, sid_of):
            if sid in made and run.storages[sid].held != "loss":
                run.storages[sid].held = what


def held_items(run: RunRecord) -> list[tuple[str, list[int], int]]:
    """``(what, storages, release)`` for the previous step's output and loss: the storages
    flagged :attr:`Storage.held` that are alive at the run's end, and the index of the event
    before which the loop releases their copies (the first loss and backward marks of the
    measured step; an inference run's end); empty where nothing is held."""
    loss_at = _first_mark(run, Phase.BACKWARD)
    out_at = _first_mark(run, Phase.LOSS)
    if out_at is None and loss_at is None and run.marks:
        # inference (a forward only): the loop's `out = model(...)` releases the previous
        # output as the forward returns, after the new output exists
        out_at = len(run.events)
    if out_at is None:
        return []
    made = _made_in_step_and_held(run)
    got = []
    for what, at in (("output", out_at), ("loss", loss_at)):
        if at is None:
            continue
        sids = [s.sid for s in run.storages if s.held == what and s.sid in made]
        if sids:
            got.append((what, sids, at))
    return got


def add_previous_step(run: RunRecord) -> None:
    """Give ``run`` the previous step's output and loss (module docstring), from the storages
    flagged :attr:`Storage.held` (which a folded run's copies of the blocks keep)."""
    items = held_items(run)
    if not items or any(s.op.startswith("<previous ") for s in run.storages):
        return   # nothing held, or added already
    born = _time(run, run.start)
    plus, frees = [], []
    for what, sids, at in items:
        gone = []
        for sid in sids:
            src = run.storages[sid]
            g = len(run.storages)
            run.storages.append(Storage(
                sid=g, nbytes=src.nbytes, device=src.device, alloc=born, phase=Phase.SETUP,
                module=None, op=f"<previous {what}>", category=src.category,
                stream=src.stream, free=_time(run, at)))
            plus.append(Event(+1, g, born))
            gone.append(Event(-1, g, _time(run, at)))
        frees.append((at, gone))
    insert_events(run, [(run.start, plus)] + frees)


def insert_events(run: RunRecord, inserts: list) -> None:
    """Insert events into ``run``: each ``(index, events)`` puts ``events`` before the run's
    event ``index``, and before every position the run keeps there (its start, phase marks
    and ends, gradient-ready notes), which move with the events after them."""
    inserts = sorted(((i, evs) for i, evs in inserts if evs), key=lambda x: x[0])
    if not inserts:
        return

    def moved(i: int) -> int:
        return i + sum(len(evs) for j, evs in inserts if j <= i)

    old = run.events
    new: list[Event] = []
    k = 0
    for i in range(len(old) + 1):
        while k < len(inserts) and inserts[k][0] == i:
            new.extend(inserts[k][1])
            k += 1
        if i < len(old):
            new.append(old[i])
    run.start = moved(run.start)
    run.marks = [(p, moved(i)) for p, i in run.marks]
    run.phase_ends = {p: moved(i) for p, i in run.phase_ends.items()}
    run.grad_ready = [(moved(i), sid) for i, sid in run.grad_ready]
    run.events = new


def _made_in_step_and_held(run: RunRecord) -> set[int]:
    """Storages allocated in the measured step and alive at its end, other than model state,
    buffers and inputs."""
    first, alive = {}, {}
    for i, e in enumerate(run.events):
        if e.sign > 0:
            first.setdefault(e.sid, i)
        alive[e.sid] = e.sign > 0
    return {sid for sid, i in first.items() if i >= run.start and alive[sid]
            and run.storages[sid].category not in _STATE}


def storage_ids(obj, sid_of) -> list[int]:
    """The storage ids of the tensors ``obj`` holds (:func:`reachable_tensors`)."""
    if obj is None:
        return []
    return [s for s in (sid_of(t) for t in reachable_tensors(obj)) if s is not None]


def _first_mark(run: RunRecord, phase: Phase) -> int | None:
    return next((i for p, i in run.marks if p is phase and i >= run.start), None)


def _time(run: RunRecord, i: int) -> int:
    """The op-index time of an event put before event ``i``: that of the event before it (the
    ops recorded after that event, which allocate nothing, come after the new one)."""
    return run.events[i - 1].time if i > 0 else 0

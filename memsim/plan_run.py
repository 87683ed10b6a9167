"""Where ``memsim plan``'s programs are traced: in this process, or as tasks of a Ray cluster.

A :class:`Job` is everything a program's analysis needs, as plain data (the target's name, not
the model): a worker loads the model itself, traces the program once and answers each of its
layouts (:func:`answer`). The same function runs in this process (the default) and as a Ray
task (``--cluster ADDRESS``, or ``--cluster local`` for a Ray cluster of this machine's
processes), so a plan is the same wherever it ran.

Ray, not a scheduler of our own: it places the tasks, retries one whose worker process died
(``max_retries``), and its local cluster is the same program as a real one. Dask's
``distributed`` would do the same; Ray is the one of the two that installs here (an optional
extra, ``pip install 'memsim[cluster]'``, imported only for ``--cluster``).

``MEMSIM_PLAN_TEST_CRASH=FILE`` is a test hook: the first task that finds no ``FILE`` creates it
and kills its own process, as a worker lost mid-task would die.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

from memsim.tracer import InputError, MemsimError, UsageError

from .plan import Layout, Planned

__all__ = ["Job", "answer", "locally", "on_ray", "connect"]


@dataclass(frozen=True)
class Job:
    """What every program of one plan shares."""

    target: str                 # as given, a relative path resolved against ``cwd``
    hf_class: str | None
    inputs: tuple[str, ...]     # the --input specs
    config: object              # memsim.tracer.StepConfig
    setup: tuple                # (GPU or None, capacity or None, Overheads)
    margin: float
    point: tuple[tuple[str, int], ...]   # the other symbols' sizes (the sequence)
    batch: str
    seq: str
    cwd: str                    # where the command ran: the target's paths and modules


_models: dict = {}   # target -> model, per process


def _model(job: Job):
    from .target import load_target
    key = (job.cwd, job.target, job.hf_class)
    if key not in _models:
        if job.cwd not in sys.path:
            sys.path.insert(0, job.cwd)
        target = job.target
        where, _, name = target.rpartition(":")
        if where.endswith(".py") and not os.path.isabs(where):
            target = f"{os.path.join(job.cwd, where)}:{name}"
        _models[key] = load_target(target, job.hf_class)
    return _models[key]


def answer(job: Job, lays: list[Layout]) -> tuple[list[Planned], int]:
    """One program's layouts answered here: ``(rows, symbolic runs started)``. A model that
    refuses the program (a degree it does not divide) makes every layout's row say why."""
    crash = os.environ.get("MEMSIM_PLAN_TEST_CRASH")
    if crash and not os.path.exists(crash):
        open(crash, "w").close()
        os._exit(17)
    from memsim.tracer import progress
    before = progress.traces()
    rows: list[Planned] = []
    try:
        report = _analysis(job, lays)
    except MemsimError as e:
        return [Planned(lay, reason=f"not valid for this model: {e.message}")
                for lay in lays], progress.traces() - before
    for lay in sorted(lays, key=lambda lay: lay.micro_batch):
        try:
            b, states, peak = _budget(job, report, {**dict(job.point),
                                                    job.batch: lay.micro_batch})
        except MemsimError as e:
            rows.append(Planned(lay, reason=f"not answered: {e.message}"))
            continue
        rows.append(Planned(lay, b.total, peak, states, b.headroom, b.fits))
    return rows, progress.traces() - before


def _analysis(job: Job, lays: list[Layout]):
    from memsim.analysis import fix_inputs, pinning_fixed
    from memsim.strategies import FSDP, TensorParallel
    from memsim.strategies import analyze as analyze_with
    from memsim.tracer import parse_input

    model = _model(job)
    inputs = {s.name: s for s in (parse_input(t) for t in job.inputs)}
    lay = lays[0]
    kw: dict = {}
    if lay.tp > 1:
        kw["tp"] = TensorParallel(lay.tp)
    if lay.dp > 1:
        kw["fsdp"] = FSDP(dp=lay.dp)
    if lay.checkpoint != "none":
        kw["checkpoint"] = lay.checkpoint
    cfg = job.config.replace(accumulate=2 if lay.accumulate > 1 else 1)
    points = [{**dict(job.point), job.batch: x.micro_batch} for x in lays]
    if all(p[job.batch] == 1 for p in points):
        # only micro-batch 1, below the formulas' range: traced at it, not beside them
        one = {job.batch: 1}
        return pinning_fixed(lambda m, i, c, fixed, **k: analyze_with(
            m, fix_inputs(i, one), c.fixing(one), fixed={**fixed, **one}, **k),
            model, inputs, cfg, points[-1], train=True, inference=False, **kw)
    return pinning_fixed(analyze_with, model, inputs, cfg, points[-1], train=True,
                         inference=False, points=points, **kw)


def _budget(job: Job, report, at: dict):
    from memsim.analysis.budget import against

    from .cli import figures_at, model_states, worst_rank
    if job.batch in report.fixed and report.fixed[job.batch] != at[job.batch]:
        raise UsageError(f"the model pins {job.batch} to {report.fixed[job.batch]}",
                         hint="pin the micro-batch with --fix micro_batch=N")
    at = {k: v for k, v in at.items() if k not in report.fixed}
    rep = worst_rank(report, at)
    figs = figures_at(rep, at)
    device, cap, overheads = job.setup
    b = against(rep, at, gpu=device, capacity=cap, margin=job.margin, overheads=overheads,
                batch=job.batch, seq=job.seq)
    return b, model_states(figs), figs["peak"]


def locally(job: Job, programs: list[list[Layout]],
            said=None) -> Iterator[tuple[list[Planned], int]]:
    """Each program answered in this process, one after the other (``said(layouts)`` as
    each starts)."""
    from memsim.tracer import progress
    for i, lays in enumerate(programs):
        progress.expect(len(programs) - i)   # this one and those after it (a floor)
        if said is not None:
            said(lays)
        yield answer(job, lays)


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` (``local``: start one of this machine's
    processes), before any trace: a typed error naming ``--cluster`` where Ray is missing or
    the address does not answer."""
    if address != "local":
        _answers(address)
    try:
        import ray
    except ImportError:
        raise UsageError("--cluster runs the traces on Ray, which is not installed",
                         hint="pip install 'memsim[cluster]' (or drop --cluster: the traces "
                              "then run in this process)") from None
    if ray.is_initialized():
        return
    import logging
    try:
        ray.init(address=None if address == "local" else address, log_to_driver=False,
                 logging_level=logging.ERROR, include_dashboard=False,
                 configure_logging=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise _silent(address, e) from None


def _answers(address: str, timeout: float = 5.0) -> None:
    """Something accepts connections at ``host:port`` (Ray's own connect waits a minute per
    try for an address where nothing listens)."""
    import socket
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--cluster {address!r} is not host:port or local",
                         hint="the address 'ray start --head' prints, e.g. 10.0.0.1:6379")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as e:
        raise _silent(address, e) from None


def _silent(address: str, why: Exception) -> InputError:
    return InputError(f"--cluster {address}: no Ray cluster answers there ({why})",
                      hint="start one with 'ray start --head' and give its address "
                           "(host:port), or --cluster local")


def on_ray(job: Job, programs: list[list[Layout]]) -> Iterable[tuple[list[Planned], int]]:
    """Every program as a Ray task at once (the cluster joined by :func:`connect`), their
    answers in order; a task that failed even after Ray's retries makes its layouts' rows
    say so."""
    import contextlib

    import ray
    out = []
    # Ray's driver prints what the cluster reports (a worker that died) on sys.stdout, where
    # --json's document goes: to stderr while the driver is connected
    with contextlib.redirect_stdout(sys.stderr):
        try:
            task = ray.remote(max_retries=3)(answer)
            refs = [task.remote(job, lays) for lays in programs]
            for ref, lays in zip(refs, programs):
                try:
                    out.append(ray.get(ref))
                except Exception as e:   # Ray's own errors: a task lost beyond its retries
                    text = str(e).strip()
                    why = text.splitlines()[0] if text else type(e).__name__
                    out.append(([Planned(lay, reason=(
                        f"not answered: its trace failed on the cluster "
                        f"({type(e).__name__}: {why})")) for lay in lays], 0))
        finally:
            ray.shutdown()   # the driver leaves; the cluster stays
    return out

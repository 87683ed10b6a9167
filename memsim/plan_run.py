"""Where ``memsim plan``'s programs are traced: in processes of this machine, in this process,
or as tasks of a Ray cluster.

A :class:`Job` is everything a program's analysis needs, as plain data (the target's name, not
the model): a worker loads the model itself, traces the program once and answers each of its
layouts (:func:`answer`). The same function runs in this process (``--workers 1``), in a pool
of this machine's processes (the default: Python's ``concurrent.futures``, one process per
core, :func:`in_processes`) and as a Ray task (``--cluster ADDRESS``, or ``--cluster local``
for a Ray cluster of this machine's processes), so a plan is the same wherever it ran.

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

__all__ = ["Job", "answer", "locally", "in_processes", "workers_for", "on_ray", "connect"]


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
    from memsim.strategies import FSDP, ExpertParallel, TensorParallel
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
    if lay.ep > 1:
        kw["ep"] = ExpertParallel(lay.ep)
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


def workers_for(given: int | None, programs: int) -> int:
    """The processes a plan's programs are traced in: ``given`` (``--workers``), else one per
    core of this machine, never more than the programs."""
    if given is not None and given < 1:
        raise UsageError(f"--workers {given}: at least 1", hint="--workers 1 traces in this "
                         "process; leave it out for one process per core")
    n = given if given is not None else (len(os.sched_getaffinity(0))
                                         if hasattr(os, "sched_getaffinity") else os.cpu_count())
    return max(1, min(n or 1, programs))


def in_processes(job: Job, programs: list[list[Layout]], workers: int,
                 done=None) -> list[tuple[list[Planned], int]]:
    """Each program answered in one of ``workers`` fresh processes of this machine (a
    ``ProcessPoolExecutor``, spawned), their answers in the programs' order; ``done(k,
    layouts)`` as the k-th answer comes. A process that dies takes the pool with it: the
    programs it left unanswered run once more in a new pool, and a program that fails twice
    makes its layouts' rows say why."""
    import concurrent.futures as cf
    import multiprocessing
    out: list = [None] * len(programs)
    left, failed, k = list(range(len(programs))), {}, 0
    for _ in range(2):
        failed = {}
        with cf.ProcessPoolExecutor(max_workers=min(workers, len(left)),
                                    initializer=_quiet_worker,
                                    mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(answer, job, programs[i]): i for i in left}
            for f in cf.as_completed(futures):
                i = futures[f]
                try:
                    out[i] = f.result()
                except Exception as e:   # the process died, or the answer did not come back
                    failed[i] = e
                    continue
                k += 1
                if done is not None:
                    done(k, programs[i])
        left = sorted(failed)
        if not left:
            break
    for i in left:
        e = failed[i]
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        out[i] = ([Planned(lay, reason=f"not answered: its process failed twice "
                                       f"({type(e).__name__}: {why})")
                   for lay in programs[i]], 0)
    return out


def _quiet_worker() -> None:
    """A worker process says nothing on stdout (where --json's document goes) and keeps other
    libraries' warnings to itself (the command shows the in-process run's)."""
    import logging
    import warnings
    sys.stdout = sys.stderr
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)


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

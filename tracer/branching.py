"""Truth values the model reads in Python without data, tried both ways.

``if labels.max() >= vocab_size: raise ValueError(...)`` (Hugging Face's CTC heads) or
``is_global_attn = mask.any().item()`` (LED) read a tensor's value in Python: a symbolic run has
no value to give. The run goes on with True where nothing was given for that line
(:func:`memsim.tracer.data_dependent.decide`), and the trace then tries the other way:

- a branch on which the model raises (its own check of its inputs) is not the step a user
  runs: the other is taken;
- where both run, the one that holds more memory at the example sizes is taken (the safe
  answer), and the note gives both peaks there.

Each choice is a note naming the line, and ``--assume FILE:LINE=VALUE`` (``StepConfig.assume``)
fixes it. Lines are tried one after the other (each with the ones before it fixed), at most
:data:`MOST` of them.
"""

from __future__ import annotations

from typing import Callable

import sympy

from .errors import TraceError

# the most lines tried the other way in one trace (each is one more run)
MOST = 4


def explore(once: Callable, hints: dict[str, int], config):
    """The :class:`~memsim.tracer.trace.Trace` of ``once(hints, config)``, with each truth
    value read without data tried both ways (the module docstring)."""
    given = dict(config.assume)
    notes: list[str] = []
    for _ in range(MOST + 1):
        try:
            t = once(hints, config.replace(assume=given))
            break
        except TraceError as e:
            free = [b for b in getattr(e, "branches", ()) if not b.given]
            if not free or len(notes) >= MOST:
                raise
            b = free[-1]   # the last value read before the model raised
            given[b.site] = not b.value
            notes.append(_raised(b, not b.value, e))
    for b in [b for b in t.run.branches if not b.given][:MOST - len(notes)]:
        other = dict(given, **{b.site: not b.value})
        try:
            alt = once(hints, config.replace(assume=other))
        except TraceError as e:
            notes.append(_raised(b, b.value, e))
            given[b.site] = b.value
            continue
        here, there = peak_at(t, hints), peak_at(alt, hints)
        at = ", ".join(f"{k}={v}" for k, v in hints.items())
        if there > here:
            t, value, other_value, more, less = alt, not b.value, b.value, there, here
        else:
            value, other_value, more, less = b.value, not b.value, here, there
        given[b.site] = value
        which = (f"the branch that holds more ({more:,} B against {less:,} B with "
                 f"{other_value}, at {at})" if more != less else
                 f"both branches hold the same ({more:,} B at {at})")
        notes.append(
            f"a tensor value read in Python at {b.site} ({b.code}) is not known in a "
            f"symbolic run: taken as {value}, {which}; --assume {b.site}={other_value} for "
            "the other")
    t.run.assumed.extend(notes)
    return t


def _raised(b, value, err: TraceError) -> str:
    """The note for a line taken as ``value`` because the other way failed: the model raised
    (its own check), or the trace could not go on (then the other branch is not answered)."""
    why = ("the model fails" if getattr(err, "sizes", None) else
           "the trace cannot go on, so that branch is not answered")
    return (f"a tensor value read in Python at {b.site} ({b.code}) is not known in a symbolic "
            f"run: taken as {value}, since with {not value} {why} ({err.message}); "
            f"--assume {b.site}=VALUE to give it")


def peak_at(t, hints: dict[str, int]) -> int:
    """The most bytes the trace ``t`` holds at once at the example sizes ``hints``."""
    subs = {t.symbols[n]: v for n, v in hints.items() if n in t.symbols}
    size = {s.sid: int(sympy.sympify(s.nbytes).xreplace(subs)) for s in t.run.storages}
    live = most = 0
    for ev in t.run.events:
        live += ev.sign * size[ev.sid]
        most = max(most, live)
    return most

"""The command's own process: its cycle collector is off while torch and the model are
imported and built, then what exists is frozen out of its view (:func:`settle`). Kept apart
from :mod:`memsim.entry` (which runs the command line) so that the target loader can call it
without importing the entry point back."""

from __future__ import annotations

import gc

__all__ = ["own_process", "settle"]

_OWNED = False   # this process is the command's own (script), not a caller's


def own_process() -> None:
    """Say that this process is the command's own (:func:`script`; ``benchmarks/scale.py``'s
    children, which measure as the command runs): the cycle collector is off until
    :func:`settle`."""
    global _OWNED
    _OWNED = True
    gc.disable()


def settle() -> None:
    """Called once the command's model is built. In the command's own process, what exists by
    then (torch, the libraries, the model: most of the heap, and none of it garbage) leaves the
    cycle collector's view (``gc.freeze``), which :func:`script` kept off until then: a full
    collection otherwise walks it again each time the trace has allocated enough (11 times,
    1.7 s, in a Llama-2-7B analysis with its B=1 retrace). Anywhere else (a caller's process,
    the tests), nothing."""
    if _OWNED:
        gc.freeze()
        gc.enable()

"""Example sizes for a symbolic run: the first ones (distinct small primes, or steps of a
stepped symbol), and the others tried where the model fails at those (:func:`larger_sizes`)."""

from __future__ import annotations

import re

from .config import StepConfig
from .errors import InputError
from .spec import TensorSpec

__all__ = ["example_sizes", "larger_sizes"]

# Example sizes for the symbolic run: distinct, >= 2 (0 and 1 specialize), and primes so that
# they rarely equal a constant size of the model (which would tie the symbol to it).
_DEFAULT_HINTS = (5, 7, 11, 13, 17, 19, 23, 29)
# when a model fails at those, one more try (see larger_sizes)
_RETRY_HINTS = (521, 523, 541, 547, 557, 563, 569, 571)


def example_sizes(specs: list[TensorSpec], given: dict[str, int] | None,
                  multiples: dict[str, int] | None = None) -> dict[str, int]:
    """The example size of each symbol: ``given`` (validated), else distinct small primes (for
    a symbol traced at multiples of a step, that many steps)."""
    given, multiples = dict(given or {}), dict(multiples or {})
    names = list(dict.fromkeys(n for s in specs for n in s.symbols))
    for n, v in given.items():
        if n not in names:
            raise InputError(f"example size given for {n!r}, which no input uses",
                             hint=f"symbols: {', '.join(names) or '(none)'}")
        if not isinstance(v, int) or v < 2:
            raise InputError(f"example size {n}={v!r} must be an int >= 2",
                             hint="0 and 1 make PyTorch specialize the size")
        step = multiples.get(n, 1)
        if v % step or v // step < 2:
            raise InputError(f"example size {n}={v} is not a multiple of {n}'s step {step} "
                             "(at least two steps)", hint=f"--hint {n}={2 * step} or more")
    for n in multiples:
        if n not in names:
            raise InputError(f"a step given for {n!r}, which no input uses",
                             hint=f"symbols: {', '.join(names) or '(none)'}")
    taken = {given[n] // multiples.get(n, 1) for n in given}
    pool = [h for h in _DEFAULT_HINTS if h not in taken]
    out = {n: given[n] if n in given else pool.pop(0) * multiples.get(n, 1) for n in names}
    if not _distinct(out, multiples):
        raise InputError(f"example sizes must be distinct, got {out}",
                         hint="equal example sizes merge two symbols into one")
    return out


def _distinct(sizes: dict[str, int], steps: dict[str, int]) -> bool:
    """Whether the sizes are distinct, and so are the run's own symbols (a stepped symbol's
    count of steps): equal ones would merge two symbols into one."""
    raw = [v // steps.get(n, 1) for n, v in sizes.items()]
    return len(set(sizes.values())) == len(sizes) and len(set(raw)) == len(raw)


def larger_sizes(hints: dict[str, int], config: StepConfig, points=(),
                  failure: str = "") -> list[dict[str, int]]:
    """Other example sizes to trace with when the model failed at the first ones, in order,
    within each symbol's limit and step (``config.limits``, ``config.multiples``), for the
    symbols the user did not size (``config.hints``); none when the user sized every symbol:

    1. the sizes asked for (``points``: ``--at``), which the user expects the model to take;
    2. multiples of the sizes the failure names (a kernel of 4, a window of 7: a patch or a
       window arithmetic needs whole ones), the last symbol first (a sequence or an image,
       after the batch);
    3. larger primes (a 1-D convolution over raw audio needs hundreds of samples: wav2vec2's
       feature extractor 400), each symbol alone, the last first, then all of them."""
    given, limits, steps = config.hints, config.limits, config.multiples
    free = [n for n in hints if n not in given]
    out: list[dict[str, int]] = []

    def step(n: str) -> int:
        return steps.get(n, 1)

    def fits(n: str, v: int) -> bool:
        return v >= 2 and v % step(n) == 0 and v // step(n) >= 2 and (
            n not in limits or v <= limits[n])

    def add(sizes: dict[str, int]) -> None:
        if sizes != hints and sizes not in out and _distinct(sizes, steps):
            out.append(sizes)

    for pt in points or ():
        add(dict(hints, **{n: pt[n] for n in free if isinstance(pt.get(n), int)
                           and fits(n, pt[n])}))
    named = sorted({int(x) for x in re.findall(r"(?<![\w.])\d+(?![\w.])", failure)
                    if 2 <= int(x) <= 4096} - set(hints.values()))[:4]
    for n in reversed(free):
        for f in named:
            k = max(2, hints[n] // f + 1)
            while not fits(n, k * f) and k < 64:
                k += 1
            if fits(n, k * f):
                add(dict(hints, **{n: k * f}))
    pool = [h for h in _RETRY_HINTS if h not in hints.values()]
    larger = {}
    for n in free:
        v = next((h for h in pool if fits(n, h * step(n))), None)
        if v is None:   # a limit below the primes: the largest size under it
            top = limits.get(n, 2) // step(n)
            v = next((x for x in range(top, hints[n] // step(n), -1)
                      if x * step(n) not in hints.values()), None)
        if v is not None:
            if v in pool:
                pool.remove(v)
            larger[n] = v * step(n)
    for n in reversed(free):
        if n in larger:
            add(dict(hints, **{n: larger[n]}))
    if len(larger) > 1:
        add(dict(hints, **larger))
    return out

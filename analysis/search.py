"""Searches over one integer size where a property is monotone (the peak grows with the size).

>>> last_true(lambda v: v * v <= 50, 1, 100)
7
>>> largest_true(lambda v: 3 * v <= 1000, 1)
333
"""

from __future__ import annotations

from typing import Callable


def last_true(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest ``v`` in ``[lo, hi)`` with ``pred(v)``, by bisection, given ``pred(lo)``
    true, ``pred(hi)`` false and ``pred`` monotone (true, then false)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_true(pred: Callable[[int], bool], lo: int, cap: int = 2 ** 40) -> int | None:
    """The largest ``v >= lo`` up to ``cap`` with ``pred(v)``, given ``pred(lo)``: doubling
    until ``pred`` fails, then bisection. None when it holds up to ``cap``."""
    a, b = lo, min(max(2 * lo, lo + 1), cap)
    while pred(b):
        if b >= cap:
            return None
        a, b = b, min(2 * b, cap)
    return last_true(pred, a, b)

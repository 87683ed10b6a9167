"""What the device's allocator charges for a tensor storage of ``n`` bytes.

CUDA: PyTorch's caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, ``round_size``) hands
out blocks in multiples of ``kMinBlockSize`` = 512 bytes, at least 512, and
``torch.cuda.memory_allocated`` counts those block sizes. A zero-byte storage gets no block
(``allocate`` only calls ``malloc`` for ``size != 0``). The rounding is exact and is part of
every CUDA figure. Not modelled here (allocator-state dependent, so it belongs to the
fragmentation estimate of the budget): a large-pool block that is not split because the
remainder is at most 1 MiB is counted whole, and ``roundup_power2_divisions`` when a user sets
it in ``PYTORCH_CUDA_ALLOC_CONF``.

CPU: the default allocator is plain ``malloc``: a storage costs its ``nbytes``.

>>> import sympy
>>> S = sympy.Symbol("S", positive=True, integer=True)
>>> block_bytes(8 * S, "cuda"), block_bytes(sympy.Integer(4), "cuda"), block_bytes(3072 * S, "cuda")
(512*ceiling(S/64), 512, 3072*S)
>>> block_bytes(sympy.Integer(0), "cuda"), block_bytes(8 * S, "cpu")
(0, 8*S)
"""

from __future__ import annotations

from functools import lru_cache

import sympy

CUDA_BLOCK = 512


@lru_cache(maxsize=65536)
def block_bytes(nbytes: sympy.Expr, device: str) -> sympy.Expr:
    """Bytes the allocator of ``device`` charges for a storage of ``nbytes`` (remembered: a
    run of repeated blocks has a few thousand distinct sizes among its storages)."""
    nbytes = sympy.sympify(nbytes)
    if device != "cuda":
        return nbytes
    if nbytes.is_zero:
        return sympy.Integer(0)
    return CUDA_BLOCK * sympy.ceiling(nbytes / CUDA_BLOCK)


def block_bytes_of(nbytes: int, device: str) -> int:
    """:func:`block_bytes` of a size already evaluated at a point (plain integers).

    >>> block_bytes_of(1000, "cuda"), block_bytes_of(0, "cuda"), block_bytes_of(1000, "cpu")
    (1024, 0, 1000)
    """
    if device != "cuda" or nbytes == 0:
        return nbytes
    return CUDA_BLOCK * -(-nbytes // CUDA_BLOCK)

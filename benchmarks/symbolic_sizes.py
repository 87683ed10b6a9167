"""What a fake tensor with symbolic sizes costs torch to make, and what
:func:`memsim.tracer.symcache.remembered` saves. Run on demand (a few seconds)::

    python -m benchmarks.symbolic_sizes

Times ``torch.empty_strided`` on the meta device (what the fake tensor cache does for every
output it answers) for sizes ``(2, 64, 4096)`` and ``(B, S, 4096)`` (B and S symbols of a shape
environment), then the symbolic one again with a view's ``set_``, each without and with the
remembered arithmetic; microseconds per tensor, best of three.
"""

from __future__ import annotations

import time

import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from memsim.tracer.symcache import remembered

N = 2000


def best(fn) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        times.append((time.perf_counter() - t0) / N * 1e6)
    return min(times)


def main() -> None:
    env = ShapeEnv()
    b = env.create_symintnode(env.create_symbol(2, ConstantSource("B")), hint=2)
    s = env.create_symintnode(env.create_symbol(64, ConstantSource("S")), hint=64)
    shape, stride = (b, s, 4096), (s * 4096, 4096, 1)
    storage = torch.empty_strided(shape, stride, dtype=torch.bfloat16,
                                  device="meta").untyped_storage()

    def concrete():
        torch.empty_strided((2, 64, 4096), (64 * 4096, 4096, 1), dtype=torch.bfloat16,
                            device="meta")

    def symbolic():
        torch.empty_strided(shape, stride, dtype=torch.bfloat16, device="meta")

    def view():
        t = torch.empty_strided(shape, stride, dtype=torch.bfloat16, device="meta")
        t.set_(storage, 0, shape, stride)

    print(f"{'tensor':<34} {'torch (us)':>10} {'remembered (us)':>16}")
    for name, fn in (("(2, 64, 4096)", concrete), ("(B, S, 4096)", symbolic),
                     ("(B, S, 4096) and a view's set_", view)):
        plain = best(fn)
        with remembered():
            fast = best(fn)
        print(f"{name:<34} {plain:>10.1f} {fast:>16.1f}")


if __name__ == "__main__":
    main()

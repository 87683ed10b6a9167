"""Published formulas memsim's traced figures are compared with (test oracles, not the engine).

- :func:`paper_model_states`: model-state bytes per device in the ZeRO paper (Rajbhandari et
  al. 2019, Figure 1).

Nothing here imports memsim.
"""

from __future__ import annotations


def paper_model_states(psi: float, n: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per device in the ZeRO paper (Rajbhandari et al. 2019, Fig. 1):
    baseline (stage 0) (2 + 2 + K)Ψ, P_os 4Ψ + KΨ/N, P_os+g 2Ψ + (2 + K)Ψ/N, P_os+g+p
    (2 + 2 + K)Ψ/N."""
    if stage == 0:
        return (4 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (4 + k) * psi / n
    raise ValueError(f"ZeRO stage {stage!r} must be 0..3")

"""Published formulas memsim's traced figures are compared with (test oracles, not the engine).

- :func:`paper_model_states`: model-state bytes per device in the ZeRO paper (Rajbhandari et
  al. 2019, Figure 1).
- :func:`deepspeed_estimate`: DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and
  ``estimate_zero3_model_states_mem_needs`` (DeepSpeed 0.19.6), retyped.

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


def deepspeed_estimate(stage: int, total_params: int, num_gpus_per_node: int = 1,
                       num_nodes: int = 1, largest_layer_params: int = 0,
                       cpu_offload: bool = False, cpu_offload_params: bool = False,
                       zero_init: bool = True, additional_buffer_factor: float = 1.5
                       ) -> tuple[float, float]:
    """(GPU bytes, CPU bytes) per device, as DeepSpeed's ``estimate_zero2_model_states_mem_needs``
    and ``estimate_zero3_model_states_mem_needs`` compute them (DeepSpeed 0.19.6). They count
    every parameter as trainable (frozen ones included), no buckets, no activations."""
    gpus = num_gpus_per_node * num_nodes
    p = total_params
    if stage in (1, 2):
        if cpu_offload:
            return 2 * p, p * max(4 * gpus, 16) * additional_buffer_factor
        return 2 * p + 18 * p / gpus, 4 * p * num_gpus_per_node * additional_buffer_factor
    if stage != 3:
        raise ValueError(f"DeepSpeed has estimators for stages 2 and 3, not {stage!r}")
    ll = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu, cpu = ll, 18 * p / num_nodes * additional_buffer_factor
    elif cpu_offload:
        gpu, cpu = ll + 2 * p / gpus, 16 * p / num_nodes * additional_buffer_factor
    else:
        gpu = ll + 18 * p / gpus
        cpu = (largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
               if zero_init else
               p * 4 * max(num_gpus_per_node, 4) * additional_buffer_factor)
    if not zero_init and (cpu_offload or cpu_offload_params):
        cpu = max(cpu, p * 4 * num_gpus_per_node * additional_buffer_factor)
    return gpu, cpu

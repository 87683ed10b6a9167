"""Hugging Face models: their own size limits, and the scoped patches that keep them eager-exact.

Imported only when the model is a ``transformers.PreTrainedModel``; transformers stays optional.
"""

from __future__ import annotations

import contextlib

import torch

from .spec import make_spec, TensorSpec


def is_hf(model: torch.nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def limits(model: torch.nn.Module, inputs: dict) -> dict[str, int]:
    """``{symbol: max}`` for the sequence dimension of ``input_ids`` (positions the model has)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    top = None
    for attr in ("n_positions", "max_position_embeddings"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            top = v
            break
    if top is None:
        return {}
    out: dict[str, int] = {}
    for name in ("input_ids", "inputs_embeds", "labels", "attention_mask"):
        if name in inputs:
            try:
                spec = make_spec(name, inputs[name])
            except Exception:  # noqa: BLE001 - the tracer reports malformed inputs itself
                continue
            if isinstance(spec, TensorSpec) and len(spec.shape) >= 2 and isinstance(spec.shape[1], str):
                out[spec.shape[1]] = top
                break
    return out


def adapt(model: torch.nn.Module, inputs: dict):
    """``(patches, limits)`` for ``model``: a context-manager factory (or None) and size limits."""
    if not is_hf(model):
        return None, {}
    return None, limits(model, inputs)

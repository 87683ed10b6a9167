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


@contextlib.contextmanager
def eager_like():
    """Make Hugging Face's mask code take the path a real eager run takes, for the run only.

    ``masking_utils.find_packed_sequence_indices`` asks ``is_tracing(mask)``, which is True for
    any FakeTensor, and then keeps a packed-sequence mask that a real run drops after checking
    ``(mask[:, -1] == 0).all()`` (positions from ``arange`` are never packed). The fake run would
    then build a full (B, 1, S, S) mask (seen with ``use_cache=False``). The replacement runs the
    same ops as the real function, including the ``.all()`` tensor, and answers as the real run
    does for unpacked positions: None.
    """
    try:
        from transformers import masking_utils as mu
    except ImportError:
        yield
        return
    orig = getattr(mu, "find_packed_sequence_indices", None)
    if orig is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def find_packed_sequence_indices(position_ids):
        if not isinstance(position_ids, FakeTensor):
            return orig(position_ids)
        first = position_ids[:, :1] - 1
        diff = torch.diff(position_ids, prepend=first, dim=-1)
        mask = (diff != 1).cumsum(-1)
        (mask[:, -1] == 0).all()  # the real run reads this value; unpacked positions give True
        return None

    mu.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = orig


def adapt(model: torch.nn.Module, inputs: dict):
    """``(patches, limits)`` for ``model``: a context-manager factory (or None) and size limits."""
    if not is_hf(model):
        return None, {}
    return eager_like, limits(model, inputs)

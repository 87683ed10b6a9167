"""Hugging Face models: their own size limits, and the scoped patches that keep them eager-exact.

Imported only when the model is a ``transformers.PreTrainedModel``; transformers stays optional.
"""

from __future__ import annotations

import contextlib

import torch

from . import known
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


@contextlib.contextmanager
def all_ones_mask():
    """Make Hugging Face take the path a real run takes with an attention mask of all ones.

    With sdpa, ``masking_utils.sdpa_mask`` asks ``_ignore_causal_mask_sdpa`` whether the mask
    can be dropped (then SDPA runs with ``is_causal=True`` and no (B, 1, S, S) mask exists). A
    real run decides with ``fast_all(mask)``; on a FakeTensor ``is_tracing(mask)`` is True and
    the answer is always "keep the mask", which is right for padded batches only. Here, for fake
    masks known to hold only ones (:mod:`memsim.tracer.known`: an input given with
    ``fill="ones"``, or a mask the model makes with ``torch.ones``, as BART's decoder does when
    it is given none), the same tensors are computed (the sums and comparisons of ``fast_all``,
    the ``.all()``) and the answer an all-ones mask gives is returned. ``prepare_padding_mask`` is
    wrapped to remember how many leading columns are ones when zero columns are appended, so
    that the answer stays right for longer key/value lengths. The eager implementation always
    builds the mask and is unaffected. Proven against real runs in ``tests/test_hf.py``.
    """
    try:
        from transformers import masking_utils as mu
    except ImportError:
        yield
        return
    names = ("prepare_padding_mask", "_ignore_causal_mask_sdpa",
             "_ignore_bidirectional_mask_sdpa")
    if not all(hasattr(mu, n) for n in names):
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils.weak import WeakTensorKeyDictionary

    orig = {n: getattr(mu, n) for n in names}
    ones_cols = WeakTensorKeyDictionary()  # fake padding mask -> leading all-ones columns

    def ours(t) -> bool:
        return (isinstance(t, FakeTensor) and (t in ones_cols or known.all_ones(t))
                and not mu.is_tracing() and not mu.is_torchdynamo_exporting())

    def ones(t):
        return ones_cols.get(t, t.shape[-1])

    def computed(value, answer: bool) -> bool:
        """``value`` is the tensor a real run reads (computed here, not read): ``answer``."""
        del value
        return answer

    def prepare_padding_mask(attention_mask, kv_length, kv_offset):
        out = orig["prepare_padding_mask"](attention_mask, kv_length, kv_offset)
        if ours(attention_mask):
            ones_cols[out] = ones(attention_mask)
        return out

    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset,
                                 local_attention_size=None):
        if not ours(padding_mask):
            return orig["_ignore_causal_mask_sdpa"](padding_mask, q_length, kv_length, q_offset,
                                                    kv_offset, local_attention_size)
        n_ones = ones(padding_mask)
        if padding_mask.shape[-1] > kv_length:
            idx = torch.arange(kv_length, device=padding_mask.device) + kv_offset
            padding_mask = padding_mask[:, idx]
            n_ones = torch.sym_max(0, torch.sym_min(n_ones - kv_offset, kv_length))
        width = padding_mask.shape[-1]
        if isinstance(q_offset, torch.Tensor) and mu.is_tracing(q_offset):
            return False
        if local_attention_size is not None and kv_length >= local_attention_size:
            return False
        if (q_length == 1 or kv_length == q_length) and computed(
                mu.fast_all(padding_mask), n_ones >= width):
            return True
        if q_offset == 0 and (
                computed(mu.fast_all(padding_mask[:, :q_length]),
                         n_ones >= torch.sym_min(q_length, width))
                and computed(mu.fast_all(~padding_mask[:, q_length:]), n_ones <= q_length)):
            return True
        return False

    def _ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
        if not ours(padding_mask):
            return orig["_ignore_bidirectional_mask_sdpa"](padding_mask, kv_length,
                                                           local_attention_size)
        local_ok = local_attention_size is None or kv_length < local_attention_size
        return computed(padding_mask.all(), ones(padding_mask) >= padding_mask.shape[-1]) \
            and local_ok

    new = {"prepare_padding_mask": prepare_padding_mask,
           "_ignore_causal_mask_sdpa": _ignore_causal_mask_sdpa,
           "_ignore_bidirectional_mask_sdpa": _ignore_bidirectional_mask_sdpa}
    for n, f in new.items():
        setattr(mu, n, f)
    try:
        yield
    finally:
        for n, f in orig.items():
            setattr(mu, n, f)


def adapt(model: torch.nn.Module, inputs: dict):
    """``(patches, limits)`` for ``model``: a context-manager factory (or None) and size limits."""
    if not is_hf(model):
        return None, {}

    @contextlib.contextmanager
    def patches():
        with eager_like(), all_ones_mask():
            yield

    return patches, limits(model, inputs)

"""Hugging Face models: their own size limits, and the scoped patches that keep them eager-exact.

Imported only when the model is a ``transformers.PreTrainedModel``; transformers stays optional.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import known
from .recorder import swapped
from .spec import make_spec, TensorSpec


def is_hf(model: torch.nn.Module) -> bool:
    """Whether ``model`` is, or holds, a Hugging Face module (a user's own module around a
    transformers model needs the same patches)."""
    return any(c.__module__.startswith("transformers.")
               for m in model.modules() for c in type(m).__mro__)


# the inputs whose second dimension is the encoder's (or a decoder-only model's) positions, and
# those whose second dimension is an encoder-decoder's decoder positions
_SOURCE = ("input_ids", "inputs_embeds", "attention_mask")
_TARGET = ("decoder_input_ids", "decoder_inputs_embeds", "decoder_attention_mask", "labels")


def _positions(configs: tuple, attrs: tuple[str, ...]) -> int | None:
    """The first of ``attrs`` the configs (the model's, then its text config) set."""
    for c in configs:
        for attr in attrs:
            v = getattr(c, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _spec(inputs: dict, name: str) -> TensorSpec | None:
    """The spec of input ``name``, or None (absent, not a tensor, or malformed: the tracer
    reports malformed inputs itself)."""
    if name not in inputs:
        return None
    try:
        spec = make_spec(name, inputs[name])
    except Exception:  # noqa: BLE001 - reported by the tracer
        return None
    return spec if isinstance(spec, TensorSpec) else None


def _sequence_symbol(inputs: dict, names: tuple[str, ...]) -> str | None:
    for name in names:
        spec = _spec(inputs, name)
        if spec is not None and len(spec.shape) >= 2 and isinstance(spec.shape[1], str):
            return spec.shape[1]
    return None


def limits(model: torch.nn.Module, inputs: dict) -> dict[str, int]:
    """``{symbol: max}`` for the sequence dimensions the model has positions for: the sequence
    of ``input_ids`` (or ``inputs_embeds``, ``attention_mask``), and an encoder-decoder's
    decoder sequence (``decoder_input_ids``, ``labels``...), from the config or its text
    config (``max_position_embeddings``, ``n_positions``; ``max_source_positions`` and
    ``max_target_positions`` where the two differ, as in Whisper, or LED's
    ``max_encoder_position_embeddings`` and ``max_decoder_position_embeddings``)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    # the text config holds the limits of a multimodal model (Gemma-3, LLaVA...)
    configs = (cfg, cfg.get_text_config()) if hasattr(cfg, "get_text_config") else (cfg,)
    both = ("n_positions", "max_position_embeddings")
    source = _positions(configs, ("max_source_positions", "max_encoder_position_embeddings")
                        + both)
    out: dict[str, int] = {}
    sym = _sequence_symbol(inputs, _SOURCE)
    if sym is not None and source is not None:
        out[sym] = source
    decoder = getattr(cfg, "is_encoder_decoder", False)
    target = _positions(configs, ("max_target_positions", "max_decoder_position_embeddings")
                        + both if decoder else both)
    sym = _sequence_symbol(inputs, _TARGET if decoder else ("labels",))
    if sym is not None and target is not None:
        out[sym] = min(out.get(sym, target), target)
    return out


def multiples(model: torch.nn.Module, inputs: dict) -> dict[str, int]:
    """``{symbol: step}`` for the image sizes of a vision model that pads by remainders:
    a windowed transformer (Swin and its kin: a config with ``patch_size``, ``window_size``
    and ``depths``) pads each stage's grid to whole windows and halves it, so an image of
    ``patch_size x window_size x 2**(stages - 1)`` pixels per step is padded nowhere; a
    network with an ``output_stride`` (MobileNet's TensorFlow padding) pads by the size's
    remainder at each stride. Traced symbolically at other sizes, each padding is a remainder
    of a remainder, which PyTorch's symbolic shapes take minutes to decide or the model's
    Python pins; at multiples of the step the formulas are polynomials."""
    cfg = getattr(model, "config", None)
    patch, window = getattr(cfg, "patch_size", None), getattr(cfg, "window_size", None)
    depths, stride = getattr(cfg, "depths", None), getattr(cfg, "output_stride", None)
    if isinstance(patch, int) and isinstance(window, int) and depths:
        step = patch * window * 2 ** (len(depths) - 1)
    elif isinstance(stride, int) and not isinstance(stride, bool) and stride > 1:
        step = stride   # MobileNet's TensorFlow padding: a remainder per strided convolution
    else:
        return {}
    spec = _spec(inputs, "pixel_values")
    if spec is None or len(spec.shape) != 4:
        return {}
    return {d: step for d in spec.shape[2:] if isinstance(d, str)}


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


_LAYERDROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def _layerdrops(model: torch.nn.Module) -> list[tuple[object, str, float]]:
    """``(owner, attribute, p)`` for each LayerDrop probability above 0 the model reads: its
    modules' own (BART copies ``config.encoder_layerdrop`` to ``self.layerdrop``) and their
    configs' (wav2vec2 reads ``self.config.layerdrop``)."""
    out, seen = [], set()
    for m in model.modules():
        for owner in (m, getattr(m, "config", None)):
            if owner is None or id(owner) in seen:
                continue
            seen.add(id(owner))
            for name in _LAYERDROP:
                v = vars(owner).get(name) if hasattr(owner, "__dict__") else None
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                    out.append((owner, name, v))
    return out


def layerdrop_note(model: torch.nn.Module) -> list[str]:
    """The note for a model whose training skips layers at random (LayerDrop)."""
    ps = sorted({p for _, _, p in _layerdrops(model)})
    if not ps:
        return []
    return [f"LayerDrop ({', '.join(f'p={p:g}' for p in ps)}): the traced training step runs "
            "every layer, the most memory a step takes; a real step skips each layer with that "
            "probability"]


@contextlib.contextmanager
def every_layer_runs(model: torch.nn.Module):
    """LayerDrop draws ``torch.rand([]) < p`` per layer in training, a value a symbolic run
    does not have. For the run, every probability is 0: every layer runs, the step that takes
    the most memory (:func:`layerdrop_note` says so in the report)."""
    found = _layerdrops(model)
    for owner, name, _ in found:
        setattr(owner, name, 0.0)
    try:
        yield
    finally:
        for owner, name, p in found:
            setattr(owner, name, p)


def _in_every_module(attr: str, replace):
    """For the run, ``attr`` of every loaded ``transformers`` module that has a callable one
    (each modeling file binds its own copy of a helper) becomes ``replace(original)``."""
    import sys

    return swapped([(m, attr, replace(getattr(m, attr)))
                     for name, m in list(sys.modules.items())
                     if name.startswith("transformers") and m is not None
                     and callable(getattr(m, attr, None))])


def spec_augment_refused():
    """SpecAugment (wav2vec2, HuBERT, WavLM... with ``apply_spec_augment`` and
    ``mask_time_prob`` or ``mask_feature_prob`` above 0) draws its masks with numpy from
    concrete lengths, and the step then keeps indices of the masked positions, as many as the
    draw gave: its memory is not a function of the sizes. A typed error says so, where numpy
    would fail on symbolic sizes with an IndexError."""
    from .errors import DataDependentError

    def refuse(orig):
        def _compute_mask_indices(shape, *args, **kwargs):
            if all(isinstance(d, int) for d in shape):
                return orig(shape, *args, **kwargs)
            raise DataDependentError(
                "SpecAugment masks random time steps and features in training (numpy, from "
                "concrete lengths), and the step keeps the indices of the masked positions: "
                "as many as the draw gives, so its memory is not a function of the sizes",
                hint="for the estimate, set the config's mask_time_prob=0 and "
                     "mask_feature_prob=0 (or apply_spec_augment=False)")
        return _compute_mask_indices

    return _in_every_module("_compute_mask_indices", refuse)


def checks_hold():
    """Hugging Face's ``torch_compilable_check(cond, msg)`` reads a tensor condition's value in
    eager, and a real run stops where it is false (a vision-language model checks that its
    input ids hold as many image tokens as its images have features). On fake tensors the value
    is not known: the check's own op (``cond.all()``) is computed and taken to hold, as in
    every run that goes on past it, and the run records it (the report's notes name the line).
    Conditions that are not fake tensors are checked as Hugging Face checks them."""
    from torch._subclasses.fake_tensor import FakeTensor

    from .sources import model_line

    def holds(orig):
        def torch_compilable_check(cond, msg=None, error_type=ValueError):
            if callable(cond) and not isinstance(cond, torch.Tensor):
                cond = cond()
            if not isinstance(cond, FakeTensor):
                return orig(cond, msg, error_type)
            cond.all()
            known.assume(f"assumed: the model's check of its inputs' values{model_line()} "
                         "holds, as in any run that goes past it (a symbolic run has sizes, "
                         "not values)")
        return torch_compilable_check

    return _in_every_module("torch_compilable_check", holds)


def symbolic_lru_caches():
    """Hugging Face's ``compile_compatible_method_lru_cache`` (DETR's and its relatives' position
    embeddings, about 60 modeling files) is an ``lru_cache``, whose key hashes the arguments:
    a symbolic shape's SymInts cannot be hashed (TypeError). For the run, each such method
    caches as the real one does: its key's sizes by their expressions and other objects as the
    ``lru_cache`` hashes them, the same number of entries kept, and each entry holding its
    arguments and result (the real cache keeps them alive until the entry is evicted)."""
    import sys
    from collections import OrderedDict

    try:
        from transformers.pytorch_utils import compile_compatible_method_lru_cache as dec
    except ImportError:  # pragma: no cover - an older transformers
        return contextlib.nullcontext()
    code = dec(maxsize=1)(lambda: None).__code__

    def cells(fn) -> dict:
        return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))

    def ours(wrapper):
        c = cells(wrapper)
        func, maxsize = c["func"], c["func_with_cache"].cache_info().maxsize
        entries: OrderedDict = OrderedDict()

        @functools.wraps(func)
        def cached(*args, **kwargs):
            key = _hashable((args, tuple(sorted(kwargs.items()))))
            if key in entries:
                entries.move_to_end(key)
                return entries[key][1]
            out = func(*args, **kwargs)
            entries[key] = ((args, kwargs), out)
            if maxsize is not None and len(entries) > maxsize:
                entries.popitem(last=False)
            return out
        return cached

    found = []
    for name, m in list(sys.modules.items()):
        if not name.startswith("transformers.models") or m is None:
            continue
        for owner in [m] + [v for v in vars(m).values()
                            if isinstance(v, type) and v.__module__ == name]:
            for attr, v in list(vars(owner).items()):
                fn = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                if getattr(fn, "__code__", None) is code:
                    new = ours(fn)
                    found.append((owner, attr, type(v)(new) if fn is not v else new))
    return swapped(found)


def _hashable(x):
    """``x`` as a cache key: SymInts by their expression, sequences element by element, other
    objects as they are (a tensor hashes by identity, as in ``lru_cache``)."""
    if isinstance(x, torch.SymInt):
        return ("SymInt", str(x.node.expr))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__,) + tuple(_hashable(v) for v in x)
    return x


def adapt(model: torch.nn.Module, inputs: dict):
    """``(patches, limits)`` for ``model``: a factory of the context manager entered for a run
    (given the run's model: a strategy traces a copy), or None, and size limits."""
    if not is_hf(model):
        return None, {}

    @contextlib.contextmanager
    def patches(run_model: torch.nn.Module):
        with eager_like(), all_ones_mask(), every_layer_runs(run_model), \
                spec_augment_refused(), checks_hold(), symbolic_lru_caches():
            yield

    return patches, limits(model, inputs)

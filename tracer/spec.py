"""Input specifications: which tensors the model takes, their dtypes and (symbolic) shapes.

A dimension is an ``int`` or a symbol name (any identifier: ``B``, ``S``, ``T``...). The same name
in two inputs is the same size. Symbols are sympy symbols declared positive integers, so that
``Max(b*s, 2*b*s)`` simplifies.

Examples
--------
>>> spec = parse_input("input_ids=int64[B,S]")
>>> spec.name, spec.dtype, spec.shape
('input_ids', torch.int64, ('B', 'S'))
>>> symbol("B")
B
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from functools import lru_cache

import sympy
import torch

from .errors import InputError, UsageError

_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
        "uint8", "bool", "complex64",
    )
}
_DTYPES.update({"float": torch.float32, "double": torch.float64, "half": torch.float16,
                "long": torch.int64, "int": torch.int32, "fp32": torch.float32,
                "fp16": torch.float16, "bf16": torch.bfloat16})


@lru_cache(maxsize=None)
def symbol(name: str) -> sympy.Symbol:
    """The sympy symbol for a user dimension name (positive integer)."""
    return sympy.Symbol(name, positive=True, integer=True)


def parse_dtype(text: str | torch.dtype) -> torch.dtype:
    """``"int64"`` / ``"torch.int64"`` / ``torch.int64`` -> ``torch.int64``."""
    if isinstance(text, torch.dtype):
        return text
    key = str(text).strip().removeprefix("torch.")
    if key not in _DTYPES:
        raise InputError(f"unknown dtype {text!r}",
                         hint=f"use one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


def _parse_dim(dim, where: str) -> int | str:
    if isinstance(dim, bool):
        raise InputError(f"{where}: dimension {dim!r} is neither an int nor a symbol name")
    if isinstance(dim, int):
        if dim < 0:
            raise InputError(f"{where}: negative dimension {dim}")
        return dim
    text = str(dim).strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    if not text.isidentifier() or keyword.iskeyword(text):
        raise InputError(f"{where}: dimension {dim!r} is neither an int nor an identifier",
                         hint="write sizes as integers or names such as B, S, T")
    return text


FILLS = ("ones",)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor input: its name (a ``forward`` parameter), dtype and shape.

    ``fill="ones"`` says the tensor holds only ones, for code whose path depends on it: a
    Hugging Face ``attention_mask`` without padding lets the model skip the (B, 1, S, S) mask.
    Without it an attention mask is taken to hold padding (the larger of the two cases).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int | str, ...]
    fill: str | None = None

    def __post_init__(self):
        if self.fill is not None and self.fill not in FILLS:
            raise InputError(f"input {self.name!r}: unknown fill {self.fill!r}",
                             hint=f"use one of {', '.join(FILLS)}, or none")

    @property
    def symbols(self) -> tuple[str, ...]:
        return tuple(d for d in self.shape if isinstance(d, str))


def is_tensor_spec(value) -> bool:
    """True for a tensor input: a ``TensorSpec``, ``"int64[B,S]"`` or ``(dtype, shape)``."""
    return isinstance(value, (TensorSpec, str)) or (
        isinstance(value, (tuple, list)) and len(value) in (2, 3)
        and isinstance(value[1], (tuple, list)))


def make_spec(name: str, value) -> TensorSpec:
    """Build a spec from ``("int64", ["B", "S"])`` (optionally a third item, the fill), a
    ``TensorSpec`` or ``"int64[B,S]"`` / ``"int64[B,S]:ones"``."""
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, str):
        return parse_input(f"{name}={value}")
    if not (isinstance(value, (tuple, list)) and len(value) in (2, 3)):
        raise InputError(f"input {name!r}: expected (dtype, shape), got {value!r}",
                         hint='e.g. inputs={"input_ids": ("int64", ["B", "S"])}')
    dtype, shape = value[0], value[1]
    fill = value[2] if len(value) == 3 else None
    where = f"input {name!r}"
    return TensorSpec(name, parse_dtype(dtype), tuple(_parse_dim(d, where) for d in shape), fill)


_INPUT_RE = re.compile(
    r"^\s*([A-Za-z_]\w*)\s*=\s*([A-Za-z_][\w.]*)\s*\[([^\]]*)\]\s*(?::\s*(\w+))?\s*$")


def parse_input(text: str) -> TensorSpec:
    """Parse the CLI form ``name=dtype[d0,d1,...]`` or ``name=dtype[d0,...]:ones``."""
    m = _INPUT_RE.match(text)
    if not m:
        raise UsageError(f"malformed --input {text!r}",
                         hint="write --input NAME=DTYPE[DIM,...], e.g. --input input_ids=int64[B,S]")
    name, dtype, dims, fill = m.groups()
    parts = [p.strip() for p in dims.split(",")] if dims.strip() else []
    try:
        return TensorSpec(name, parse_dtype(dtype),
                          tuple(_parse_dim(p, f"--input {text!r}") for p in parts), fill)
    except UsageError:
        raise
    except InputError as e:
        raise UsageError(e.message, hint=e.hint) from None


def parse_assignments(text: str, option: str = "--at") -> dict[str, int]:
    """Parse ``B=4,S=2048`` into ``{"B": 4, "S": 2048}``."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([A-Za-z_]\w*)\s*=\s*(-?\d+)", part)
        if m and int(m.group(2)) < 1:
            raise UsageError(f"{option} {part}: sizes start at 1",
                             hint=f"give {m.group(1)} a size of 1 or more, e.g. {option} "
                                  f"{m.group(1)}=4")
        if not m:
            raise UsageError(f"malformed {option} item {part!r}",
                             hint=f"write {option} NAME=INT[,NAME=INT...], e.g. {option} B=4,S=2048")
        out[m.group(1)] = int(m.group(2))
    if not out:
        raise UsageError(f"empty {option}", hint=f"e.g. {option} B=4,S=2048")
    return out

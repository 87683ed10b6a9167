"""Where in the user's code something happened: the innermost frame of model code.

Model code is any file that is not torch's, memsim's, the standard library's, sympy's,
networkx's or one of Hugging Face's helpers (``transformers/utils``). Errors name that
``file:line``; specializations are traced back to it.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from types import FrameType
from typing import Callable

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB = os.path.dirname(os.__file__)


@functools.cache
def _own_dirs() -> tuple[str, ...]:
    """The folders of memsim's packages, wherever they are installed from."""
    here = os.path.dirname(os.path.abspath(__file__))          # memsim.tracer
    parent = os.path.dirname(here)
    dirs = [here] + [os.path.join(parent, p) for p in ("analysis", "strategies", "memsim")]
    front = sys.modules.get("memsim")
    if front is not None and getattr(front, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(front.__file__)))
    return tuple(d + os.sep for d in dirs)


def is_model_file(f: str) -> bool:
    f = os.path.abspath(f)
    stdlib = f.startswith(_STDLIB) and "site-packages" not in f and "dist-packages" not in f
    return not (f.startswith(_TORCH_DIR) or f.startswith(_own_dirs()) or stdlib
                or "<frozen" in f or "/site-packages/sympy" in f
                or "/site-packages/networkx" in f
                # Hugging Face's helpers (its checks, wrappers and output capture): the line
                # to name is the model's own that called them
                or "/site-packages/transformers/utils/" in f.replace(os.sep, "/"))


def model_source(tb) -> str | None:
    """``file:line`` of the innermost traceback frame that is model code (not torch, not ours)."""
    best = None
    for frame, lineno in traceback.walk_tb(tb):
        if is_model_file(frame.f_code.co_filename):
            best = f"{os.path.abspath(frame.f_code.co_filename)}:{lineno}"
    return best


def model_frame(stack=None) -> traceback.FrameSummary | None:
    """The innermost frame of model code in a ``traceback.extract_stack()`` (the current stack
    by default), or None."""
    for fr in reversed(stack if stack is not None else traceback.extract_stack()):
        if is_model_file(fr.filename):
            return fr
    return None


def model_source_stack(stack=None) -> str | None:
    """``file:line (code)`` of the innermost frame of model code in a
    ``traceback.extract_stack()`` (the current stack by default)."""
    fr = model_frame(stack)
    return None if fr is None else f"{os.path.abspath(fr.filename)}:{fr.lineno} ({fr.line})"


def model_line() -> str:
    """`` at file:line`` of the innermost frame of model code on the current stack, or "" (a
    note's place)."""
    fr = model_frame(traceback.extract_stack())
    return "" if fr is None else f" at {os.path.abspath(fr.filename)}:{fr.lineno}"


def calling_frame(match: Callable[[str], bool], skip: int = 1) -> FrameType | None:
    """The innermost frame of the caller's stack (``skip`` frames up) whose file name
    ``match`` accepts, or None: which library's code is asking (an ``.item()`` read, say)."""
    f = sys._getframe(skip + 1)
    while f is not None:
        if match(f.f_code.co_filename.replace("\\", "/")):
            return f
        f = f.f_back
    return None

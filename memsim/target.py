"""The model a command names: ``path/to/file.py:NAME`` or ``package.module:NAME``, an
``nn.Module`` instance, subclass (built with no arguments) or zero-argument function returning
one, imported and built under ``torch.device("meta")``: no weights exist."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from memsim.tracer import InputError, UsageError

__all__ = ["load_target"]


def load_target(target: str) -> torch.nn.Module:
    """Import ``file.py:NAME`` or ``package.module:NAME`` and build the module on meta."""
    model = _load_target(target)
    from .process import settle
    settle()
    return model


def _load_target(target: str) -> torch.nn.Module:
    if ":" not in target:
        raise UsageError(f"target {target!r} has no ':NAME'",
                         hint="write path/to/file.py:NAME or package.module:NAME")
    where, name = target.rsplit(":", 1)
    with torch.device("meta"):
        if where.endswith(".py") or os.sep in where or "/" in where:
            if not os.path.isfile(where):
                raise InputError(f"no such file: {where}", hint="check the path before ':'")
            modname = f"memsim_target_{abs(hash(os.path.abspath(where)))}"
            spec = importlib.util.spec_from_file_location(modname, where)
            mod = importlib.util.module_from_spec(spec)
            sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
            try:
                spec.loader.exec_module(mod)
            finally:
                sys.path.pop(0)
        else:
            try:
                mod = importlib.import_module(where)
            except ImportError as e:
                raise InputError(f"cannot import {where!r}: {e}",
                                 hint="is the package installed, or did you mean a .py path?")
        if not hasattr(mod, name):
            found = [k for k, v in vars(mod).items() if not k.startswith("_") and (
                isinstance(v, torch.nn.Module) or callable(v))]
            raise InputError(f"{where} has no attribute {name!r}",
                             hint=f"candidates: {', '.join(found[:12]) or '(none)'}")
        obj = getattr(mod, name)
        if isinstance(obj, torch.nn.Module):
            return obj
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            return obj()
        if callable(obj):
            got = obj()
            if isinstance(got, torch.nn.Module):
                return got
            raise InputError(f"{target} returned {type(got).__name__}, not an nn.Module")
    raise InputError(f"{target} is neither an nn.Module, a subclass of it, nor a function")

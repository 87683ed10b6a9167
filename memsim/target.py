"""The model a command names, built under ``torch.device("meta")``: no weights exist.

- ``path/to/file.py:NAME`` or ``package.module:NAME``: an ``nn.Module`` instance, subclass
  (built with no arguments) or zero-argument function returning one;
- ``hf:PATH``: a Hugging Face model from its configuration, a ``config.json`` file or a folder
  holding one (or a hub id found in the local cache: nothing is downloaded), its class from the
  configuration's ``architectures`` (or ``--hf-class``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from memsim.tracer import InputError, UsageError

__all__ = ["load_target", "hf_config", "default_inputs", "HF"]

HF = "hf:"


def load_target(target: str, hf_class: str | None = None) -> torch.nn.Module:
    """The module ``target`` names, built on meta (``hf_class``: the class of an ``hf:``
    target, where not its configuration's)."""
    if target.startswith(HF):
        config, cls = hf_config(target, hf_class)
        with torch.device("meta"):
            model = cls(config)
    else:
        if hf_class:
            raise UsageError("--hf-class names the class of an hf: target",
                             hint=f"e.g. hf:path/to/config.json --hf-class {hf_class}")
        model = _load_target(target)
    from .process import settle
    settle()
    return model


def _failed(where: str, e: Exception) -> InputError:
    """The model's file (or module) raising while it loads, as an error naming its line:
    the exception is the user's code's, not memsim's."""
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    path = os.path.abspath(where) if where.endswith(".py") else None
    mine = [f for f in frames if path is None or os.path.abspath(f.filename) == path]
    line = f", line {mine[-1].lineno}" if mine else ""
    return InputError(f"{where}{line} raised while loading: {type(e).__name__}: {e}",
                      hint="the model's file runs as Python when memsim loads it; run "
                           f"python {where} to see the whole traceback" if path else
                           f"python -c 'import {where}' shows the whole traceback")


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
            except Exception as e:
                raise _failed(where, e) from e
            finally:
                sys.path.pop(0)
        else:
            try:
                mod = importlib.import_module(where)
            except ImportError as e:
                raise InputError(f"cannot import {where!r}: {e}",
                                 hint="is the package installed, or did you mean a .py path?")
            except Exception as e:
                raise _failed(where, e) from e
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
            raise InputError(f"{target} returned {type(got).__name__}, not an nn.Module",
                             hint=_config_hint(got))
    raise InputError(f"{target} is a {type(obj).__name__}: neither an nn.Module, a subclass of "
                     "it, nor a function returning one", hint=_config_hint(obj))


def _config_hint(obj) -> str | None:
    """The fix where ``obj`` is a Hugging Face configuration rather than a model."""
    if not (hasattr(obj, "model_type") and hasattr(obj, "to_json_file")):
        return None
    return ("that is a configuration: build the model from it (a function returning "
            "AutoModelForCausalLM.from_config(config)), or save it with config.to_json_file("
            "'config.json') and give hf:config.json")


def hf_config(target: str, hf_class: str | None = None):
    """``(configuration, model class)`` of an ``hf:PATH`` target, read offline: PATH is a
    ``config.json`` file, a folder holding one, or a hub id already in the local cache."""
    where = target[len(HF):]
    if not where:
        raise UsageError("hf: names no configuration",
                         hint="hf:path/to/config.json, hf:path/to/folder or hf:org/name")
    try:
        import transformers
    except ImportError:
        raise InputError("hf: targets need transformers",
                         hint="pip install 'memsim[hf]'") from None
    local = os.path.exists(where)
    try:
        if local and os.path.isfile(where):
            config = transformers.AutoConfig.for_model(
                **transformers.PretrainedConfig.get_config_dict(where)[0])
        else:
            config = transformers.AutoConfig.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        if local:
            raise InputError(f"{where}: not a Hugging Face configuration ({e})",
                             hint="a config.json, or a folder holding one") from None
        raise InputError(f"{where}: no such file or folder, and no such model in the local "
                         "Hugging Face cache (memsim never downloads)",
                         hint="give the path of its config.json, or fetch it first with "
                              "huggingface-cli download ORG/NAME config.json") from None
    names = [hf_class] if hf_class else list(getattr(config, "architectures", None) or [])
    if not names:
        raise UsageError(f"{where}: the configuration names no architecture",
                         hint="name the class: --hf-class LlamaForCausalLM")
    cls = getattr(transformers, names[0], None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise UsageError(f"transformers has no model class {names[0]!r}",
                         hint="--hf-class NAME, a class of transformers such as "
                              f"{type(config).__name__.replace('Config', 'ForCausalLM')}")
    return config, cls


def default_inputs(target: str, hf_class: str | None = None) -> list[str] | None:
    """The ``--input`` options an ``hf:`` target gets when none is given: ``input_ids`` of
    shape (B, S), and ``labels`` of the same shape for a causal LM (its loss); None for a
    model whose forward takes no ``input_ids``."""
    import inspect
    _, cls = hf_config(target, hf_class)
    params = inspect.signature(cls.forward).parameters
    if "input_ids" not in params:
        return None
    out = ["input_ids=int64[B,S]"]
    if cls.__name__.endswith("ForCausalLM") and "labels" in params:
        out.append("labels=int64[B,S]")
    return out

"""The ``memsim`` command line.

    memsim analyze path/to/file.py:NAME --input input_ids=int64[B,S] --at B=4,S=2048

``NAME`` is an ``nn.Module`` instance, an ``nn.Module`` subclass (built with no arguments) or a
zero-argument function returning a module; ``file.py:NAME`` and ``package.module:NAME`` both
work. The target is imported and built under ``torch.device("meta")``: no weights exist.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys

import torch

from analysis import analyze
from tracer import InputError, MemsimError, UsageError, parse_assignments, parse_input

from .render import to_json, to_text


def load_target(target: str) -> torch.nn.Module:
    """Import ``file.py:NAME`` or ``package.module:NAME`` and build the module on meta."""
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memsim", description="Training-memory simulator for PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyze", help="symbolic peak memory of a training step and inference")
    a.add_argument("target", help="path/to/file.py:NAME or package.module:NAME")
    a.add_argument("--input", action="append", default=[], metavar="NAME=DTYPE[DIMS]",
                   help="a tensor input, e.g. input_ids=int64[B,S] (repeat per input)")
    a.add_argument("--at", metavar="B=4,S=2048", help="evaluate every formula at this point")
    a.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="whose kernels to model (default cuda)")
    a.add_argument("--hint", metavar="S=64", help="example sizes for the symbolic run")
    a.add_argument("--optimizer", default="AdamW", help="a torch.optim class name (default AdamW)")
    g = a.add_mutually_exclusive_group()
    g.add_argument("--train", action="store_true", help="only the training step")
    g.add_argument("--inference", action="store_true", help="only inference")
    a.add_argument("--json", action="store_true", help="print the JSON document")
    a.add_argument("--top", type=int, default=8, help="modules to list (default 8)")
    return p


def _optimizer(name: str):
    cls = getattr(torch.optim, name, None)
    if cls is None:
        lower = {k.lower(): k for k in dir(torch.optim) if isinstance(getattr(torch.optim, k), type)}
        cls = getattr(torch.optim, lower.get(name.lower(), ""), None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = sorted(k for k in dir(torch.optim) if isinstance(getattr(torch.optim, k), type)
                       and issubclass(getattr(torch.optim, k), torch.optim.Optimizer)
                       and k != "Optimizer")
        raise UsageError(f"unknown --optimizer {name!r}", hint=f"use one of {', '.join(names)}")
    return lambda params: cls(params)


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.input:
        raise UsageError("no --input given",
                         hint="name each tensor forward takes, e.g. --input input_ids=int64[B,S]")
    specs = [parse_input(s) for s in args.input]
    point = parse_assignments(args.at, "--at") if args.at else None
    hints = parse_assignments(args.hint, "--hint") if args.hint else None
    model = load_target(args.target)
    report = analyze(model, {s.name: s for s in specs}, device=args.device,
                     train=not args.inference, inference=not args.train,
                     optimizer=_optimizer(args.optimizer), hints=hints)
    if point is not None:
        report.train and report.train.check_point(point)
        report.inference and report.inference.check_point(point)
    if args.json:
        print(json.dumps(to_json(report, point), indent=2))
    else:
        print(to_text(report, point, top=args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    try:
        return run(argv)
    except MemsimError as e:
        print(f"memsim: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

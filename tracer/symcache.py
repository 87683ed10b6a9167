"""Symbolic size arithmetic remembered while a step is traced.

Every fake tensor with a symbolic shape costs torch a few dozen operations on its sizes
(``SymNode``): its storage size, its contiguity, the checks of a view. The fake tensor cache
answers an op it has seen without running its kernel, but still makes each output with
``torch.empty_strided`` (and ``set_`` for a view), and the C++ side recomputes all of that
through Python: a tensor of size ``(B, S, 4096)`` takes about 210 us to make, one of size
``(2, 64, 4096)`` 1.2 us, and 110 us with what follows (``python
benchmarks/symbolic_sizes.py``, torch 2.13). A step repeats the same expressions many
thousands of times.

:func:`remembered` keeps, for the duration of a trace, what torch would compute again:

- the result of a binary operation on two sizes (``add``, ``sub``, ``mul``, comparisons,
  ``sym_max``, ``sym_min``): a function of the operands' expressions (after the shape
  environment's replacements), types, hints and summation flags, so the answer is a new
  ``SymNode`` with the remembered expression, type and hint, as torch would make it;
- whether an expression is a number (sympy walks the whole expression every time it is asked).

It steps aside where torch does more than compute: a proxy mode tracing the arithmetic into a
graph, translation validation, structured tracing, unhashable hints. ``mod`` (which reads the
symbols' value ranges) and everything else are not remembered. Nothing changes in what is
computed: the tests' figures are byte for byte those of a trace without it
(``tests/test_symcache.py``). ``MEMSIM_SYMCACHE=0`` in the environment turns it off.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.fx.experimental import sym_node as _sn

__all__ = ["remembered"]

# binary operations whose result depends only on the operands' expressions, types and hints
_PURE = ("add", "sub", "mul", "eq", "ne", "ge", "gt", "le", "lt", "sym_max", "sym_min")

_depth = 0


def _is_number(numbers: dict, e) -> bool:
    try:
        return numbers[e]
    except KeyError:
        r = numbers[e] = bool(e.is_number)
        return r
    except TypeError:  # an unhashable expression
        return bool(e.is_number)


def _binary(orig, method: str, memos: dict):
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    def op(self, other):
        env = self.shape_env
        if (env is None or not isinstance(other, _sn.SymNode) or other.shape_env is not env
                or env._translation_validation_enabled or get_proxy_mode()
                or torch._logging._internal.GET_DTRACE_STRUCTURED):
            return orig(self, other)
        memo = memos.get(id(env))
        if memo is None:   # (the environment is held, so that its id is not reused)
            memo = memos[id(env)] = (env, {})
        memo = memo[1]
        try:
            key = (method, self.expr, other.expr, self.pytype, other.pytype, self._hint,
                   other._hint, self._optimized_summation, other._optimized_summation)
            hit = memo.get(key)
        except TypeError:   # a hint that is itself symbolic (nested ints)
            return orig(self, other)
        if hit is None:
            out = orig(self, other)
            memo[key] = (out._expr, out.pytype, out._hint, out._optimized_summation,
                         out.fx_node)
            return out
        expr, pytype, hint, summed, fx = hit
        return _sn.SymNode(expr, env, pytype, hint, fx_node=fx, optimized_summation=summed)

    return op


def _expr(numbers: dict):
    def expr(self):
        # SymNode.expr (torch 2.13) with its "is it a number" remembered
        e = self._expr
        if isinstance(e, int) or _is_number(numbers, e):
            return e
        env = self.shape_env
        if env is None:
            raise AssertionError("shape_env is required to access expr")
        ver = env._replacements_version_counter
        if ver == 0:
            return e
        if self._expr_cache is not None and ver == self._expr_ver:
            return self._expr_cache
        result = env.replace(e)
        self._expr_ver = ver
        self._expr_cache = result
        return result

    return property(expr)


def _maybe_as_int(numbers: dict):
    def maybe_as_int(self):
        e = self.expr
        if isinstance(e, int):
            return e
        return int(e) if _is_number(numbers, e) else None

    return maybe_as_int


def _patches(numbers: dict, memos: dict) -> list[tuple[str, object]]:
    """(attribute of SymNode, replacement); none when torch's SymNode is not the one this was
    written against (then nothing is remembered)."""
    need = [f"_{m}" for m in _PURE] + ["expr", "maybe_as_int", "_expr_cache", "_expr_ver"]
    probe = _sn.SymNode.__init__.__code__.co_names
    if not all(hasattr(_sn.SymNode, n) or n in probe for n in need):
        return []
    out = [(f"_{m}", _binary(getattr(_sn.SymNode, f"_{m}"), m, memos)) for m in _PURE]
    out += [("expr", _expr(numbers)), ("maybe_as_int", _maybe_as_int(numbers))]
    return out


@contextlib.contextmanager
def remembered():
    """Remember symbolic size arithmetic while the block runs (re-entrant)."""
    global _depth
    if _depth or os.environ.get("MEMSIM_SYMCACHE") == "0":
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    numbers: dict = {}
    memos: dict = {}
    patches = _patches(numbers, memos)
    saved = [(name, _sn.SymNode.__dict__[name]) for name, _ in patches]
    _depth = 1
    try:
        for name, new in patches:
            setattr(_sn.SymNode, name, new)
        yield
    finally:
        for name, old in saved:
            setattr(_sn.SymNode, name, old)
        _depth = 0

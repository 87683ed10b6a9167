"""Every trace starts from the model as it was given.

A forward may change its own module for good: Hugging Face's BigBird switches every layer to
full attention, replacing its attention modules, the first time it sees a sequence too short for
block-sparse attention; other models cache tensors on their modules at the first call. memsim
traces one model several times (example sizes, fixed sizes, code paths), so a change made by one
trace would silently decide the next. :func:`kept` takes the state of every module (its
attributes, submodules, parameters and buffers) before a run and puts it back after, whatever
the run did; the changes of plain values and submodules are described for the report.

>>> import torch
>>> class Flip(torch.nn.Module):
...     mode = "sparse"
...     def forward(self, x):
...         self.mode = "full"
...         return x
>>> m = Flip()
>>> with kept(m) as changes:
...     _ = m(torch.zeros(1))
>>> m.mode, changes
('sparse', ["Flip.mode: 'full' (was 'sparse')"])
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict

import torch

_MISSING = object()
# plain values compared by value (a run that sets an equal value changes nothing)
_VALUES = (str, int, float, bool, type(None), tuple, torch.dtype, torch.device)
# set by memsim itself for the run (train or eval): restored, never a change of the model's
_OWN = frozenset({"training"})


def _snapshot(model: torch.nn.Module) -> list:
    """Each module's attributes, and the contents of those that are dicts: its submodules,
    parameters, buffers and hooks (Hugging Face installs its output-capturing hooks at the
    first call and marks the model: both are undone together)."""
    out = []
    for path, mod in model.named_modules(remove_duplicate=True):
        attrs = vars(mod)
        tables = {k: dict(v) for k, v in attrs.items() if type(v) in (dict, OrderedDict)}
        out.append((path, mod, dict(attrs), tables))
    return out


def _same(old, new) -> bool:
    """The same value: the same object, an equal plain value, a list or tuple of the same
    values, a weak reference to the same object (``nn.LSTM`` rebuilds its list of flat weights,
    and of weak references to them, whenever a parameter is set, as the trace's fake
    parameters are, and again when they are put back)."""
    if old is new:
        return True
    if type(old) is not type(new):
        return False
    if isinstance(old, (list, tuple)):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new))
    if isinstance(old, weakref.ref):
        return old() is new()
    if isinstance(old, _VALUES):
        try:
            return bool(old == new)
        except Exception:  # noqa: BLE001 - a tuple holding tensors: compared by identity
            return False
    return False


def _tensors(v) -> bool:
    """Whether ``v`` is a tensor, or a list or tuple of tensors or of weak references (to
    them): a cache of the module's tensors (``nn.LSTM``'s flat weights follow its parameters,
    which the trace swaps for fake ones)."""
    if isinstance(v, (list, tuple)):
        return bool(v) and all(_tensors(x) or isinstance(x, weakref.ref) for x in v)
    return isinstance(v, torch.Tensor)


def _where(root: str, path: str, key: str) -> str:
    return f"{root}.{path}.{key}" if path else f"{root}.{key}"


def _describe(root: str, path: str, key: str, old, new) -> str | None:
    """The change of ``key`` in words, or None for a change not worth a note (tensors cached
    on the module: restored, as any change is)."""
    if _tensors(new) or _tensors(old):
        return None
    where = _where(root, path, key)
    if new is _MISSING:
        return f"{where} deleted"
    if isinstance(new, torch.nn.Module):
        return f"{where}: a new {type(new).__name__}" + (
            f" (was a {type(old).__name__})" if isinstance(old, torch.nn.Module) else "")
    shown = repr(new) if isinstance(new, _VALUES) else f"a {type(new).__name__}"
    was = "" if old is _MISSING else f" (was {old!r})" if isinstance(old, _VALUES) else ""
    return f"{where}: {shown}{was}"


def _restore(root: str, saved: list) -> list[str]:
    changes = []
    for path, mod, attrs, tables in saved:
        now = vars(mod)
        for key in list(now.keys() | attrs.keys()):
            if key in tables:
                continue
            old, new = attrs.get(key, _MISSING), now.get(key, _MISSING)
            if _same(old, new):
                continue
            if old is _MISSING:
                del now[key]
            else:
                now[key] = old
            # an attribute first set on the instance hid the class's
            was = getattr(type(mod), key, _MISSING) if old is _MISSING else old
            text = None if key in _OWN else _describe(root, path, key, was, new)
            if text is not None:
                changes.append(text)
        for table, before in tables.items():
            current = now[table] = attrs[table]   # the dict itself, if the run replaced it
            for key in current.keys() | before.keys():
                old, new = before.get(key, _MISSING), current.get(key, _MISSING)
                if old is not new and table == "_modules":  # hooks and caches: no note
                    changes.append(_describe(root, path, key, old, new))
            if list(current) != list(before) or any(current[k] is not v
                                                    for k, v in before.items()):
                current.clear()
                current.update(before)
    return changes


@contextlib.contextmanager
def kept(model: torch.nn.Module):
    """Inside: the run; after it, every module of ``model`` as it was before. Yields the list
    the changes the run made are put in (plain values and submodules, in words), filled on
    exit."""
    saved = _snapshot(model)
    changes: list[str] = []
    try:
        yield changes
    finally:
        changes += _restore(type(model).__name__, saved)


def changed_note(changes: list[str], shown: int = 3) -> str:
    """The report's note on what a run changed of the model (undone before the next trace)."""
    more = f" and {len(changes) - shown} more" if len(changes) > shown else ""
    return ("the model changed itself in the step (" + "; ".join(changes[:shown]) + more
            + "): undone after each trace, so every size is traced from the model as given; "
            "a real run keeps such a change for its later steps, whatever their sizes")

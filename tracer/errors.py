"""Typed errors for memsim.

Every error names its culprit (the module, the op, the source line, the option) and carries a
hint. The tree::

    MemsimError
    ├── InputError          a missing, misspelled or malformed input / option
    │   └── UsageError      a malformed command-line value (--input, --at)
    ├── TraceError          the model could not be run symbolically
    │   ├── UnsupportedOpError   an op with no fake/meta kernel
    │   ├── DataDependentError   control flow or an op that depends on tensor values
    │   └── SpecializationError  the model pins a symbol to one value
    ├── OutOfRangeError     a formula evaluated outside the range it was proven for
    └── StrategyError       an impossible strategy setting
"""

from __future__ import annotations


class MemsimError(Exception):
    """Base class of every error memsim raises on purpose."""

    def __init__(self, message: str, *, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


class InputError(MemsimError, ValueError):
    """A missing, misspelled or malformed input or option."""


class UsageError(InputError):
    """A malformed command-line value."""


class TraceError(MemsimError, RuntimeError):
    """The model could not be executed symbolically.

    Attributes
    ----------
    module : str or None
        Dotted path of the innermost module running when it failed ("" is the root module).
    op : str or None
        The ATen op that failed, when one did.
    source : str or None
        ``file:line`` of the innermost frame of model code.
    sizes : dict or None
        The example sizes at which the model's own code failed (None: memsim stopped it).
    """

    sizes: dict | None = None

    def __init__(self, message: str, *, module=None, op=None, source=None, hint=None):
        self.module, self.op, self.source = module, op, source
        self._text = message
        where = []
        if module is not None:
            where.append(f"module '{module or '<root>'}'")
        if op is not None:
            where.append(f"op {op}")
        if source is not None:
            where.append(f"at {source}")
        full = message if not where else f"{message} ({', '.join(where)})"
        super().__init__(full, hint=hint)

    def locate(self, source: str | None) -> None:
        """Name the model's source line, found after the error was made (the message too)."""
        if source is not None and self.source is None:
            TraceError.__init__(self, self._text, module=self.module, op=self.op,
                                source=source, hint=self.hint)


class UnsupportedOpError(TraceError):
    """An op has no fake (meta) kernel, so its memory cannot be known without running it."""


class DataDependentError(TraceError):
    """The model's control flow or an op depends on tensor values, which a symbolic run lacks."""


class SpecializationError(TraceError):
    """The model's code pinned a symbolic size to one value, so no formula holds for it.

    Attributes
    ----------
    symbol : str or None
        The user's symbol that was pinned.
    example : int or None
        Its example size in the run that pinned it (where known).
    """

    def __init__(self, message: str, *, symbol: str | None = None, example: int | None = None,
                 **kw):
        self.symbol, self.example = symbol, example
        super().__init__(message, **kw)


class OutOfRangeError(MemsimError, ValueError):
    """A formula was evaluated outside the range it holds for."""


class StrategyError(MemsimError, ValueError):
    """An impossible or contradictory strategy setting."""


def closest(name: str, choices, n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The ``n`` entries of ``choices`` most like ``name`` (difflib's ratio >= ``cutoff``)."""
    import difflib
    return difflib.get_close_matches(str(name), [str(c) for c in choices], n=n, cutoff=cutoff)


def did_you_mean(name: str, choices, n: int = 1) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to ``name``, or ``""``.

    >>> did_you_mean("adamw8bti", ["adamw8bit", "lion"])
    " (did you mean 'adamw8bit'?)"
    """
    close = closest(name, choices, n)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""

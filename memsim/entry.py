"""The ``memsim`` command's entry: answers a repeated command from the on-disk cache before
anything heavy (torch, the model) is imported, else runs :mod:`memsim.cli` and keeps its answer.

An answer is keyed by everything it depends on:

- the command line, with each path in it (the target, ``--deepspeed``, ``--gpu-file``)
  resolved and the file's content hashed;
- the source of memsim itself, and the versions of torch and of the libraries a model comes
  from (transformers, diffusers, peft, DeepSpeed, bitsandbytes) and of sympy and networkx;
- the environment variables memsim reads (``PYTORCH_CUDA_ALLOC_CONF``, ``MEMSIM_*``);

and it is used only while every source file the run imported from outside Python's own
library and the installed packages (the target and the user's modules it imports) still has
the content it had. A command that writes files (``--plot``, ``--html``, ``--timeline``) or
fails is not kept; ``--no-cache`` neither reads nor writes the cache.

The cache lives where the platform keeps caches (``$XDG_CACHE_HOME/memsim`` or
``~/.cache/memsim`` on Linux, ``~/Library/Caches/memsim`` on macOS,
``%LOCALAPPDATA%\\memsim\\Cache`` on Windows), or in ``$MEMSIM_CACHE_DIR``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import sysconfig
import time

CACHED_COMMANDS = ("analyze", "compare", "checkpoint", "fit", "plan")
FILE_OPTIONS = ("--plot", "--html", "--timeline")
LIBRARIES = ("torch", "transformers", "diffusers", "peft", "deepspeed", "bitsandbytes",
             "sympy", "networkx", "tabulate")
KEEP = 256           # answers kept; the oldest go first
FORMAT = 1


def cache_dir() -> str:
    """Where answers are kept (created on first store)."""
    given = os.environ.get("MEMSIM_CACHE_DIR")
    if given:
        return given
    if sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Caches")
        return os.path.join(base, "memsim")
    if os.name == "nt":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser("~\\AppData\\Local")
        return os.path.join(base, "memsim", "Cache")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "memsim")


def _digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _own_source() -> str:
    """A digest of memsim's own source files (sizes and modification times)."""
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [here] + [os.path.join(os.path.dirname(here), d)
                      for d in ("tracer", "analysis", "strategies")]
    h = hashlib.sha256()
    for root in roots:
        if not os.path.isdir(root):
            continue
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                st = os.stat(os.path.join(root, name))
                h.update(f"{root}/{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def _versions() -> dict:
    from importlib import metadata
    out = {}
    for lib in LIBRARIES:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = None
    return out


def _paths_in(argv: list[str]) -> list[str]:
    """The words of the command line that name files (the target before its ``:NAME``; an
    ``hf:`` target's configuration, or a folder's ``config.json``)."""
    out = []
    for word in argv:
        hf = word[3:] if word.startswith("hf:") else ""
        if hf and os.path.isdir(hf):
            hf = os.path.join(hf, "config.json")
        for part in (word, word.split("=", 1)[-1], word.rsplit(":", 1)[0], hf):
            if part and os.path.isfile(part):
                out.append(os.path.abspath(part))
                break
    return out


def cacheable(argv: list[str]) -> bool:
    if not argv or argv[0] not in CACHED_COMMANDS:
        return False
    words = [w.split("=", 1)[0] for w in argv]
    return not any(w in ("--no-cache", "-h", "--help") or w in FILE_OPTIONS for w in words)


def key(argv: list[str]) -> str:
    doc = {
        "format": FORMAT,
        "argv": argv,
        "cwd": os.getcwd(),
        "files": {p: _digest(p) for p in _paths_in(argv)},
        "memsim": _own_source(),
        "versions": _versions(),
        "python": sys.version,
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith("MEMSIM_") and k != "MEMSIM_CACHE_DIR"
                or k == "PYTORCH_CUDA_ALLOC_CONF"},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _entry_path(k: str) -> str:
    return os.path.join(cache_dir(), f"v{FORMAT}", k + ".json")


def lookup(k: str) -> dict | None:
    """The kept answer under key ``k`` (:func:`key`), where every file it depended on is
    unchanged."""
    try:
        with open(_entry_path(k), encoding="utf-8") as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    for path, digest in entry.get("deps", ()):
        if _digest(path) != digest:
            return None
    return entry


def _user_sources() -> list[str]:
    """Source files of the modules loaded now that are neither Python's own nor installed
    packages' nor memsim's: the target and the user's modules it imported."""
    skip = {os.path.realpath(p) for p in {sysconfig.get_paths()[k] for k in
                                          ("stdlib", "platstdlib", "purelib", "platlib")}}
    mine = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = []
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if not f or not f.endswith(".py") or not os.path.isabs(f) or not os.path.isfile(f):
            continue
        real = os.path.realpath(f)
        if any(real.startswith(s + os.sep) for s in skip):
            continue
        if real.startswith(mine + os.sep) and os.path.basename(os.path.dirname(real)) in (
                "memsim", "tracer", "analysis", "strategies"):
            continue
        out.append(real)
    return sorted(set(out))


def store(k: str, argv: list[str], stdout: str, rc: int) -> None:
    """Keep an answer under key ``k``: the key of the command as it was when it started (a
    file edited while it ran does not get this answer)."""
    path = _entry_path(k)
    entry = {"argv": argv, "stdout": stdout, "rc": rc, "created": time.time(),
             "deps": [[p, _digest(p)] for p in _user_sources()]}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
        _prune(os.path.dirname(path))
    except OSError:
        pass  # a cache that cannot be written is no cache, not an error


def _prune(folder: str) -> None:
    files = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".json")]
    if len(files) <= KEEP:
        return
    files.sort(key=lambda p: os.stat(p).st_mtime)
    for p in files[:len(files) - KEEP]:
        try:
            os.remove(p)
        except OSError:
            pass


class _Tee(io.TextIOBase):
    def __init__(self, out):
        self.out = out
        self.seen = io.StringIO()

    def write(self, s):
        self.seen.write(s)
        return self.out.write(s)

    def flush(self):
        self.out.flush()

    def isatty(self):
        return self.out.isatty()

    def fileno(self):
        return self.out.fileno()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    use = cacheable(argv)
    if use:
        k = key(argv)
        hit = lookup(k)
        if hit is not None:
            sys.stdout.write(hit["stdout"])
            sys.stdout.flush()
            return int(hit["rc"])
    from memsim.cli import main as run
    if not use:
        return run(argv)
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        rc = run(argv)
    finally:
        sys.stdout = tee.out
    if rc in (0, 1):   # 1: the step does not fit (--check, fit): an answer too
        store(k, argv, tee.seen.getvalue(), rc)
    return rc


def script() -> None:
    """The ``memsim`` console script: :func:`main`, then out of the process without tearing its
    heap down object by object (about 1 s after a 7B analysis; ``benchmarks/scale.py``).
    Everything the command writes is written and closed by then; the output streams are
    flushed here. An exception or ``SystemExit`` (a usage error) leaves the usual way. The
    cycle collector is off while torch and the model are imported and built (see
    :func:`settle`)."""
    from .process import own_process
    own_process()
    rc = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a reader gone (memsim gpus | head)
            pass
    os._exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    script()

"""The installed names are namespaced (``memsim.tracer``, ``memsim.analysis``,
``memsim.strategies`` behind the ``memsim`` front door): nothing is installed or imported under
the bare generic names, which other distributions on the index own."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import memsim

BARE = ("tracer", "analysis", "strategies")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_other_folder(tmp_path, code: str):
    """Run ``code`` where the checkout is not on sys.path (as a user's program would)."""
    import json
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def test_distribution_installs_only_memsim(tmp_path):
    """The installed distribution's files and top-level names (the editable install's import
    mapping included) hold memsim only."""
    got = _in_other_folder(tmp_path, """if True:
        import importlib.metadata as md, json, sys
        d = md.distribution("memsim")
        import memsim  # installs the editable finder, if any
        maps = [sorted(getattr(m, "MAPPING", {})) for n, m in sys.modules.items()
                if n.startswith("__editable__") and n.endswith("_finder")]
        print(json.dumps({"top": d.read_text("top_level.txt").split(),
                          "files": [str(f) for f in d.files or ()], "maps": maps,
                          "script": d.entry_points.select(group="console_scripts")["memsim"].value}))
    """)
    assert got["top"] == ["memsim"]
    for f in got["files"]:
        assert f.split("/")[0].removesuffix(".py") not in BARE, f"installed file {f}"
    for mapping in got["maps"]:
        assert all(name == "memsim" or name.startswith("memsim.") for name in mapping), mapping
    assert got["script"] == "memsim.entry:script"  # the answer cache, then memsim.cli


def test_bare_names_are_not_importable_outside_the_checkout(tmp_path):
    """From another folder (no checkout on sys.path), the bare names are not ours, and the
    namespaced ones are the checkout's folders (editable install)."""
    got = _in_other_folder(tmp_path, (
        "import importlib.util as u, json, memsim.tracer, memsim.analysis, memsim.strategies, "
        "memsim.cli; print(json.dumps({n: (s.origin if (s := u.find_spec(n)) else None) for n "
        f"in {BARE!r}}}))"))
    for name, origin in got.items():
        assert origin is None or not origin.startswith(ROOT), (name, origin)


def _imports(path: str):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_no_code_imports_a_bare_name():
    """Every import of memsim's own packages goes through ``memsim.``: a bare ``import tracer``
    from the checkout would load a second copy of the package (two registries, two enums)."""
    bad = []
    for top in ("memsim", *BARE, "tests", "benchmarks", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    p = os.path.join(dirpath, f)
                    bad += [f"{os.path.relpath(p, ROOT)}:{line} imports {mod}"
                            for line, mod in _imports(p) if mod.split(".")[0] in BARE]
    assert not bad, "\n".join(bad)


def test_front_door_exports():
    for name in ("analyze", "trace", "Report", "LoRA", "FSDP", "TensorParallel", "ZeRO", "DDP",
                 "MemsimError", "__version__"):
        assert hasattr(memsim, name), name


def test_oracles_import_nothing_of_memsim():
    """The oracles (a real CPU run, real multi-rank runs, published formulas) share no code
    with what they check: no import of memsim's packages, nor of the rest of ``tests`` (whose
    helpers import memsim), by name or by a relative import that leaves the folder."""
    folder = os.path.join(ROOT, "tests", "support", "oracles")
    own = "tests.support.oracles"
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(folder) for f in names
                   if f.endswith(".py"))
    assert files, folder
    bad = []
    for path in files:
        depth = len(Path(path).parent.relative_to(folder).parts)   # "from ." stays inside
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level > depth + 1:
                mods = [f"{'.' * node.level}{node.module or ''} (outside the oracles)"]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            else:
                continue
            bad += [f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {mod}" for mod in mods
                    if mod.split(".")[0] in ("memsim", *BARE) or "outside the oracles" in mod
                    or (mod.split(".")[0] == "tests" and not (mod + ".").startswith(own + "."))]
    assert not bad, "\n".join(bad)


def test_declared_test_dependencies_import():
    """Every distribution of the ``test`` extra imports (DeepSpeed as memsim imports it); in CI
    (MEMSIM_STRICT_DEPS=1, tests/conftest.py) a missing or broken one fails the run instead of
    skipping the QLoRA, 8-bit or ZeRO checks."""
    import importlib
    import re
    import tomllib

    import pytest

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    modules = {"pytest-xdist": "xdist"}
    broken = []
    for req in extra:
        dist = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        try:
            if dist == "deepspeed":
                from memsim.strategies.ds_engine import _import_deepspeed
                _import_deepspeed()
            else:
                importlib.import_module(modules.get(dist, dist.replace("-", "_")))
        except Exception as e:  # noqa: BLE001 - any failure to import is what this reports
            broken.append(f"{dist}: {type(e).__name__}: {e}")
    if broken:
        pytest.skip("test dependencies missing or broken (pip install -e '.[test]'): "
                    + "; ".join(broken))

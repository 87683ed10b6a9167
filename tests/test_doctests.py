"""The docstring examples of every memsim module, run as the installed ``memsim.*`` modules
(pytest's ``--doctest-modules`` would import the source folders under their bare names)."""

import doctest
import importlib
import pkgutil

import pytest

import memsim


def _modules() -> list[str]:
    out = ["memsim"]
    for info in pkgutil.walk_packages(memsim.__path__[:1], "memsim."):
        out.append(info.name)
    for pkg in ("memsim.tracer", "memsim.analysis", "memsim.strategies"):
        mod = importlib.import_module(pkg)
        out.append(pkg)
        out += [info.name for info in pkgutil.walk_packages(mod.__path__, pkg + ".")]
    return sorted(set(n for n in out if not n.endswith("__main__")))


MODULES = _modules()


def test_every_package_is_found():
    """Nothing collected is a failure, not a pass (pytest's exit 5, in spirit)."""
    for pkg in ("memsim.cli", "memsim.tracer.step", "memsim.analysis.peak",
                "memsim.strategies.checkpoint"):
        assert pkg in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    mod = importlib.import_module(name)
    tests = doctest.DocTestFinder().find(mod, name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        runner.run(t)
    assert runner.failures == 0, f"{runner.failures} doctest failure(s) in {name} (output above)"

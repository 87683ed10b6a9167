import os
import sys

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
# the command's answer cache (memsim.entry) of this session only: commands the tests run in
# subprocesses neither read nor leave answers in the user's cache
if "MEMSIM_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["MEMSIM_CACHE_DIR"] = tempfile.mkdtemp(prefix="memsim-test-cache-")

# pytest-xdist already keeps every core busy: a trace's run B, and a point below the range
# given to analyze(points=...), are traced in this process, not in a forked child
# (memsim.tracer.trace.forked; tests/test_fold.py turns it on to check both)
os.environ.setdefault("MEMSIM_PARALLEL", "0")

# MEMSIM_STRICT_DEPS=1 (set by .ci/run): a skip is a failure. Every test of the suite runs with
# the `test` extra installed, so in CI a skip can only mean a declared dependency is missing or
# broken (a QLoRA, 8-bit or ZeRO check that would otherwise vanish from a green run). Without
# it, as on a user's partial install, tests skip and pytest's -ra prints the reason.
STRICT_DEPS = os.environ.get("MEMSIM_STRICT_DEPS") == "1"


def _strict(rep, where: str) -> None:
    if STRICT_DEPS and rep.skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = (f"{where} skipped under MEMSIM_STRICT_DEPS=1 (CI installs every test "
                        f"dependency, so no test may skip): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _strict(outcome.get_result(), item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _strict(outcome.get_result(), collector.nodeid)


def example(name: str):
    """The module ``examples/<name>.py``, loaded from its file (the examples are not a
    package)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", os.path.join(root, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def grid(**axes):
    """Every combination of the given values: grid(B=(2, 3), S=(4, 9)) -> 4 points."""
    import itertools

    names = list(axes)
    return [dict(zip(names, vals)) for vals in itertools.product(*axes.values())]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield

import os

import pytest
import torch

torch.set_num_threads(1)
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
# the one skip strict mode lets pass: a real run this machine's hardware cannot make (oneDNN's
# bf16 kernels need AVX-512); the reason starts with it, and pytest -ra prints it
HOST_SKIP = "the host cannot run it"


def _strict(rep, where: str) -> None:
    if STRICT_DEPS and rep.skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if reason.removeprefix("Skipped: ").startswith(HOST_SKIP):
            return
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


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield

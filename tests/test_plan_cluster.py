"""``memsim plan --cluster``: the same plan from a real local Ray cluster (a head node and its
worker processes, started with ``ray start``) as from this process, and a worker that dies
mid-task loses no layout (Ray retries the task)."""

import json
import os
import shutil
import socket
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = ["memsim", "plan", "tests.support.oracles.dist:llama_model", "--input",
        "input_ids=int64[B,S]", "--input", "labels=int64[B,S]", "--device", "cpu", "--gpus", "2",
        "--gpus-per-node", "2", "--global-batch", "4", "--seq", "16", "--margin", "0",
        "--memory", "1GiB", "--fix", "checkpoint=none", "--json", "--quiet", "--no-cache"]

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    # a cluster of this test's own, on 127.0.0.1: Ray 2.60 turns token authentication on by
    # itself in some processes (a pytest-xdist worker's), and the driver then has no token
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", **extra}


def _plan(*extra) -> dict:
    r = subprocess.run(PLAN + list(extra), capture_output=True, text=True, cwd=ROOT,
                       env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


class _Cluster:
    """A Ray head node of 2 CPUs on a free port (its worker processes start with it), stopped
    on exit."""

    def __init__(self, **env):
        self.env = _env(**env)

    def __enter__(self) -> str:
        port = _free_port()
        r = subprocess.run(["ray", "start", "--head", "--port", str(port), "--num-cpus", "2",
                            "--include-dashboard=false", "--disable-usage-stats"],
                           capture_output=True, text=True, env=self.env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc):
        subprocess.run(["ray", "stop", "--force"], capture_output=True, env=self.env,
                       timeout=300)


def _layouts(doc: dict) -> list:
    return sorted(tuple(sorted(r.items())) for r in doc["layouts"])


def test_a_ray_cluster_gives_the_plan_this_process_gives_and_loses_no_layout(tmp_path):
    """One test, one cluster at a time: ``ray stop`` stops every Ray process of the machine,
    so two clusters of parallel test workers would stop each other."""
    if shutil.which("ray") is None:
        pytest.skip("ray is not installed (pip install 'memsim[cluster]')")
    local = _plan()
    with _Cluster() as address:
        got = _plan("--cluster", address)
    assert _layouts(got) == _layouts(local)
    assert got["plan"]["traces"] == local["plan"]["traces"]   # counted in the workers
    # a worker that dies mid-task: Ray runs the task again, and no layout is lost
    died = tmp_path / "died"
    with _Cluster(MEMSIM_PLAN_TEST_CRASH=str(died)) as address:
        got = _plan("--cluster", address)
    assert died.exists()                       # a worker process did die in a task
    assert _layouts(got) == _layouts(local)

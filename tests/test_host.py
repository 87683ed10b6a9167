"""The answer does not depend on the machine memsim runs on: the modelled device decides.

PyTorch's CPU kernels ask the host's CPU which path to take (oneDNN's bf16 kernels need AVX-512;
ATen's vectorized kernels dispatch on the instruction set). A rule that asked the host too made
``nn.LSTM`` in bf16 exact on an AVX-512 machine and fitted on one without. Here the same
analyses run in this process and in one where PyTorch sees a CPU without AVX-512
(``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``, which PyTorch and oneDNN read at start),
and every figure must be the same.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WITHOUT_AVX512 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

# models whose CPU kernels differ by instruction set: bf16 LSTM (oneDNN or native), bf16
# convolutions (oneDNN or the slow path), bf16 matmuls and SDPA
PROGRAM = r"""
import functools, json, sys
import torch
torch.set_num_threads(1)
from memsim.analysis import analyze
from memsim.tracer import CpuIsa

from tests.support import zoo

CASES = {
    "lstm-bf16": (functools.partial(zoo.LSTMLM, bidirectional=True),
                  {"x": ("int64", ["B", "S"])}, "bf16-true"),
    "cnn-bf16": (zoo.CNN, {"x": ("float32", ["B", 3, "H", "H"])}, "bf16-true"),
    "unet-bf16-mixed": (zoo.TinyUNet, {"x": ("float32", ["B", 3, 16, 16])}, "bf16-mixed"),
    "block-sdpa-bf16-mixed": (lambda: zoo.Block(sdpa=True),
                              {"x": ("float32", ["B", "S", 32])}, "bf16-mixed"),
}
out = {"host": CpuIsa.host().value, "capability": torch.backends.cpu.get_cpu_capability()}
for name, (factory, inputs, precision) in CASES.items():
    with torch.device("meta"):
        model = factory()
    r = analyze(model, inputs, device="cpu", precision=precision)
    out[name] = {"basis": r.basis, "train": str(r.train.peak), "inference": str(r.inference.peak),
                 "notes": [n for n in r.notes if "AVX-512" in n]}
print(json.dumps(out))
"""


def _run(env_extra: dict) -> dict:
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def both():
    return _run({}), _run(WITHOUT_AVX512)


def test_the_emulated_machine_has_no_avx512(both):
    """The check below compares two machines only if PyTorch really saw no AVX-512 in the
    second process: its oneDNN offers no bf16 kernel and ATen dispatches AVX2 code."""
    _, without = both
    assert without["host"] == "avx2" and without["capability"] == "AVX2", without


def test_every_figure_is_the_same_without_avx512(both):
    """Basis, training and inference peaks (formulas), and the note saying which CPU was
    modelled (AVX-512, the default) are equal whatever the host's instruction set."""
    here, without = both
    for name in (k for k in here if k not in ("host", "capability")):
        assert here[name] == without[name], (name, here[name], without[name])
    assert here["lstm-bf16"]["basis"] == "exact"
    assert len(here["lstm-bf16"]["notes"]) == 1 and "cpu_isa='avx512'" in \
        here["lstm-bf16"]["notes"][0], here["lstm-bf16"]["notes"]

"""The examples gallery (examples/*.py, README "Examples"): every example's small form runs and
prints readable, consistent lines (a verdict on every line with a peak, sizes that parse and
agree with the exact bytes printed beside them, a largest batch); where the small form runs on
the CPU, a printed peak equals a real CPU run of the same step (own_cnn, vit_resolution and
gpt2_24gb without checkpointing). The full forms are the real-size questions (minutes each); the
README shows their outputs."""

import contextlib
import io
import re

import pytest
import torch

from conftest import example
from memsim.render import human
from oracles.measure import example_inputs, materialize, measure_train

EXAMPLES = ["own_cnn", "gpt2_24gb", "llama3_8b_lora", "llama13b_zero3", "llama70b_tp_fsdp",
            "vit_resolution"]
SIZE = r"(-?[\d.]+ (?:B|KiB|MiB|GiB|TiB))"
PEAK = re.compile(SIZE.replace("(", "(?P<human>", 1) + r" \((?P<bytes>[\d,]+) B\)")
_OUT: dict = {}


def _run(name: str, **options) -> str:
    """The small form's standard output (run once per session)."""
    key = (name, *sorted(options.items()))
    if key not in _OUT:
        try:
            from transformers import logging as hf_logging
        except ImportError:  # own_cnn needs no transformers
            hf_logging = None
        level = hf_logging and hf_logging.get_verbosity()  # the examples quieten transformers
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                example(name).main(small=True, **options)
        finally:
            if hf_logging is not None:
                hf_logging.set_verbosity(level)
        _OUT[key] = buf.getvalue()
    return _OUT[key]


def _parse_size(text: str) -> float:
    value, unit = text.split()
    return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


def _verdicts(out: str) -> list[dict]:
    """Each line with a peak: its exact bytes, sizes, verdict and headroom."""
    rows = []
    for line in out.splitlines():
        if "peak allocated" not in line:
            continue
        m = re.search(r"peak allocated " + PEAK.pattern, line)
        assert m, line
        exact = int(m["bytes"].replace(",", ""))
        assert human(exact) == m["human"], line  # the rounded size is the exact one's
        total = re.search(r"total " + SIZE, line)
        verdict = re.search(r": (FITS|DOES NOT FIT), headroom (-?[\d.]+)%", line)
        assert total and verdict, line
        assert re.search(r"reserved (n/a on CPU|over the budget|" + SIZE + ")", line), line
        headroom = float(verdict[2])
        # fits: total <= 90% of the capacity, i.e. headroom >= 10% (printed to 0.1%)
        assert (headroom >= 9.95) if verdict[1] == "FITS" else (headroom <= 10.05), line
        assert _parse_size(total[1]) >= exact * 0.99  # the total includes the peak (2 decimals)
        rows.append({"line": line, "bytes": exact, "fits": verdict[1] == "FITS"})
    return rows


@pytest.mark.parametrize("name,options", [(n, {}) for n in EXAMPLES] + [
    ("llama13b_zero3", {"deepspeed": True})], ids=EXAMPLES + ["llama13b_zero3-deepspeed"])
def test_small_form_prints_its_verdicts(name, options):
    if name != "own_cnn":
        pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    if name == "llama3_8b_lora":  # QLoRA
        pytest.importorskip("bitsandbytes", reason="pip install -e '.[test]'")
    if options.get("deepspeed"):
        pytest.importorskip("deepspeed", reason="pip install -e '.[test]'")
    out = _run(name, **options)
    rows = _verdicts(out)
    assert rows, out
    largest = re.findall(r"largest (?:micro-)?batch[^:\n]*: (\d+)", out)
    assert largest and all(int(v) >= 0 for v in largest), out
    assert re.search(r"\(analysed in [\d.]+ s\)", out), out
    if name == "own_cnn":  # growing batch against a 4 MiB budget: it stops fitting
        assert [r["fits"] for r in rows] == [True, False, False]
        assert 4 <= int(largest[0]) < 16
    if name == "gpt2_24gb":  # checkpointing every block lowers the peak and raises the batch
        assert rows[1]["bytes"] < rows[0]["bytes"] and int(largest[1]) > int(largest[0])
    if name == "vit_resolution":  # more patches, more memory, a smaller largest batch
        assert [r["bytes"] for r in rows] == sorted(r["bytes"] for r in rows)
        assert [int(v) for v in largest] == sorted((int(v) for v in largest), reverse=True)


def _printed_peak(name: str, marker: str) -> int:
    line = next(r for r in _verdicts(_run(name)) if marker in r["line"])
    return line["bytes"]


def _real_peak(model, inputs, point, **kw) -> int:
    torch.manual_seed(0)
    return measure_train(materialize(model), example_inputs(inputs, point), **kw).peak


def test_own_cnn_peak_equals_a_real_cpu_run():
    mod = example("own_cnn")
    c = mod.config(small=True)
    model = mod.CNN(c["widths"], c["classes"])
    assert _printed_peak("own_cnn", "B=4:") == _real_peak(model, mod.inputs(small=True),
                                                          {"B": 4})


def test_vit_resolution_peak_equals_a_real_cpu_run():
    pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    mod = example("vit_resolution")
    model = mod.model(32, small=True)  # built on the CPU: materialize() keeps it
    assert _printed_peak("vit_resolution", "32x32") == _real_peak(
        model, mod.inputs(32), {"B": 4}, precision="bf16-mixed")


def test_gpt2_peak_equals_a_real_cpu_run():
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    mod = example("gpt2_24gb")
    c = mod.config(small=True)
    # built on the CPU, not on meta: to_empty() would untie the head from the embedding
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**c["gpt2"]))
    assert _printed_peak("gpt2_24gb", "no checkpointing") == _real_peak(
        model, mod.INPUTS, c["point"], precision="bf16-mixed", keep_outputs=False)

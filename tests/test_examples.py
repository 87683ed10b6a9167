"""The examples gallery (examples/*.py, docs/examples.md): every example's small form runs and
prints readable, consistent lines (a verdict on every line with a peak, sizes that parse and
agree with the exact bytes printed beside them, a largest batch); where the small form runs on
one CPU process, a printed peak equals a real CPU run of the same step (own_cnn, vit_resolution
and gpt2_24gb without checkpointing), and so does every largest batch it prints (real runs at it
and one above). The full forms are the real-size questions (minutes each); docs/examples.md
shows their outputs."""

import contextlib
import functools
import io
import re

import pytest
import torch

from memsim.render import human

from tests.support.examples import example
from tests.support.oracles.measure import example_inputs, materialize, measure_train

EXAMPLES = ["own_cnn", "gpt2_24gb", "llama3_8b_lora", "llama13b_zero3", "llama70b_tp_fsdp",
            "vit_resolution"]
SIZE = r"(-?[\d.]+ (?:B|KiB|MiB|GiB|TiB))"
PEAK = re.compile(SIZE.replace("(", "(?P<human>", 1) + r" \((?P<bytes>[\d,]+) B\)")
LARGEST = re.compile(r"largest (?:micro-)?batch[^:\n]*: (\d+)")
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
    # at least one largest batch printed as a number (the values:
    # test_largest_batch_equals_real_cpu_runs)
    largest = LARGEST.findall(out)
    assert largest, out
    assert re.search(r"\(analysed in [\d.]+ s\)", out), out
    if name == "own_cnn":  # growing batch against a 4 MiB budget: it stops fitting
        assert [r["fits"] for r in rows] == [True, False, False]
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


def _configurations(name: str) -> list[tuple]:
    """The configurations whose largest batch the small form of ``name`` prints, in the order
    it prints them: (a factory building the example's model on the CPU, built here as a user
    builds it, its inputs, the other sizes, the real run's options)."""
    mod = example(name)
    if name == "own_cnn":
        c = mod.config(small=True)
        return [(lambda: mod.CNN(c["widths"], c["classes"]), mod.inputs(small=True), {}, {})]
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    if name == "gpt2_24gb":
        c = mod.config(small=True)

        def gpt2(checkpointing: bool):
            m = transformers.GPT2LMHeadModel(transformers.GPT2Config(**c["gpt2"]))
            if checkpointing:  # every block, as users ask Hugging Face for it
                m.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            return m

        opts = dict(precision="bf16-mixed", keep_outputs=False)
        return [(functools.partial(gpt2, ckpt), mod.INPUTS, {"S": c["point"]["S"]}, opts)
                for ckpt in (False, True)]
    assert name == "vit_resolution"
    return [(functools.partial(mod.model, res, small=True), mod.inputs(res), {},
             {"precision": "bf16-mixed"}) for res in mod.config(small=True)["resolutions"]]


@pytest.mark.parametrize("name", ["own_cnn", "gpt2_24gb", "vit_resolution"])
def test_largest_batch_equals_real_cpu_runs(name):
    """Every largest batch a CPU small form prints is the one real CPU runs of the same step
    give: at that batch the real peak is within the usable budget (the printed budget less the
    10% margin against() keeps by default), and at one more it is not (the peak grows with B)."""
    out = _run(name)
    budget = int(re.search(r"against a (\d+) MiB budget", out)[1]) * 2 ** 20
    usable = int(budget * 0.9)
    largest = [int(v) for v in LARGEST.findall(out)]
    configurations = _configurations(name)
    assert len(largest) == len(configurations), out
    for b, (factory, inputs, sizes, options) in zip(largest, configurations):
        at, above = (_real_peak(factory(), inputs, {**sizes, "B": n}, **options)
                     for n in (b, b + 1))
        assert at <= usable < above, f"largest batch {b}: real peaks {at:,} and {above:,} B " \
            f"at {b} and {b + 1}, usable {usable:,} B"

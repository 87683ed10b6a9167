"""The budget: capacities with units, the verdict, and limits solved from the formula.

The limits are checked against real CPU runs: with ``device="cpu"`` every overhead term is 0, so
the total is the measured peak, and the answer must fit while answer + 1 must not.
"""

import json

import pytest
import torch

from memsim.analysis.budget import Overheads, against
from memsim.analysis.gpus import gpu, load_catalog, parse_memory
from memsim.cli import main
from memsim.tracer import InputError, UsageError

from tests.support import zoo
from tests.support.examples import example
from tests.support.oracles.measure import example_inputs, materialize, measure_train
from tests.support.predict import predict

SEQ = {"x": ("float32", ["B", "S", 32])}


def _measured_peak(factory, inputs, pt):
    torch.manual_seed(0)
    return measure_train(materialize(factory()), example_inputs(inputs, pt)).peak


@pytest.mark.parametrize("solve", ["B", "S"])
def test_limits_fit_and_next_size_does_not_real_run(solve):
    report = predict(zoo.Block, SEQ, inference=False)
    point = {"B": 3, "S": 12}
    # a capacity that the real run at the target size just exceeds
    target = {**point, solve: 9}
    cap = _measured_peak(zoo.Block, SEQ, target) - 1
    b = against(report, point, capacity=cap, margin=0.0)
    ans = b.max_batch if solve == "B" else b.max_seq
    assert ans == 8
    assert _measured_peak(zoo.Block, SEQ, {**point, solve: ans}) <= cap
    assert _measured_peak(zoo.Block, SEQ, {**point, solve: ans + 1}) > cap
    assert b.overhead == {"fragmentation": 0, "cuda_context": 0, "cublas_workspace": 0,
                          "comm_buffers": 0}  # CPU: no CUDA terms
    assert b.total == b.allocated == _measured_peak(zoo.Block, SEQ, point)  # the real run's


def test_limit_below_the_formula_range_uses_the_size_one_trace():
    report = predict(zoo.MLP, {"x": ("float32", ["B", 16])}, inference=False)
    sub, pt = report.for_point({"B": 1})
    one = sub.at(**pt)["train"]["peak"]
    b = against(report, {"B": 4}, capacity=one, margin=0.0)
    assert b.max_batch == 1 and not b.fits
    b = against(report, {"B": 4}, capacity=one - 1, margin=0.0)
    assert b.max_batch == 0


def test_margin_headroom_and_overheads_on_cuda():
    """The budget's figures from the terms the module documents, computed here: the allocated
    peak (report.at, 512-byte blocks), the reserve of the caching allocator replayed at the
    point (tests/test_caching.py checks the replay's rules), the given context, Hopper's cuBLAS
    workspaces; the allocator confined to capacity * 0.9 less the context; the largest B and S
    are the last sizes whose replay does not run out (checked at the answer and the next size
    with this replay, not the budget's)."""
    from memsim.analysis.reserved import replay

    with torch.device("meta"):
        m = zoo.Block()
    from memsim.analysis import analyze
    r = analyze(m, SEQ, device="cuda", inference=False)
    h100 = gpu("H100 80GB")
    ctx, ws = 100 * 2 ** 20, 33 * 2 ** 20  # cuBLAS 32 MiB (sm90: 4096 KiB * 8) + cuBLASLt 1 MiB
    b = against(r, {"B": 4, "S": 64}, gpu=h100, overheads=Overheads(cuda_context=ctx))
    capacity = 81559 * 2 ** 20  # H100 80GB: 81,559 MiB (nvidia-smi)
    usable = int(capacity * (1 - 0.10))  # the default margin

    def replayed(B, S):
        sub, pt = r.for_point({"B": B, "S": S})
        return replay(sub.train, pt, workspace=ws, limit=usable - ctx)

    def reserved(B, S):
        return replayed(B, S).reserved

    def total(B, S):
        return reserved(B, S) + ctx

    assert b.capacity == capacity
    assert b.allocated == r.at(B=4, S=64)["train"]["peak"]
    assert b.reserved == reserved(4, 64) > b.allocated + ws
    assert b.overhead == {"allocator_cache": b.reserved - b.allocated - ws, "fragmentation": 0,
                          "cuda_context": ctx, "cublas_workspace": ws, "comm_buffers": 0}
    assert b.total == total(4, 64) and b.fits and b.headroom == (capacity - total(4, 64)) / capacity
    assert replayed(b.max_batch, 64).oom is None and total(b.max_batch, 64) <= usable
    assert replayed(b.max_batch + 1, 64).oom is not None
    assert replayed(4, b.max_seq).oom is None and total(4, b.max_seq) <= usable
    assert replayed(4, b.max_seq + 1).oom is not None
    # --fragmentation is a margin of the user's own on top of the replayed reserve
    b5 = against(r, {"B": 4, "S": 64}, gpu=h100,
              overheads=Overheads(cuda_context=ctx, fragmentation=0.05))
    assert b5.total == b.total + int(b.allocated * 0.05)


def test_the_cache_is_confined_to_the_budget_not_the_card():
    """Unconfined, the caching allocator's cache grows while the card has room, so its size
    near the margin says nothing of whether the step runs. Here the whole card's replay
    reserves more than the budget (90%) without releasing anything; confined to the budget, as
    torch.cuda.set_per_process_memory_fraction(0.9) confines a real allocator, it releases its
    cache and the step fits: the verdict, the reserve and the note say so, and the whole
    card's figure is kept beside them."""
    from memsim.analysis import analyze
    from memsim.analysis.reserved import replay

    with torch.device("meta"):
        m = zoo.Block()
    r = analyze(m, SEQ, device="cuda", inference=False)
    ctx, ws = 100 * 2 ** 20, 33 * 2 ** 20
    sub, pt = r.for_point({"B": 4, "S": 1000})
    free = replay(sub.train, pt, workspace=ws)
    assert free.reserved - free.allocated > 20 * 2 ** 20 and not free.retries
    # the budget 10 MiB below the whole card's reserve (which needs 228 MiB of its 248)
    capacity = int((free.reserved - 10 * 2 ** 20 + ctx) / 0.9) + 1
    b = against(r, {"B": 4, "S": 1000}, capacity=capacity,
             overheads=Overheads(cuda_context=ctx, cublas_workspace=ws))
    assert b.reserved_card == free.reserved > int(capacity * 0.9) - ctx
    assert b.fits and b.replay.retries and b.reserved < free.reserved
    assert b.total == b.reserved + ctx <= int(capacity * 0.9)
    assert any("set_per_process_memory_fraction(0.90)" in n for n in b.notes)
    assert any("released its cache" in n and "10% kept free" in n for n in b.notes)
    # the largest batch, and the largest at which the cache is never released
    clean = b.max_batch_no_release
    assert clean < 4 <= b.max_batch

    def confined(B):
        sub, pt = r.for_point({"B": B, "S": 1000})
        return replay(sub.train, pt, workspace=ws, limit=int(capacity * 0.9) - ctx)
    assert not confined(clean).retries and confined(clean + 1).retries
    # between the two, running out of memory need not be monotone in the size: a note says
    # so (benchmarks/limit_band.py measures it at Llama-3-70B's size)
    assert any(n.startswith(f"B: from {clean + 1} to {b.max_batch} the replayed allocator")
               for n in b.notes) == (b.max_batch - clean >= 2)
    assert confined(b.max_batch).oom is None and confined(b.max_batch + 1).oom is not None


def test_units_are_explicit():
    assert parse_memory("24GiB") == 24 * 2 ** 30
    assert parse_memory("80GB") == 80 * 10 ** 9
    assert parse_memory("1.5 MiB") == 1572864
    for bad in ("24", "24 gigs", "GiB"):
        with pytest.raises(UsageError, match="malformed memory size"):
            parse_memory(bad)


def test_unknown_gpu_lists_closest_first():
    with pytest.raises(UsageError) as e:
        gpu("h100-80")
    assert e.value.hint.split(": ", 1)[1].startswith("h100")


def test_catalog_file(tmp_path):
    f = tmp_path / "gpus.toml"
    f.write_text('[my-gpu]\nname = "My GPU"\nmib = 1000\nfamily = "ada"\n')
    load_catalog(str(f))
    assert gpu("my-gpu").bytes == 1000 * 2 ** 20
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": {"name": "no size"}}')
    with pytest.raises(InputError, match="needs at least 'mib'"):
        load_catalog(str(bad))


ARGS = ["examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]", "--device", "cpu",
        "--at", "B=2,S=8"]


def _example_peak():
    """A real CPU step of ARGS's target at B 2, S 8."""
    mod = example("nanogpt_block")
    return _measured_peak(mod.small, {"x": ("float32", ["B", "S", 64])}, {"B": 2, "S": 8})


def test_cli_budget_json_and_fit_exit_codes(capsys):
    assert main(["analyze", *ARGS, "--memory", "1GiB", "--json", "--train"]) == 0
    doc = json.loads(capsys.readouterr().out)
    b = doc["budget"]
    assert set(b) >= {"gpu", "capacity", "total", "overhead", "fits", "headroom", "max_batch",
                      "max_seq"}
    assert b["gpu"] is None and b["capacity"] == 2 ** 30 and b["fits"] is True
    assert b["total"] == _example_peak()  # CPU: no overhead terms, the real run's peak
    assert main(["fit", *ARGS, "--memory", "512KiB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["fit", *ARGS, "--memory", "1GiB"]) == 0
    assert main(["fit", *ARGS]) == 2  # nothing to check against
    assert main(["fit", *ARGS, "--gpu", "nosuchgpu"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert main(["gpus"]) == 0
    assert "143,771" in capsys.readouterr().out


def test_conv_batch_past_the_backend_guard():
    """PyTorch picks a convolution backend by batch size (a guard B < 16 under the fake
    kernel); that is a code path, not the model's limit: traced on both sides, the formulas
    are the same, so the range reaches past it and the largest batch is solved beyond 15
    (it was capped at 15). Checked against real runs at the answer and the next size."""
    img = {"x": ("float32", ["B", 3, 16, 16])}
    report = predict(zoo.CNN, img, inference=False)
    assert report.ranges["B"] == (2, None) and report.checked == {"B": (5, 17)}
    cap = _measured_peak(zoo.CNN, img, {"B": 40}) - 1
    b = against(report, {"B": 4}, capacity=cap, margin=0.0)
    assert b.max_batch == 39
    assert _measured_peak(zoo.CNN, img, {"B": 39}) <= cap < _measured_peak(zoo.CNN, img,
                                                                            {"B": 40})

"""Bad input gets a typed error that names the culprit, with a hint."""

import pytest
import torch
import torch.nn as nn

from memsim.analysis import analyze
from memsim.cli import main
from memsim.tracer import (DataDependentError, InputError, OutOfRangeError, TraceError,
                           UnsupportedOpError, UsageError, parse_assignments, parse_input)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        scale = float(h.abs().max())  # a number read from the values: only a given one answers
        return h * scale


class Inner(nn.Module):
    def forward(self, x):
        # as many elements as the repeats add up to: no bound (a mask's count has one:
        # tests/test_data_dependent.py)
        return torch.repeat_interleave(x.abs().long().flatten())


class Repeats(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x).float().sum() + x.sum()


@torch.library.custom_op("memsim_test::nofake", mutates_args=())
def nofake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class CustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return nofake(self.lin(x)).sum()


def test_data_dependent_branch_names_module_and_line():
    with pytest.raises(DataDependentError) as e:
        analyze(DataDependent(), {"x": ("float32", ["B", 4])}, device="cpu")
    assert e.value.module == ""
    assert e.value.source and "test_errors.py" in e.value.source
    assert "test_errors.py:" in str(e.value)  # the message names the line too
    # the hint says how to give the value, at that line
    line = e.value.source.rsplit(":", 1)[1]
    assert f"--assume test_errors.py:{line}=VALUE" in e.value.hint, e.value.hint
    # given, the analysis answers
    r = analyze(DataDependent(), {"x": ("float32", ["B", 4])}, device="cpu",
                assume={f"test_errors.py:{line}": 2.0})
    assert r.train is not None


def test_data_dependent_size_names_submodule():
    with pytest.raises(DataDependentError) as e:
        analyze(Repeats(), {"x": ("float32", ["B", 4])}, device="cpu", train=False)
    assert e.value.module == "inner"
    assert "repeat_interleave" in str(e.value)


def test_op_without_fake_kernel_is_reported():
    with pytest.raises(UnsupportedOpError) as e:
        analyze(CustomOp(), {"x": ("float32", ["B", 4])}, device="cpu")
    assert "memsim_test.nofake" in str(e.value) or "memsim_test::nofake" in str(e.value)
    assert "register_fake" in e.value.hint


def test_misspelled_input_lists_forward_parameters():
    with pytest.raises(InputError) as e:
        analyze(nn.Linear(4, 4), {"inputs": ("float32", ["B", 4])}, device="cpu")
    assert "'input'" in str(e.value) and "forward takes: input" in str(e.value)


def test_missing_input():
    class Two(nn.Module):
        def forward(self, a, b):
            return a + b
    with pytest.raises(InputError, match="needs 'b'"):
        analyze(Two(), {"a": ("float32", ["B"])}, device="cpu")


@pytest.mark.parametrize("bad", ["x", "x=float32", "x=float32[B", "=float32[B]",
                                 "x=nosuchtype[B]", "x=float32[B-1]"])
def test_malformed_input(bad):
    with pytest.raises(UsageError):
        parse_input(bad)


@pytest.mark.parametrize("bad", ["B", "B=", "B=x", "=4", "B=4;S=2", ""])
def test_malformed_at(bad):
    with pytest.raises(UsageError):
        parse_assignments(bad)


def test_out_of_range_point_says_so():
    r = analyze(nn.Linear(4, 4), {"input": ("float32", ["B", 4])}, device="cpu",
                limits={"B": 8})
    with pytest.raises(OutOfRangeError, match="B=9"):
        r.at(B=9)
    with pytest.raises(OutOfRangeError, match="B=0"):
        r.at(B=0)
    with pytest.raises(OutOfRangeError, match="B=1"):
        r.at(B=1)  # below the formula's range: at() names for_point, which traces it...
    sub, pt = r.for_point({"B": 1})
    assert sub.fixed == {"B": 1}  # ...with B fixed to 1, and its figures are a real run's
    from tests.support.predict import check
    check(r, lambda: nn.Linear(4, 4), {"input": ("float32", ["B", 4])}, [{"B": 1}])
    with pytest.raises(InputError, match="lacks B"):
        r.at(S=3)


def test_cli_usage_errors_exit_2(capsys):
    assert main(["analyze", "nosuchfile.py:model", "--input", "x=float32[B,4]"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["analyze", "torch.nn:Linear", "--input", "x=float32[B"]) == 2
    assert "malformed --input" in capsys.readouterr().err
    assert main(["analyze", "tests.support.zoo:MLP", "--input", "x=float32[B,16]",
                 "--at", "B"]) == 2
    assert "malformed --at" in capsys.readouterr().err
    assert main(["analyze", "tests.support.zoo:MLP", "--input", "x=float32[B,16]",
                 "--optimizer", "Adamm"]) == 2
    assert "unknown optimizer 'Adamm'" in capsys.readouterr().err


def test_a_model_file_that_raises_names_its_line(tmp_path, capsys):
    """The user's file raising as it loads is an error naming the file, its line and the
    exception, with the command that shows the whole traceback: not memsim's traceback."""
    f = tmp_path / "model.py"
    f.write_text("import torch\n\n\ndef width():\n    raise ValueError('no width')\n\n\n"
                 "model = torch.nn.Linear(width(), 4)\n")
    assert main(["analyze", f"{f}:model", "--input", "x=float32[B,4]"]) == 2
    err = capsys.readouterr().err
    assert f"{f}, line 5 raised while loading: ValueError: no width" in err, err
    assert f"python {f}" in err and "Traceback" not in err


def test_an_unknown_option_value_is_one_line_and_a_hint(capsys):
    """argparse's own errors print the whole usage first (25 lines for ``analyze``): here the
    error and a hint only."""
    with pytest.raises(SystemExit) as e:
        main(["analyze", "tests.support.zoo:MLP", "--input", "x=float32[B,16]",
              "--device", "tpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert "invalid choice: 'tpu'" in err[0] and "--help" in err[1]


class _Swallows(nn.Module):
    """A forward that takes anything through ``**kwargs`` and must not run here."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, labels=None, **kwargs):
        raise AssertionError("traced: the misspelled input was not caught first")


def test_a_misspelled_input_is_caught_before_the_trace():
    with pytest.raises(InputError, match="did you mean 'labels'"):
        analyze(_Swallows(), {"x": ("float32", ["B", 4]), "lables": ("int64", ["B"])},
                device="cpu")


class Positioned(nn.Module):
    """A model with 16 positions (a Hugging Face config's ``max_position_embeddings``) whose
    forward must not run here."""

    def __init__(self):
        super().__init__()
        import types
        self.config = types.SimpleNamespace(max_position_embeddings=16)
        self.emb = nn.Embedding(10, 4)

    def forward(self, input_ids):
        raise AssertionError("traced: the size past the model's positions was not caught first")


def test_a_size_past_the_models_positions_is_refused_before_the_trace(capsys):
    assert main(["analyze", "tests.test_errors:Positioned", "--input", "input_ids=int64[B,S]",
                 "--at", "B=2,S=32", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "S=32 is outside the range" in err and "does not accept S > 16" in err


def test_input_fill_parses_and_unknown_fill_is_named():
    from memsim.tracer import parse_input
    assert parse_input("attention_mask=int64[B,S]:ones").fill == "ones"
    assert parse_input("attention_mask=int64[B,S]").fill is None
    with pytest.raises(UsageError, match="unknown fill 'twos'"):
        parse_input("attention_mask=int64[B,S]:twos")


@pytest.mark.parametrize("at, msg", [("B=2,T=8", "names T, which no --input uses"),
                                     ("B=0,S=8", "sizes start at 1"),
                                     ("B=-1,S=8", "--at B=-1: sizes start at 1"),
                                     ("B=2", "lacks S")])
def test_cli_at_is_checked_against_the_inputs_before_the_trace(at, msg, capsys):
    import os
    target = os.path.join(os.path.dirname(__file__), "..", "examples", "nanogpt_block.py") + \
        ":Block"
    assert main(["analyze", target, "--input", "x=float32[B,S,768]", "--at", at]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("pt", [{"B": 3, "S": 8}, {"B": 2, "S": 17}])
def test_cli_pinned_symbols_are_traced_at_the_point(pt, capsys):
    """A loop over the time steps pins S: with --at the size asked for is traced (exact there,
    equal to a real run) and the notes say S is fitted elsewhere and name the module and line
    that pin it."""
    import json
    import os
    from tests.support import zoo
    from tests.support.oracles.measure import example_inputs, materialize, measure_train

    target = os.path.join(os.path.dirname(__file__), "support", "zoo.py") + ":Scan"
    at = ",".join(f"{k}={v}" for k, v in pt.items())
    args = ["analyze", target, "--input", "x=float32[B,S,8]", "--device", "cpu", "--train"]
    assert main(args + ["--at", at, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    real = measure_train(materialize(zoo.Scan()), example_inputs(
        {"x": ("float32", ["B", "S", 8])}, pt))
    assert doc["fixed"] == {"S": pt["S"]}
    for k in ("peak", "activation_peak", "saved_activations"):
        assert doc["train"][k]["bytes"] == getattr(real, k), k
    assert any("S is pinned by the model's code (module '<root>'" in n and "zoo.py" in n
               for n in doc["notes"])
    assert doc["fitted"]["symbol"] == "S"


def test_pinned_symbol_without_a_fit_names_the_module(capsys):
    """With fitting off (Python ``fit=False``), a pinned symbol is a SpecializationError whose
    hint speaks CLI and names the module."""
    from tests.support import zoo
    from memsim.tracer import SpecializationError
    with pytest.raises(SpecializationError) as e:
        analyze(zoo.GRULM(), {"x": ("int64", ["B", "S"])}, device="cpu", fit=False)
    msg = str(e.value)
    assert "ties symbol" in msg and "module 'rnn'" in msg and "--hint" in msg


class LongKernel(nn.Module):
    """A 1-D convolution over raw samples, 10 long: longer than the example size S = 7."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, kernel_size=10, stride=5)

    def forward(self, x):  # (B, S)
        return self.conv(x.unsqueeze(1)).relu().mean()


def test_a_model_that_fails_at_the_example_sizes_is_traced_at_larger_ones():
    """The model's own failure at the small example sizes (B=5, S=7) is traced again with S
    larger: a multiple of the kernel's length of 10, which PyTorch's error names (S = 20); the
    formulas equal a real run down to the kernel's length."""
    from tests.support.predict import check
    inputs = {"x": ("float32", ["B", "S"])}
    with torch.device("meta"):
        report = analyze(LongKernel(), inputs, device="cpu")
    assert report.train.trace.hints == {"B": 5, "S": 20}
    assert report.ranges["S"][0] == 10
    check(report, LongKernel, inputs, [{"B": 2, "S": 10}, {"B": 3, "S": 37}])


def test_a_model_that_fails_at_every_size_names_the_sizes_and_the_hint():
    """Sizes given for every symbol: not retried; the error names the sizes and the option."""
    with torch.device("meta"):
        m = LongKernel()
    with pytest.raises(TraceError, match=r"at the example sizes B=3, S=8") as e:
        analyze(m, {"x": ("float32", ["B", "S"])}, device="cpu", hints={"B": 3, "S": 8})
    assert "--hint S=N" in str(e.value) and e.value.sizes == {"B": 3, "S": 8}
    assert "tried the larger" not in str(e.value)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"),
                    reason="Linux grows the main thread's stack to the soft limit of the time")
@pytest.mark.heavy
def test_a_long_python_loops_graph_is_freed_without_overflowing_the_stack():
    """A Python loop over S time steps chains S autograd nodes; under the symbolic run the
    step's output frees that chain recursively in C. At S = 16,384 that overflowed Linux's
    default 8 MiB stack (a segmentation fault, from the CLI's S sweep on zoo.Scan) where a real
    eager run frees the same graph. memsim raises the stack's soft limit within the hard one:
    here a child started with a 512 KiB soft limit (too small for S = 1024 without it)
    finishes its trace."""
    import os
    import resource
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import torch\n"
            "from tests.support import zoo\n"
            "from memsim.analysis import analyze\n"
            "with torch.device('meta'):\n"
            "    m = zoo.Scan()\n"
            "r = analyze(m, {'x': ('float32', [2, 1024, 8])}, device='cpu', inference=False,\n"
            "            fit=False)\n"
            "print('peak', r.train.peak)\n")

    def small_stack():
        resource.setrlimit(resource.RLIMIT_STACK,
                           (512 * 1024, resource.getrlimit(resource.RLIMIT_STACK)[1]))

    # the repository after what is on the path already (a staged copy of memsim stays first)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), root) if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, preexec_fn=small_stack, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("peak ")


class Warns(nn.Module):
    """A model whose forward warns (as FSDP2 warns of a returned view, once per trace)."""

    def __init__(self, text: str):
        super().__init__()
        self.lin, self.text = nn.Linear(4, 4), text

    def forward(self, x):
        import warnings
        warnings.warn(self.text, UserWarning)
        return self.lin(x)


def test_a_models_warning_is_shown_once_however_many_traces_make_it():
    """Every trace records the model's warnings and shows them again; an analysis traces
    several times (training and inference here; a strategy's rank groups and crossed guards
    13 times for a 70B model, which showed one warning 15 times). Each is shown once."""
    import uuid
    import warnings

    text = f"memsim test warning {uuid.uuid4()}"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        analyze(Warns(text), {"x": ("float32", ["B", 4])}, device="cpu")
        analyze(Warns(text), {"x": ("float32", ["B", 4])}, device="cpu")
    assert [str(w.message) for w in seen].count(text) == 1

"""Optimizers outside the core set, each predicted by name and compared with a real run of the
library users run: torch.optim's classes, bitsandbytes' 8-bit optimizers (their CPU path runs
here) and lucidrains' ``lion-pytorch`` (the Lion reference implementation), none of them
memsim's code."""

import pytest
import torch

from memsim.analysis import analyze
from memsim.tracer.optimizers import Lion, lookup, register_optimizer

from tests.support import zoo
from tests.support.predict import check, grid, predict

SEQ = {"x": ("float32", ["B", "S", 32])}


def _real(name):
    """The real optimizer behind ``name``, built from its library (not from memsim's registry)."""
    if name == "adafactor":
        return lambda ps: torch.optim.Adafactor(ps)
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=1e-3)
    if name == "sgd-momentum":
        return lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)
    if name == "lion":
        lion_pytorch = pytest.importorskip("lion_pytorch", reason="pip install -e '.[test]'")
        return lambda ps: lion_pytorch.Lion(ps)
    bnb = pytest.importorskip("bitsandbytes", reason="pip install -e '.[test]'")
    cls = {"adamw8bit": "AdamW8bit", "adam8bit": "Adam8bit", "lion8bit": "Lion8bit"}[name]
    return lambda ps: getattr(bnb.optim, cls)(ps)


@pytest.mark.parametrize("name", ["adafactor", "lion", "sgd", "sgd-momentum", "adamw8bit",
                                  "adam8bit", "lion8bit"])
def test_named_optimizers_match_real_run(name):
    """Peak, parameters, gradients and optimizer states equal a real step of the library's
    optimizer (B = 2, 3; S = 5, 16). memsim traces the torch.optim classes and its Lion (the
    reference update); the 8-bit ones are a state layout whose step allocates nothing, as
    bitsandbytes' CUDA kernel. Its CPU kernel (bnb 0.50) does allocate fp32 copies of the
    states inside the op ``bitsandbytes::optimizer_update_8bit_blockwise``; the oracle counts
    the storages ops return, so it sees the op as the CUDA kernel runs it (nothing returned)
    and those internal temporaries are not part of the comparison. lion-pytorch's Lion showed a
    memsim bug: memsim's Lion kept each parameter's update alive into the next parameter's
    step (512 B high at S = 5, where the step is the peak); it now frees it as the reference
    does."""
    real = _real(name)
    report = predict(zoo.Block, SEQ, optimizer=name, inference=False)
    check(report, zoo.Block, SEQ, grid(B=(2, 3), S=(5, 16)), optimizer=real)


@pytest.mark.parametrize("name,real", [
    ("Adam(amsgrad=True)", lambda ps: torch.optim.Adam(ps, amsgrad=True)),
    ("AdamW(foreach=True, weight_decay=0.1)",
     lambda ps: torch.optim.AdamW(ps, foreach=True, weight_decay=0.1))])
def test_torch_optimizer_with_keyword_arguments_matches_real_run(name, real):
    """A torch.optim class with its options in the name: amsgrad keeps a third state, and
    foreach (not the CPU's default) changes the step's temporaries; both equal a real step
    built with the same options."""
    report = predict(zoo.Block, SEQ, optimizer=name, inference=False)
    default = predict(zoo.Block, SEQ, optimizer=name.split("(")[0], inference=False)
    at = {"B": 2, "S": 5}   # the optimizer step's peak
    assert report.at(**at)["train"] != default.at(**at)["train"]
    check(report, zoo.Block, SEQ, grid(B=(2, 3), S=(5, 16)), optimizer=real)


@pytest.mark.parametrize("name,match", [
    ("AdamW(forech=False)", r"takes no argument 'forech' \(did you mean 'foreach'"),
    ("AdamW(False)", "by keyword"),
    ("AdamW(foreach=x)", "'foreach' is not a Python literal"),
    ("AdamW(foreach=True, fused=True)", "refuses these options"),
    ("lion(lr=1)", "memsim's own entry"),
    ("AdamX(lr=1)", "did you mean 'adamax'"),
    ("AdamW(", "not a class name with keyword arguments")])
def test_optimizer_options_that_cannot_work_are_usage_errors(name, match):
    from memsim.tracer import UsageError
    with pytest.raises(UsageError, match=match):
        lookup(name)


def test_adafactor_factors_second_moments():
    """torch.optim.Adafactor keeps row and column factors for a matrix, far less than Adam's two
    moments: memsim's state bytes equal the sizes derived below and a real Adafactor step's."""
    with torch.device("meta"):
        m = torch.nn.Linear(512, 512, bias=False)
    ada = analyze(m, {"input": ("float32", ["B", 512])}, optimizer="adafactor", device="cpu",
                  inference=False).train.optimizer_states
    adam = analyze(m, {"input": ("float32", ["B", 512])}, optimizer="adamw", device="cpu",
                   inference=False).train.optimizer_states
    assert adam == 2 * 512 * 512 * 4 + 4  # exp_avg, exp_avg_sq (512 x 512 fp32), step
    # row_var (512, 1) and col_var (1, 512) fp32, and the fp32 step: 2 x 512 x 4 + 4
    assert ada == 2 * 512 * 4 + 4 == 4_100
    real = torch.nn.Linear(512, 512, bias=False)
    opt = torch.optim.Adafactor(real.parameters())
    real.weight.grad = torch.randn_like(real.weight)
    opt.step()
    assert sum(v.untyped_storage().nbytes() for v in opt.state[real.weight].values()) == ada


@pytest.mark.parametrize("name,cls", [("adamw8bit", "AdamW8bit"), ("adam8bit", "Adam8bit"),
                                      ("lion8bit", "Lion8bit")])
def test_8bit_layout_equals_bitsandbytes(name, cls):
    """memsim's 8-bit state layout creates the state storages a real bitsandbytes step creates
    (parameters above and below its 4,096-element threshold, a size not a multiple of its
    256-element block): the same sizes."""
    bnb = pytest.importorskip("bitsandbytes")
    sizes = [5000, 70000, 4095, 300]
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = getattr(bnb.optim, cls)(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    real = {id(v.untyped_storage()): v.untyped_storage().nbytes()
            for st in opt.state.values() for v in st.values() if torch.is_tensor(v)}
    ours = lookup(name).factory([torch.nn.Parameter(torch.randn(n)) for n in sizes])
    for g in ours.param_groups:
        for p in g["params"]:
            p.grad = torch.randn_like(p)
    ours.step()
    mine = {id(v.untyped_storage()): v.untyped_storage().nbytes()
            for st in ours.state.values() for v in st.values() if torch.is_tensor(v)}
    assert sum(mine.values()) == sum(real.values())
    assert sorted(mine.values()) == sorted(real.values())


def test_paged_states_are_on_the_host_on_cuda():
    """bitsandbytes pages a moment buffer only for a parameter of at least 1e5 elements
    (``Optimizer8bit.get_state_buffer``); the absmax blocks, the quantization maps and smaller
    parameters' moments are ordinary device tensors (``Optimizer2State.init_state``)."""
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 1024))
    inp = {"input": ("float32", ["B", 128])}
    paged = analyze(m, inp, optimizer="paged_adamw8bit", inference=False)
    plain = analyze(m, inp, optimizer="adamw8bit", inference=False)
    # on CUDA, each tensor in 512-byte blocks:
    # 0.weight, 16,384 elements: 2 uint8 moments 2 * 16,384; 2 absmax of 64 floats (256 -> 512)
    # 0.bias, 128 (< 4,096): 2 float32 moments of 512
    # 1.weight, 131,072: 2 uint8 moments 2 * 131,072; 2 absmax of 512 floats, 2 * 2,048
    # 1.bias, 1,024: 2 float32 moments of 4,096
    # the shared signed and unsigned maps, 256 floats each: 2 * 1,024
    small = 2 * 16_384 + 2 * 512 + 2 * 512 + 2 * 2_048 + 2 * 4_096 + 2 * 1_024
    assert plain.train.optimizer_states == small + 2 * 131_072 == 311_296
    assert paged.train.optimizer_states == small == 49_152  # 1.weight's moments are paged
    host = [s for s in paged.train.trace.run.storages if s.device == "host"]
    assert sorted(int(s.nbytes) for s in host) == [131_072, 131_072]


def test_register_a_state_rule_in_a_few_lines():
    register_optimizer("test-two-moments", state=lambda p: {"m": (p.shape, p.dtype),
                                                            "v": (p.shape, p.dtype)})
    with torch.device("meta"):
        m = torch.nn.Linear(64, 64, bias=False)
    r = analyze(m, {"input": ("float32", ["B", 64])}, optimizer="test-two-moments",
                device="cpu", inference=False)
    assert r.train.optimizer_states == 2 * 64 * 64 * 4


def test_lion_keeps_one_moment():
    """memsim's Lion keeps the state the reference implementation keeps: one ``exp_avg`` per
    parameter, its size and dtype, and the same step (lion-pytorch, run on the same values)."""
    lion_pytorch = pytest.importorskip("lion_pytorch", reason="pip install -e '.[test]'")
    ps = [torch.nn.Parameter(torch.randn(10)) for _ in range(2)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours, ref = Lion(ps, weight_decay=0.1), lion_pytorch.Lion(qs, weight_decay=0.1)
    for _ in range(2):
        g = [torch.randn(10) for _ in ps]
        for p, q, gi in zip(ps, qs, g):
            p.grad, q.grad = gi, gi.clone()
        ours.step()
        ref.step()
    for p, q in zip(ps, qs):
        assert list(ours.state[p]) == list(ref.state[q]) == ["exp_avg"]
        a, b = ours.state[p]["exp_avg"], ref.state[q]["exp_avg"]
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(a, b)
        assert torch.equal(p, q)

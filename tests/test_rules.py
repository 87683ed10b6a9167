"""The one registry of per-op decisions (memsim.tracer.rules) and the other registries: one way
to register, duplicates rejected, and every registered entry reached by a test."""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from memsim.analysis.gpus import GPU, register_gpu
from memsim.strategies import FSDP, TensorParallel, analyze, register_strategy
from memsim.strategies.ddp import DDP
from memsim.tracer import MemsimError, StrategyError, UsageError
from memsim.tracer.optimizers import register_optimizer
from memsim.tracer.rules import Kind, hits, register, registered

from tests.support import zoo
from tests.support.oracles import dist as O


def test_duplicates_are_rejected_everywhere():
    aten = next(r for r in registered(Kind.ATEN))
    with pytest.raises(MemsimError, match="already registered"):
        register(Kind.ATEN, aten.key, aten.value, device=aten.device)
    with pytest.raises(MemsimError, match="already registered"):
        register(Kind.AUTOCAST, F.layer_norm, "fp32", device="cuda")
    with pytest.raises(UsageError, match="already registered"):
        register_optimizer("lion", factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(UsageError, match="already registered"):
        register_optimizer("AdamW", factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(MemsimError, match="in the catalog already"):
        register_gpu("h100", "my H100", 1000, "hopper")
    with pytest.raises(StrategyError, match="already registered"):
        register_strategy(type("Again", (DDP,), {}))


def test_malformed_entries_are_rejected():
    with pytest.raises(MemsimError, match="OpOverload"):
        register(Kind.ATEN, "aten.mm", lambda *a: None)
    with pytest.raises(MemsimError, match="not one of"):
        register(Kind.AUTOCAST, torch.tanh, "fp64", device="cuda")
    with pytest.raises(MemsimError, match="device"):
        register(Kind.FUNCTION, torch.tanh, lambda *a: None, device="tpu")


class _LSTM(nn.Module):
    def __init__(self, kind=nn.LSTM):
        super().__init__()
        self.rnn = kind(8, 16, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


class _Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(F.pad(x, (0, 0, 1, 1)))


class _Scatter(nn.Module):
    """Features scattered at the first two positions of every sequence (image tokens)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # (B, S, 8)
        mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        mask[:, :2] = True
        return x.masked_scatter(mask.unsqueeze(-1), self.lin(x[:, :2])).sum()


class _Solve(nn.Module):
    """A unit lower-triangular system per position, solved for the projected input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # (B, S, 8)
        h = self.lin(x)
        a = (h.unsqueeze(-1) * h.unsqueeze(-2)).tril(-1)
        return torch.linalg.solve_triangular(a, h.unsqueeze(-1), upper=False,
                                             unitriangular=True).sum()


class _Alibi(nn.Module):
    """Scores plus a bias broadcast from (B, 1, S), as BLOOM adds its ALiBi (baddbmm)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x):  # (B, S, 8)
        q = self.q(x)
        return torch.baddbmm(x[..., :1].transpose(1, 2), q, q.transpose(1, 2), alpha=0.5)


class _Polar(nn.Module):
    """Rotary frequencies made with torch.polar, as DeepSeek-V2 makes them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # (B, S, 8)
        with torch.no_grad():
            f = torch.polar(torch.ones_like(x), x)
        return self.lin(x) * torch.view_as_real(f)[..., 0]


class _LearnedMask(nn.Module):
    """SDPA with an additive mask made from the input (Doge's dynamic mask): its gradient is
    the memory-efficient backward's fourth output on CUDA."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.qkv, self.mask, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, 1), heads

    def forward(self, x):  # (B, S, d)
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        mask = self.mask(x).transpose(1, 2).unsqueeze(1)   # (B, 1, 1, S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def test_efficient_backward_rule_makes_the_meta_kernels_tensors():
    """The rule's gradients have the shapes, strides and storage sizes of torch's own meta
    kernel for the op (which fails under fake tensors only), the mask's padded to 16."""
    from torch._meta_registrations import meta__scaled_dot_product_efficient_backward as meta

    from memsim.tracer.cuda import _efficient_backward
    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    for s in (7, 16, 33):
        q, k, v = (torch.empty(2, 4, s, 8, device="meta") for _ in range(3))
        bias = torch.empty(2, 4, s, s, device="meta")
        args = (q, q, k, v, bias, q, torch.empty(2, 4, 32, device="meta"),
                torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long), 0.0,
                [True, True, True, True])
        for mine, theirs in zip(_efficient_backward(None, op, args, {}), meta(*args)):
            assert (mine.shape, mine.stride(), mine.untyped_storage().nbytes()) == \
                (theirs.shape, theirs.stride(), theirs.untyped_storage().nbytes())


def test_pad_and_triangular_solve_rules_make_the_kernels_tensors():
    """On real CPU tensors, the rules' outputs have the shapes, strides and storage sizes of
    ATen's own kernels: F.pad without a positive pad clones the (narrowed) input with its
    strides; masked_scatter's is a contiguous clone of a transposed input; solve_triangular's
    result is column-major in its last two dimensions."""
    from memsim.tracer.kernels import _constant_pad, _solve_triangular
    pad_op = torch.ops.aten.constant_pad_nd.default
    # not contiguous; channels-last-like, whose padded output ATen makes channels-last (a
    # Mamba-2 scan pads its (B, S, heads, dim) input transposed: a contiguous output made
    # later reshapes copy where the CPU views, B x chunk x heads x dim x 4 bytes per layer)
    for x in (torch.randn(2, 5, 3, 4).transpose(1, 2),
              torch.randn(2, 8, 16, 9).permute(0, 3, 1, 2),
              torch.randn(2, 3, 4, 5, 6).permute(0, 4, 1, 2, 3)):
        for pad in ([0, 0, 0, 0], [0, 0, -1, 0], [-1, -1, 0, -2], [0, 0, 0, 3], [1, 0, -1, 2]):
            mine, theirs = _constant_pad(None, pad_op, (x, pad), {}), pad_op(x, pad)
            assert (mine.shape, mine.stride(), mine.untyped_storage().nbytes()) == \
                (theirs.shape, theirs.stride(), theirs.untyped_storage().nbytes()), (x.shape, pad)
    from memsim.tracer.kernels import _masked_scatter
    scatter = torch.ops.aten.masked_scatter.default
    x, mask = torch.randn(3, 5, 4).transpose(0, 1), torch.zeros(5, 3, 1, dtype=torch.bool)
    mask[:2] = True
    mine, theirs = (_masked_scatter(None, scatter, (x, mask, torch.randn(24)), {}),
                    scatter(x, mask, torch.randn(24)))
    assert (mine.shape, mine.stride(), mine.untyped_storage().nbytes()) == \
        (theirs.shape, theirs.stride(), theirs.untyped_storage().nbytes())
    tri = torch.ops.aten.linalg_solve_triangular.default
    a = torch.randn(2, 3, 4, 4).tril() + 4 * torch.eye(4)
    for b, kw in ((torch.randn(2, 3, 4, 5), dict(upper=False)),
                  (torch.randn(3, 4, 5), dict(upper=False, unitriangular=True)),
                  (torch.randn(2, 3, 5, 4), dict(upper=False, left=False))):
        mine, theirs = _solve_triangular(None, tri, (a, b), kw), tri(a, b, **kw)
        assert (mine.shape, mine.stride(), mine.untyped_storage().nbytes()) == \
            (theirs.shape, theirs.stride(), theirs.untyped_storage().nbytes()), kw


def test_norm_and_loss_rules_make_the_cpu_kernels_tensors():
    """On real CPU tensors, the rules' outputs have the shapes, strides and storage sizes of
    ATen's own CPU kernels: batch and group norm lay out the input's gradient (and batch
    norm its output) in the input's suggested format, layer norm's and log-softmax's
    backward make it contiguous, batch norm's backward leaves out what its mask does, and a
    reduced mse / smooth-L1 / BCE / soft-margin loss is a scalar over the elementwise
    storage."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    from memsim.tracer import kernels as K
    cpu, A = SimpleNamespace(device="cpu"), torch.ops.aten

    def same(rule, op, args):
        """The rule over the fake kernel, against the real kernel."""
        theirs = op(*args)
        with FakeTensorMode() as mode:
            mine = rule(cpu, op, tree_map(
                lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, args), {})
        for a, b in zip(mine if isinstance(mine, tuple) else (mine,),
                        theirs if isinstance(theirs, tuple) else (theirs,)):
            assert (a is None) == (b is None)
            if a is not None:
                assert (a.shape, a.stride(), a.untyped_storage().nbytes()) == \
                    (b.shape, b.stride(), b.untyped_storage().nbytes())
    xt = torch.randn(3, 4, 8).transpose(1, 2)             # (3, 8, 4), transposed
    w, b, rm, rv = torch.ones(8), torch.zeros(8), torch.zeros(8), torch.ones(8)
    same(K._batch_norm, A.native_batch_norm.default, (xt, w, b, rm, rv, True, 0.1, 1e-5))
    for mask in ([True, True, True], [False, True, True]):
        same(K._batch_norm_backward, A.native_batch_norm_backward.default,
             (xt.clone(), xt, w, rm, rv, torch.zeros(8), torch.ones(8), True, 1e-5, mask))
    x4, g4 = torch.randn(2, 8, 4, 4), torch.randn(2, 4, 4, 8).permute(0, 3, 1, 2)
    same(K._group_norm_backward, A.native_group_norm_backward.default,
         (g4, x4, torch.zeros(2, 2), torch.ones(2, 2), w, 2, 8, 16, 2, [True, True, True]))
    x, gt = torch.randn(3, 8, 4), torch.randn(3, 4, 8).transpose(1, 2)
    same(K._contiguous_first, A.native_layer_norm_backward.default,
         (gt, x, [4], torch.zeros(3, 8, 1), torch.ones(3, 8, 1), torch.ones(4), torch.zeros(4),
          [True, True, True]))
    same(K._contiguous_first, A._log_softmax_backward_data.default,
         (gt, xt.log_softmax(-1), -1, torch.float32))
    p, y = torch.randn(7, 5).t(), torch.randn(5, 7)
    for red in (1, 2):
        same(K._reduced_loss, A.mse_loss.default, (p, y, red))
        same(K._reduced_loss, A.smooth_l1_loss.default, (p, y, red, 1.0))
        same(K._reduced_loss, A.binary_cross_entropy.default, (p.sigmoid(), y.sigmoid(), None, red))
        same(K._reduced_loss, A.soft_margin_loss.default, (p, y, red))
    one = torch.tensor(1.0)
    same(K._contiguous_first, A.mse_loss_backward.default, (one, p, y, 1))
    same(K._contiguous_first, A.smooth_l1_loss_backward.default, (one, p, y, 1, 1.0))
    same(K._contiguous_first, A.huber_loss_backward.default, (one, p, y, 1, 1.0))


def _reached(run) -> set:
    before = hits()
    run()
    after = hits()
    return {k for k, v in after.items() if v > before.get(k, 0)}


def _traces():
    """Small programs that take every code path a rule stands for."""
    SEQ = {"x": ("float32", ["B", "S", 32])}
    meta = functools.partial(torch.device, "meta")
    with meta():
        drop = zoo.Block(sdpa=True, dropout=0.1)
        cnn, full, pad, lstm, gru = zoo.CNN(), zoo.FullSlices(), _Padded(), _LSTM(), \
            _LSTM(nn.GRU)
        llama = O.llama_model()
    # CUDA kernel choices (SDPA, dropout), CUDA LayerNorm statistics, autocast policy
    analyze(drop, SEQ, device="cuda", precision="bf16-mixed", inference=False)
    # BatchNorm statistics under autocast; whole-dimension slices; F.pad; optimizer .item()
    analyze(cnn, {"x": ("float32", ["B", 3, 8, 8])}, device="cpu", precision="bf16-mixed",
            inference=False)
    analyze(full, {"x": ("float32", ["B", "S", 24])}, device="cpu", inference=False)
    # norms' layouts on the CPU, BatchNorm's output mask, the losses' scalar storages
    with meta():
        layouts = zoo.Layouts()
    analyze(layouts, {"x": ("float32", ["B", "S", 8])}, device="cpu", inference=False)
    analyze(pad, {"x": ("float32", ["B", "S", 8])}, device="cpu", inference=False)
    # baddbmm with an input broadcast into its output (BLOOM's ALiBi)
    with meta():
        alibi = _Alibi()
    analyze(alibi, {"x": ("float32", ["B", "S", 8])}, device="cpu", inference=False)
    # memory-efficient attention's backward with a mask that requires grad, on CUDA
    with meta():
        learned = _LearnedMask()
    analyze(learned, SEQ, device="cuda", precision="bf16-mixed", inference=False)
    # torch.polar (DeepSeek-V2's rotary frequencies)
    with meta():
        polar = _Polar()
    analyze(polar, {"x": ("float32", ["B", "S", 8])}, device="cpu", inference=False)
    # masked_scatter and its backward's masked_select (a vision-language model's image tokens)
    with meta():
        scatter = _Scatter()
    analyze(scatter, {"x": ("float32", ["B", "S", 8])}, device="cpu", inference=False)
    # linalg.solve_triangular (Qwen3-Next's gated delta rule)
    with meta():
        solve = _Solve()
    analyze(solve, {"x": ("float32", ["B", "S", 8])}, device="cpu", inference=False)
    # nn.LSTM on CPU (oneDNN), issued from Python: its workspace and bias gradients
    analyze(lstm, {"x": ("float32", ["B", "S", 8])}, device="cpu", inference=False)
    # nn.GRU on CPU, its C++ loop issued from Python (S fixed: the loop pins it)
    analyze(gru, {"x": ("float32", ["B", 4, 8])}, device="cpu", inference=False)
    # nn.LSTM and nn.GRU on CUDA: cuDNN's tensors, its reserve estimated
    analyze(lstm, {"x": ("float32", ["B", "S", 8])}, device="cuda", inference=False)
    analyze(gru, {"x": ("float32", ["B", "S", 8])}, device="cuda", inference=False)
    # F.interpolate by scale, and the resize kernels whose meta kernels need concrete sizes
    for mode, dims in (("nearest", 1), ("nearest", 3), ("nearest-exact", 1), ("nearest-exact", 3),
                       ("linear", 1), ("bilinear", 2), ("bicubic", 2), ("trilinear", 3)):
        with meta():
            resize = zoo.Resize(mode, dims)
        analyze(resize, {"x": ("float32", ["B", 4] + ["H"] * dims)}, device="cpu",
                inference=False)
    # MoE experts through torch._grouped_mm in fp32 (its meta kernel takes bf16 only)
    with meta():
        experts = zoo.GroupedExperts(out=40)
    analyze(experts, {"x": ("float32", ["B", 3, 32])}, device="cpu", inference=False)
    # DTensor pads uneven shards inside its dispatch (aten.pad: sequence parallelism at an odd
    # example S), collectives' waits
    analyze(llama, {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])},
            device="cpu", tp=TensorParallel(2, sequence_parallel=True), inference=False)
    # sizes that depend on tensor values: boolean indexing, nonzero, masked_select, x[mask] = v,
    # unique in its forms, CTC loss with tensor lengths (tracer/data_dependent.py)
    with meta():
        masked, assign, uniques, ctc = zoo.MaskedSum(), zoo.MaskedAssign(), zoo.Uniques(), \
            zoo.CTC()
    analyze(masked, {"x": ("float32", ["B", 16])}, device="cpu", inference=False)
    for model in (assign, uniques):
        analyze(model, {"x": ("float32", ["B", 8])}, device="cpu", inference=False)
    analyze(ctc, {"x": ("float32", ["B", "T", 8]), "labels": ("int64", ["B", "S"])},
            device="cpu", inference=False)
    # nn.TransformerEncoder's left-aligned padding check (inference), tried both ways
    with meta():
        transformer = zoo.TorchTransformer()
    analyze(transformer, {"src": ("float32", ["B", "S", 32]), "tgt": ("float32", ["B", "T", 32]),
                          "src_key_padding_mask": ("bool", ["B", "S"])}, device="cpu",
            train=False)
    # F.one_hot as the kernels run it, on each device (a mixture of experts' eager loop)
    with meta():
        experts = zoo.TopKExperts()
    for device in ("cpu", "cuda"):
        analyze(experts, {"x": ("float32", ["B", "S", 16])}, device=device, inference=False)
    # FSDP2's reduce-scatter on the CPU: gloo's copy of the input
    with meta():
        mlp = O.mlp_model(blocks=1)
    analyze(mlp, {"input": ("float32", ["B", 64])}, device="cpu", fsdp=FSDP(2), inference=False)


@pytest.mark.heavy
def test_every_aten_and_function_rule_is_reached():
    reached = _reached(_traces)
    for r in registered(Kind.ATEN) + registered(Kind.FUNCTION):
        assert (r.kind, r.key, r.device) in reached, f"{r.kind.value} rule {r.name} " \
            f"({r.device}) was not applied by any trace here: add a program that needs it"


# one call per CUDA autocast entry, with bf16 inputs
_SAMPLES = {
    "fp32": {
        F.layer_norm: lambda x: F.layer_norm(x, (8,)), F.group_norm: lambda x: F.group_norm(
            x.reshape(2, 4, 2), 2), torch.layer_norm: lambda x: torch.layer_norm(x, (8,)),
        torch.group_norm: lambda x: torch.group_norm(x.reshape(2, 4, 2), 2),
        torch.exp: torch.exp, torch.Tensor.exp: torch.Tensor.exp, torch.log: torch.log,
        torch.Tensor.log: torch.Tensor.log, torch.pow: lambda x: torch.pow(x, 2),
        torch.Tensor.pow: lambda x: x.pow(2), torch.Tensor.__pow__: lambda x: x ** 2,
        torch.rsqrt: torch.rsqrt, torch.Tensor.rsqrt: torch.Tensor.rsqrt,
        torch.logsumexp: lambda x: torch.logsumexp(x, -1),
        torch.Tensor.logsumexp: lambda x: x.logsumexp(-1), torch.expm1: torch.expm1,
        torch.log1p: torch.log1p, torch.reciprocal: torch.reciprocal, F.softplus: F.softplus,
        F.kl_div: lambda x: F.kl_div(x, x, reduction="sum"), F.l1_loss: lambda x: F.l1_loss(x, x),
        F.smooth_l1_loss: lambda x: F.smooth_l1_loss(x, x),
        F.huber_loss: lambda x: F.huber_loss(x, x), F.mse_loss: lambda x: F.mse_loss(x, x),
        F.cosine_similarity: lambda x: F.cosine_similarity(x, x),
        getattr(F, "rms_norm", None): lambda x: F.rms_norm(x, (8,)),
    },
    "fp32_out": {
        F.softmax: lambda x: F.softmax(x, -1), F.log_softmax: lambda x: F.log_softmax(x, -1),
        torch.softmax: lambda x: torch.softmax(x, -1),
        torch.log_softmax: lambda x: torch.log_softmax(x, -1),
        torch.Tensor.softmax: lambda x: x.softmax(-1),
        torch.Tensor.log_softmax: lambda x: x.log_softmax(-1), torch.sum: torch.sum,
        torch.Tensor.sum: torch.Tensor.sum, torch.cumsum: lambda x: torch.cumsum(x, -1),
        torch.Tensor.cumsum: lambda x: x.cumsum(-1), torch.prod: torch.prod,
        torch.Tensor.prod: torch.Tensor.prod,
    },
}


@pytest.mark.parametrize("entry", registered(Kind.AUTOCAST), ids=lambda r: r.name)
def test_every_cuda_autocast_entry_gives_fp32(entry):
    """Under CPU autocast with CUDA's policy on, each entry's function returns fp32 for bf16
    input (CUDA's rule), where plain CPU autocast would keep bf16 for some."""
    from memsim.tracer.precision import CudaAutocastPolicy

    call = _SAMPLES[entry.value].get(entry.key)
    assert call is not None, f"no sample call for {entry.name} ({entry.value}): add one here"
    x = torch.rand(2, 8, dtype=torch.bfloat16) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastPolicy():
        out = call(x)
    assert out.dtype == torch.float32, entry.name


@pytest.mark.parametrize("entry", registered(Kind.INDUCTOR), ids=lambda r: r.name)
def test_every_inductor_entry_names_an_op(entry):
    """Each entry names an ATen (or prims) op, and a node calling it is lowered as the entry
    says (or as its pointwise tag says, which decides first)."""
    import torch._inductor.inductor_prims  # noqa: F401 - registers prims.inductor_random...

    from memsim.tracer.compiled import _kind

    ns = torch.ops.aten if hasattr(torch.ops.aten, entry.key) else torch.ops.prims
    packet = getattr(ns, entry.key)
    op = getattr(packet, packet.overloads()[0])
    kind = _kind(torch.fx.Graph().call_function(op, ()))
    assert kind == entry.value or (kind == "pointwise" and torch.Tag.pointwise in op.tags), \
        (entry.name, kind)


@pytest.mark.parametrize("entry", registered(Kind.NAMESPACE), ids=lambda r: r.name)
def test_every_checked_namespace_exists(entry):
    import importlib
    for mod in ("torch.distributed._functional_collectives", "torch.distributed.fsdp"):
        importlib.import_module(mod)  # registers the distributed namespaces' ops
    names = list(torch._C._dispatch_get_all_op_names())
    names += [s.name for s in torch._C._jit_get_all_schemas()]   # prim:: ops (prim.device)
    assert any(n.startswith(entry.key + "::") for n in names), entry.key


def test_gpu_registry_takes_the_same_entry_twice():
    g = register_gpu("test-twice", "Twice", 1234, "ada")
    assert register_gpu("test-twice", "Twice", 1234, "ada") == g == GPU(
        "test-twice", "Twice", 1234, "ada", "nvidia", "user")

"""LoRA and QLoRA: memsim's own strategy (``apply_lora`` / ``apply_qlora``) traced on meta ==
a real CPU run of the model as peft wraps it (``peft.get_peft_model``; for QLoRA on
bitsandbytes' ``Linear4bit``), none of memsim's layers on the real side."""

import pytest
import torch

import zoo
from oracle import check, predict
from memsim.strategies.lora import LoRA, apply_lora, lora_targets, parse_lora
from memsim.tracer import StrategyError, UsageError

GPT = {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])}
LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
X = {"x": ("float32", ["B", 64])}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # Llama's attention linears


def _peft(factory, lora: LoRA, target_modules):
    """The real model: built on the CPU (materializing from meta would untie tied weights),
    wrapped by peft's own get_peft_model."""
    peft = pytest.importorskip("peft", reason="pip install -e '.[test]'")

    def real():
        return peft.get_peft_model(factory(), peft.LoraConfig(
            r=lora.r, lora_alpha=int(lora.r * lora.scaling), lora_dropout=lora.dropout,
            target_modules=target_modules))
    return real


def peft_name(path: str) -> str | None:
    """peft's module path as memsim names it: ``base_model.model.h.0.attn.c_attn.lora_A.default``
    is ``h.0.attn.c_attn.lora_A``; peft's two wrapper roots are memsim's root (left out)."""
    if path in ("base_model", "base_model.model"):
        return None
    return path.removeprefix("base_model.model.").removesuffix(".default")


def tiny_lora(**kw):
    def factory():
        return apply_lora(zoo.TinyGPT(layers=2, sdpa=False), LoRA(**kw))
    return factory


@pytest.mark.parametrize("kw,targets", [
    (dict(r=4), ["c_attn", "c_proj"]),
    (dict(r=2, dropout=0.1, targets="all-linear"), ["c_attn", "c_proj", "mlp.0", "mlp.2"])],
    ids=["attention", "all-linear-dropout"])
def test_lora_matches_real_peft_run(kw, targets):
    """nanoGPT blocks: memsim's LoRA against peft's on the same targets (every linear layer of
    the attention; all but the head, with dropout)."""
    real = _peft(lambda: zoo.TinyGPT(layers=2, sdpa=False), LoRA(**kw), targets)
    report = predict(tiny_lora(**kw), GPT, inference=False)
    check(report, real, GPT, [{"B": 2, "S": 8}, {"B": 3, "S": 21}], module_name=peft_name)


def test_frozen_base_has_no_gradients_or_state():
    full = predict(lambda: zoo.TinyGPT(layers=2, sdpa=False), GPT, inference=False)
    lora = predict(tiny_lora(r=4), GPT, inference=False)
    pt = {"B": 3, "S": 21}
    f, l = full.at(**pt)["train"], lora.at(**pt)["train"]
    # adapters on attn.c_attn (32 -> 96) and attn.c_proj (32 -> 32), rank 4, fp32, 2 blocks
    adapters = 2 * 4 * ((32 + 96) * 4 + (32 + 32) * 4)
    assert l["gradients"] == adapters
    assert l["optimizer_states"] == 2 * adapters + 4 * 4 * 2  # exp_avg, exp_avg_sq, steps
    assert l["parameters"] == f["parameters"] + adapters
    assert l["saved_activations"] < f["saved_activations"] + 2 * 3 * 21 * 4 * 4 * 2


def llama():
    T = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    return T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64))


@pytest.mark.slow
@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), "attention"], ids=["qv", "attention"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_on_hf_llama_matches_real_peft_run(targets, dropout):
    """HF Llama: ``apply_lora(base, LoRA(r=8, targets=...))`` traced against
    ``peft.get_peft_model(base, LoraConfig(r=8, target_modules=...))`` run for real: peak,
    parameters, gradients and optimizer states at two points."""
    lora = LoRA(r=8, targets=targets, dropout=dropout)

    def factory():
        return apply_lora(llama(), lora)

    with torch.device("meta"):
        m = factory()
    assert {n.rsplit(".", 2)[-2] for n, p in m.named_parameters() if p.requires_grad} == \
        {"lora_A", "lora_B"}
    assert {n.rsplit(".", 1)[-1] for n in lora_targets(llama(), "attention")} == set(ATTENTION)
    report = predict(factory, LM, inference=False)
    real = _peft(llama, lora, ATTENTION if targets == "attention" else list(targets))
    check(report, real, LM, [{"B": 2, "S": 8}, {"B": 3, "S": 13}], module_name=peft_name)


class Wide(torch.nn.Module):
    """One wide adapted layer with biases: the step's peak is inside its forward (the base
    output, the adapter's output and their sum live together)."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = torch.nn.Linear(64, 2048), torch.nn.Linear(2048, 8)

    def forward(self, x):  # (B, 64)
        return self.out(self.proj(x))


@pytest.mark.parametrize("precision,dropout", [("32-true", 0.0), ("bf16-true", 0.1)])
def test_lora_peak_inside_the_adapter_matches_peft(precision, dropout):
    lora = LoRA(r=8, targets=("proj",), dropout=dropout)
    report = predict(lambda: apply_lora(Wide(), lora), X, inference=False, precision=precision)
    pt = {"B": 64}
    assert report.train.winner(pt).label.module == "proj"
    check(report, _peft(Wide, lora, ["proj"]), X, [pt, {"B": 200}], precision=precision,
          module_name=peft_name)


def test_lora_targets_and_errors():
    m = zoo.TinyGPT(layers=2)
    assert lora_targets(m, "attention") == [f"h.{i}.attn.{n}" for i in range(2)
                                            for n in ("c_attn", "c_proj")]
    assert "lm_head" not in lora_targets(m, "all-linear")
    assert lora_targets(m, ("c_attn",)) == ["h.0.attn.c_attn", "h.1.attn.c_attn"]
    with pytest.raises(StrategyError, match="'q_proj' matches no linear layer"):
        apply_lora(m, LoRA(targets=("q_proj",)))
    with pytest.raises(StrategyError, match="rank"):
        LoRA(r=0)
    assert parse_lora("r=16,alpha=32,targets=q_proj+v_proj") == LoRA(
        r=16, alpha=32.0, targets=("q_proj", "v_proj"))
    with pytest.raises(UsageError, match="unknown key"):
        parse_lora("rank=4")


def _bnb_qlora(factory, q):
    """The real thing: the model's linear layers (all but the head) as bitsandbytes'
    ``Linear4bit`` (NF4, double quantization) quantized from its weights on the CPU, then
    peft's own LoRA on the targets (``get_peft_model``; peft wraps ``Linear4bit`` in its
    ``lora.Linear4bit`` when the model says it is loaded in 4 bits, as transformers' loader
    does; no ``prepare_model_for_kbit_training``, which memsim does not model). The
    quantization state lives in bitsandbytes' QuantState; it is registered as buffers so the
    oracle counts it. One forward before measuring: bitsandbytes casts a bias to the compute
    dtype in place on the first one (the measured step is the steady state)."""
    import bitsandbytes as bnb
    peft = pytest.importorskip("peft", reason="pip install -e '.[test]'")

    from memsim.strategies.lora import _head_names
    torch.manual_seed(0)
    model = factory()
    heads = _head_names(model)
    for p in model.parameters():
        p.requires_grad_(False)
    mods = dict(model.named_modules())
    for name, mod in list(mods.items()):
        if not isinstance(mod, torch.nn.Linear) or name in heads:
            continue
        l4 = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                               compute_dtype=getattr(torch, q.compute_dtype), quant_type="nf4",
                               compress_statistics=True)
        l4.weight = bnb.nn.Params4bit(mod.weight.data.clone(), requires_grad=False,
                                      quant_type="nf4", compress_statistics=True,
                                      blocksize=q.blocksize).to("cpu")
        if mod.bias is not None:
            l4.bias = torch.nn.Parameter(mod.bias.data.clone(), requires_grad=False)
        qs = l4.weight.quant_state
        for k, t in (("absmax", qs.absmax), ("absmax2", qs.state2.absmax), ("code", qs.code),
                     ("code2", qs.state2.code), ("offset", qs.offset)):
            l4.register_buffer("_qs_" + k, t)
        parent, _, child = name.rpartition(".")
        setattr(mods[parent] if parent else model, child, l4)
    model.is_loaded_in_4bit = True
    targets = ATTENTION if q.targets == "attention" else list(q.targets)
    n = len(lora_targets(model, targets))
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=q.r, lora_alpha=int(q.r * q.scaling), lora_dropout=q.dropout, target_modules=targets))
    assert [type(m).__module__ for m in model.modules()].count("peft.tuners.lora.bnb") == n
    return model


@pytest.mark.slow
@pytest.mark.parametrize("model,compute", [("llama", "float32"), ("llama", "bfloat16"),
                                           ("wide", "bfloat16")])
def test_qlora_matches_real_bitsandbytes_peft_run(model, compute):
    """``apply_qlora`` traced against peft's LoRA on bitsandbytes' ``Linear4bit`` run for real.
    The wide model (biases, the peak inside the adapted layer) found a difference, now fixed:
    bitsandbytes holds a bias in the compute dtype after the first forward (memsim cast a copy
    on every forward: 4,112 B of parameters high in bf16). memsim's adapter on a 4-bit base
    also follows peft's ``lora.Linear4bit`` forward now (the base output cloned, the adapter's
    output cast before the sum); at these points the peak is the same with either forward."""
    pytest.importorskip("bitsandbytes", reason="pip install -e '.[test]'")
    from oracles.measure import example_inputs, measure_train
    from memsim.strategies.lora import QLoRA, apply_qlora

    base, inputs, points, targets = (
        (llama, LM, ({"B": 2, "S": 8}, {"B": 3, "S": 13}), "attention") if model == "llama"
        else (Wide, X, ({"B": 64}, {"B": 200}), ("proj",)))
    q = QLoRA(r=8, compute_dtype=compute, targets=targets)
    report = predict(lambda: apply_qlora(base(), q), inputs, inference=False)
    real = _bnb_qlora(base, q)
    with torch.no_grad():
        real(**example_inputs(inputs, points[0]))
    for pt in points:
        m = measure_train(real, example_inputs(inputs, pt))
        got = report.at(**pt)["train"]
        assert (got["peak"], got["parameters"], got["gradients"], got["optimizer_states"]) == (
            m.peak, m.parameters, m.gradients, m.optimizer_states), pt
    if model == "llama":  # the 4-bit base: one byte per two weights, plus the quantization state
        plain = predict(base, LM, inference=False).at(B=2, S=8)["train"]
        assert got["parameters"] < plain["parameters"] / 2


class _PoolingHead(torch.nn.Module):
    """SigLIP's pooling head: a probe attends over the sequence with nn.MultiheadAttention,
    which passes ``out_proj.weight`` to its functional form instead of calling ``out_proj``."""

    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = torch.nn.Linear(16, 16)
        self.probe = torch.nn.Parameter(torch.randn(1, 1, 16))

    def forward(self, x):  # (B, S, 16)
        h = self.attention(self.probe.expand(x.shape[0], -1, -1), x, x)[0]
        return self.fc(h).pow(2).mean()


def test_lora_on_a_layer_read_by_its_weight_matches_real_peft_run():
    """An adapter on nn.MultiheadAttention's ``out_proj``: the attention reads the layer's
    ``weight`` and never calls it. peft's tuner layer gives the base's weight, and the adapter
    gets no gradient and no optimizer state; memsim's layer failed ("'LoRALayer' object has no
    attribute 'weight'": PaliGemma and Gemma 3 under LoRA)."""
    lora = LoRA(r=4, targets=("out_proj", "fc"))
    x = {"x": ("float32", ["B", "S", 16])}
    from memsim.strategies.api import analyze
    with torch.device("meta"):
        model = _PoolingHead()
    report = analyze(model, x, device="cpu", inference=False, lora=lora)
    check(report, _peft(_PoolingHead, lora, ["out_proj", "fc"]), x,
          [{"B": 2, "S": 5}, {"B": 3, "S": 11}], module_name=peft_name)

"""LoRA and QLoRA: memsim's own strategy (``apply_lora`` / ``apply_qlora``) traced on meta ==
a real CPU run of the model as peft wraps it (``peft.get_peft_model``; for QLoRA on
bitsandbytes' ``Linear4bit``), none of memsim's layers on the real side."""

import pytest
import torch

from memsim.strategies.lora import LoRA, apply_lora, lora_targets, parse_lora
from memsim.tracer import StrategyError, UsageError

from tests.support import zoo
from tests.support.predict import check, predict

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
            r=lora.r, lora_alpha=2 * lora.r, lora_dropout=lora.dropout,
            target_modules=target_modules))  # alpha (a scale) changes no memory
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
    """LoRA on nanoGPT's attention (rank 4, B = 3, S = 21): gradients, optimizer states,
    parameters and saved activations equal the values derived below from the model's sizes."""
    full = predict(lambda: zoo.TinyGPT(layers=2, sdpa=False), GPT, inference=False)
    lora = predict(tiny_lora(r=4), GPT, inference=False)
    pt = {"B": 3, "S": 21}
    f, l = full.at(**pt)["train"], lora.at(**pt)["train"]
    # adapters on attn.c_attn (32 -> 96) and attn.c_proj (32 -> 32), rank 4, fp32, 2 blocks
    adapters = 2 * 4 * ((32 + 96) * 4 + (32 + 32) * 4)
    assert l["gradients"] == adapters
    assert l["optimizer_states"] == 2 * adapters + 4 * 4 * 2  # exp_avg, exp_avg_sq, steps
    assert l["parameters"] == f["parameters"] + adapters
    # saved for backward (B, S, d, heads, vocab = 3, 21, 32, 4, 64; fp32): a frozen weight's
    # layer saves no input for the weight's gradient (mlp.0, mlp.2, the tied lm_head save
    # nothing), block 0's input needs no gradient (frozen embeddings) so its ln_1 saves
    # nothing; each adapter's lora_A saves its input and its lora_B the (B, S, r) in between
    act, r_in = 3 * 21 * 32 * 4, 3 * 21 * 4 * 4        # 8,064 and 1,008
    ln = act + 2 * 3 * 21 * 4                           # input, mean, rstd: 8,568
    attn = (act + r_in                                  # c_attn's lora_A and lora_B inputs
            + 3 * act                                   # c_attn's output (q, k and v views)
            + 21 * 21                                   # ~mask, (S, S) bool
            + 3 * 4 * 21 * 21 * 4                       # softmax output (B, heads, S, S)
            + act + r_in)                               # c_proj's lora_A and lora_B inputs
    block = attn + ln + 4 * act                         # + ln_2, GELU's input (B, S, 4d)
    loss = 3 * 21 * 64 * 4 + 4                          # log-softmax output, nll's weight sum
    # attn = 63,945, block = 104,769: block 0, block 1 with its ln_1, ln_f, the loss
    assert l["saved_activations"] == block + (ln + block) + ln + loss == 242_806


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


def _register_quant_state(model) -> None:
    """bitsandbytes keeps each ``Linear4bit``'s quantization state in a ``QuantState`` object,
    outside the module's tensors: registered as buffers so that the oracle counts it."""
    import bitsandbytes as bnb

    for mod in model.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            qs = mod.weight.quant_state
            for k, t in (("absmax", qs.absmax), ("absmax2", qs.state2.absmax),
                         ("code", qs.code), ("code2", qs.state2.code), ("offset", qs.offset)):
                mod.register_buffer("_qs_" + k, t)


def _hf_4bit(factory, compute: str, folder):
    """An HF model loaded in 4 bits as a user loads one: saved, then ``from_pretrained`` with
    transformers' ``BitsAndBytesConfig`` (NF4, double quantization; bitsandbytes' default
    block of 64), on the CPU. transformers chooses the layers it quantizes: every linear layer
    but the output head (``lm_head``, untied in this Llama, stays a float ``nn.Linear``). It
    loads in eval mode; training puts it in train mode, as a trainer does."""
    T = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
    torch.manual_seed(0)
    factory().save_pretrained(folder)
    return T.AutoModelForCausalLM.from_pretrained(
        folder, device_map="cpu", quantization_config=T.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=getattr(torch, compute))).train()


def _every_linear_4bit(factory, compute: str):
    """A plain module (no output head) in 4 bits: every ``nn.Linear`` replaced by
    bitsandbytes' ``Linear4bit`` (NF4, double quantization, block of 64), its ``Params4bit``
    quantized from the layer's weights when moved to the CPU; the model says it is loaded in 4
    bits, as transformers' loaded models do (peft then wraps ``Linear4bit`` in its
    ``lora.Linear4bit``)."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = factory()
    mods = dict(model.named_modules())
    for name, mod in list(mods.items()):
        if not isinstance(mod, torch.nn.Linear):
            continue
        l4 = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                               compute_dtype=getattr(torch, compute), quant_type="nf4",
                               compress_statistics=True)
        l4.weight = bnb.nn.Params4bit(mod.weight.data.clone(), requires_grad=False,
                                      quant_type="nf4", compress_statistics=True,
                                      blocksize=64).to("cpu")
        if mod.bias is not None:
            l4.bias = torch.nn.Parameter(mod.bias.data.clone(), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(mods[parent] if parent else model, child, l4)
    model.is_loaded_in_4bit = True
    return model


def _bnb_qlora(model, target_modules: list, adapters: int):
    """The real thing: peft's own LoRA (r = 8, alpha = 16) on a model in bitsandbytes' 4 bits
    (``get_peft_model``: peft wraps each target ``Linear4bit`` in its ``lora.Linear4bit``; no
    ``prepare_model_for_kbit_training``, which memsim does not model), with its quantization
    state counted; ``adapters``: how many layers the targets name in the model."""
    peft = pytest.importorskip("peft", reason="pip install -e '.[test]'")
    _register_quant_state(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16,
                                                       target_modules=target_modules))
    assert [type(m).__module__ for m in model.modules()].count("peft.tuners.lora.bnb") == \
        adapters
    return model


@pytest.mark.slow
@pytest.mark.parametrize("model,compute", [("llama", "float32"), ("llama", "bfloat16"),
                                           ("wide", "bfloat16")])
def test_qlora_matches_real_bitsandbytes_peft_run(model, compute, tmp_path):
    """``apply_qlora`` traced against a real step of peft's LoRA on bitsandbytes' ``Linear4bit``:
    the Llama loaded in 4 bits by transformers' own ``from_pretrained`` (which leaves the
    untied ``lm_head`` in float), the wide model's linear layers all in 4 bits; peak,
    parameters, gradients and optimizer states at two points. One forward before measuring:
    bitsandbytes casts a bias to the compute dtype in place on the first one (the measured step
    is the steady state). The wide model (biases, the peak inside the adapted layer) checks
    that the bias is held in the compute dtype from then on (a copy cast on every forward is
    4,112 B of parameters high in bf16) and peft's ``lora.Linear4bit`` forward (the base output
    cloned, the adapter's output cast before the sum)."""
    pytest.importorskip("bitsandbytes", reason="pip install -e '.[test]'")
    from tests.support.oracles.measure import example_inputs, measure_train
    from memsim.strategies.lora import QLoRA, apply_qlora

    if model == "llama":
        base, inputs, points, targets = llama, LM, ({"B": 2, "S": 8}, {"B": 3, "S": 13}), \
            "attention"
        # 4 attention linears in each of the 2 layers
        real = _bnb_qlora(_hf_4bit(llama, compute, tmp_path), ATTENTION, 2 * 4)
    else:
        base, inputs, points, targets = Wide, X, ({"B": 64}, {"B": 200}), ("proj",)
        real = _bnb_qlora(_every_linear_4bit(Wide, compute), ["proj"], 1)
    q = QLoRA(r=8, compute_dtype=compute, targets=targets)
    report = predict(lambda: apply_qlora(base(), q), inputs, inference=False)
    with torch.no_grad():
        real(**example_inputs(inputs, points[0]))
    for pt in points:
        m = measure_train(real, example_inputs(inputs, pt))
        got = report.at(**pt)["train"]
        assert (got["peak"], got["parameters"], got["gradients"], got["optimizer_states"]) == (
            m.peak, m.parameters, m.gradients, m.optimizer_states), pt
    if model == "llama":
        # embed_tokens and the float lm_head, 100 x 64 fp32 each: 2 x 25,600; 5 RMSNorm
        # weights of 64: 1,280; the 4-bit base, one byte per two weights, per layer q, k, v, o
        # (64 x 64, 32, 32, 64) and gate, up, down (64 x 128 each): 18,432; fp32 adapters of
        # rank 8 on q, k, v, o: 8 x ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64)) x 4 = 14,336
        assert got["parameters"] == 2 * 25_600 + 1_280 + 2 * 18_432 + 2 * 14_336 == 118_016


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
    from memsim.strategies.compose import analyze
    with torch.device("meta"):
        model = _PoolingHead()
    report = analyze(model, x, device="cpu", inference=False, lora=lora)
    check(report, _peft(_PoolingHead, lora, ["out_proj", "fc"]), x,
          [{"B": 2, "S": 5}, {"B": 3, "S": 11}], module_name=peft_name)

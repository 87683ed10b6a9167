"""Sizes that depend on tensor values (memsim.tracer.data_dependent), answered at a bound and
checked against real CPU runs whose data makes that bound hold: every element of a mask true for
``max``, a given share of them for a fraction."""

import pytest
import torch

from tests.support import zoo
from tests.support.oracles.measure import example_inputs
from tests.support.predict import check, figures, predict


INPUTS = {"x": ("float32", ["B", 16])}


def _hf(name):
    """A factory of tests/support/hf_models.py, imported when called (it imports
    transformers)."""
    def make():
        from tests.support import hf_models
        return getattr(hf_models, name)()
    make.__name__ = name
    return make


def _signed(point, positive):
    """An input whose first ``positive`` elements are positive, the rest not."""
    x = example_inputs(INPUTS, point)["x"].abs() + 0.5
    x.view(-1)[positive:] *= -1
    return {"x": x}


def test_every_element_true_is_the_default_bound_and_exact_when_the_data_makes_it_hold():
    report = predict(zoo.MaskedSum, INPUTS)
    assert any("data-dependent size" in n and "--data-dependent max" in n
               for n in report.notes), report.notes
    check(report, zoo.MaskedSum, INPUTS, [{"B": 3}, {"B": 8}],
          real_inputs=lambda pt: _signed(pt, 16 * pt["B"]))


def test_a_fraction_of_the_elements():
    """``--data-dependent 0.3``: 30% of the mask's elements, rounded up (ceil(4.8 B)), true
    in the data."""
    report = predict(zoo.MaskedSum, INPUTS, data_dependent="0.3")
    assert any("0.3 of its elements" in n for n in report.notes), report.notes
    check(report, zoo.MaskedSum, INPUTS, [{"B": 3}, {"B": 8}],
          real_inputs=lambda pt: _signed(pt, -(-16 * pt["B"] * 3 // 10)))
    full = predict(zoo.MaskedSum, INPUTS)
    assert figures(report, B=8)["train"]["peak"] < figures(full, B=8)["train"]["peak"]


def test_a_mask_the_run_knows_is_counted_exactly_with_nothing_assumed():
    inputs = {"x": ("float32", ["B", 8])}
    report = predict(zoo.KnownMask, inputs)
    assert not any("data-dependent" in n for n in report.notes), report.notes
    # a sum of a mask that no size reads (an attention mask's lengths) assumes nothing either
    lengths = predict(zoo.MLP, {"x": ("float32", ["B", 16])},
                      loss_fn=lambda out: out.sum() + (out > 0).sum(-1).float().mean())
    assert not any("data-dependent" in n for n in lengths.notes), lengths.notes
    check(report, zoo.KnownMask, inputs, [{"B": 3}, {"B": 6}])


def test_a_loop_over_the_values_of_a_small_data_dependent_tensor():
    inputs = {"x": ("float32", ["T", 8])}
    report = predict(zoo.ExpertLoop, inputs)
    check(report, zoo.ExpertLoop, inputs, [{"T": 3}, {"T": 7}])


def test_truth_values_read_without_data_take_the_branch_a_run_takes_or_the_larger():
    inputs = {"x": ("float32", ["B", 8])}
    report = predict(zoo.Branchy, inputs)
    notes = " ".join(report.notes)
    assert "taken as False, since with True the model fails" in notes, report.notes
    assert "taken as True, the branch that holds more" in notes, report.notes
    positive = lambda pt: {"x": example_inputs(inputs, pt)["x"].abs() + 0.1}  # noqa: E731
    check(report, zoo.Branchy, inputs, [{"B": 3}, {"B": 10}], real_inputs=positive)
    # the other branch, given: the real run on data that takes it (random signs)
    line = next(n for n in report.notes if "holds more" in n).split(" at ")[1].split(" ")[0]
    small = predict(zoo.Branchy, inputs, assume={line: False})
    check(small, zoo.Branchy, inputs, [{"B": 3}])
    assert figures(small, B=10)["train"]["peak"] < figures(report, B=10)["train"]["peak"]


def test_masked_assignment_unique_and_ctc_against_real_runs():
    """``x[mask] = v``; ``unique`` in its forms, at most every element distinct (random floats
    are); CTC loss sized by its longest target, every label a target (labels 1)."""
    x8 = {"x": ("float32", ["B", 8])}
    for factory in (zoo.MaskedAssign, zoo.Uniques):
        check(predict(factory, x8), factory, x8, [{"B": 3}, {"B": 7}],
              real_inputs=lambda pt: {"x": example_inputs(x8, pt)["x"].abs() + 0.1})
    ctc = {"x": ("float32", ["B", "T", 8]), "labels": ("int64", ["B", "S"])}
    report = predict(zoo.CTC, ctc)
    assert any("the longest target of ctc_loss" in n for n in report.notes), report.notes
    check(report, zoo.CTC, ctc, [{"B": 2, "T": 12, "S": 4}, {"B": 3, "T": 20, "S": 7}],
          real_inputs=lambda pt: dict(example_inputs(ctc, pt),
                                      labels=torch.ones(pt["B"], pt["S"], dtype=torch.long)))


def test_torch_transformer_with_masks():
    """``nn.Transformer`` reads whether its target mask is causal (``torch.equal``) in Python:
    both ways run, the larger answered (an upper bound: a mask materialized); given True, as the
    real run's causal mask makes it, the figures equal the real run's."""
    inputs = {"src": ("float32", ["B", "S", 32]), "tgt": ("float32", ["B", "T", 32]),
              "src_key_padding_mask": ("bool", ["B", "S"])}

    def real(pt):
        x = example_inputs(inputs, pt)
        x["src_key_padding_mask"] = torch.zeros(pt["B"], pt["S"], dtype=torch.bool)
        return x
    report = predict(zoo.TorchTransformer, inputs, inference=False)
    note = next(n for n in report.notes if "taken as False, the branch that holds more" in n)
    site = note.split(" at ")[1].split(" ")[0]
    point = {"B": 2, "S": 5, "T": 6}
    given = predict(zoo.TorchTransformer, inputs, inference=False, assume={site: True})
    check(given, zoo.TorchTransformer, inputs, [point], real_inputs=real)
    assert figures(report, **point)["train"]["saved_activations"] > \
        figures(given, **point)["train"]["saved_activations"]
    # inference asks whether the padding is left-aligned (a kernel fake mode lacks): answered
    inference = predict(zoo.TorchTransformer, inputs, train=False)
    assert inference.inference is not None


class EvalScale(torch.nn.Module):
    """Reads a number from the data in eval mode only (a value no run can guess)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if not self.training:
            h = h / float(h.abs().max())
        return h.square().sum()


def test_a_failure_only_inference_meets_leaves_the_training_answer():
    from memsim.render import to_json, to_text
    inputs = {"x": ("float32", ["B", 8])}
    report = predict(EvalScale, inputs)
    assert report.inference is None and report.train is not None
    assert any(n.startswith("inference is not answered") and "--assume" in n
               for n in report.notes), report.notes
    check(report, EvalScale, inputs, [{"B": 3}])
    assert "inference is not answered" in to_text(report, {"B": 3})
    assert "inference" not in to_json(report, {"B": 3})


class CountAsSize(torch.nn.Module):
    """One row's count of true elements read as a size."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        n = int((x > 0).sum(-1)[0])
        return self.fc(x)[:, :n].exp().sum()


def test_an_element_of_counts_read_as_a_size():
    inputs = {"x": ("float32", ["B", 8])}
    report = predict(CountAsSize, inputs)
    assert any("a count of true elements" in n for n in report.notes), report.notes
    check(report, CountAsSize, inputs, [{"B": 3}, {"B": 6}],
          real_inputs=lambda pt: {"x": example_inputs(inputs, pt)["x"].abs() + 0.1})


def test_the_bound_is_checked_and_named():
    from memsim.tracer import InputError, StepConfig
    assert str(StepConfig(data_dependent="0.5").data_dependent) == "0.5"
    with pytest.raises(InputError, match="fraction in"):
        StepConfig(data_dependent="all")


@pytest.mark.parametrize("factory, inputs, line", [
    # its default loss picks the rows with a label (labels >= 0) with nonzero()
    (_hf("deberta_v2_classifier"), {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B"])},
     "modeling_deberta_v2.py"),
    # sparse prediction: the head runs on the tokens with a label only (x[labels != -100])
    (_hf("modernbert_sparse"), {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])},
     "modeling_modernbert.py"),
], ids=["deberta-v2-classification", "modernbert-sparse-prediction"])
def test_hugging_face_losses_that_select_labelled_rows(factory, inputs, line):
    """Every label given (the real inputs' labels are 0): the bound holds, and the figures are
    the real run's."""
    pytest.importorskip("transformers")
    from tests.support import hf_models as hf
    report = predict(factory, inputs)
    assert any("data-dependent size" in n and line in n for n in report.notes), report.notes
    check(report, factory, inputs, [{"B": 2, "S": 9}, {"B": 3, "S": 16}])


@pytest.mark.heavy
def test_ctc_loss_and_a_check_that_raises_on_one_branch():
    """HuBERT's CTC head: ``if labels.max() >= vocab_size: raise`` is read without data (the
    raising branch is left for the other), the labels kept with ``masked_select`` and the
    longest target sizing ``ctc_loss``'s ``log_alpha`` are at their bound: every label a target
    (not blank, not ignored), as in the real run (labels 1), whose figures these equal."""
    pytest.importorskip("transformers")
    from tests.support import hf_models as hf
    inputs = {"input_values": ("float32", ["B", "L"]), "labels": ("int64", ["B", "S"])}
    report = predict(hf.hubert_ctc, inputs, hints={"L": 400})
    notes = " ".join(report.notes)
    assert "modeling_hubert.py" in notes and "taken as False, since with True the model fails" \
        in notes and "the longest target of ctc_loss" in notes, report.notes
    check(report, hf.hubert_ctc, inputs, [{"B": 2, "L": 400, "S": 5}, {"B": 3, "L": 560, "S": 9}],
          real_inputs=lambda pt: dict(example_inputs(inputs, pt),
                                      labels=torch.ones(pt["B"], pt["S"], dtype=torch.long)))


LED = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


@pytest.mark.heavy
def test_a_truth_value_read_without_data_is_tried_both_ways():
    """LED reads ``is_global_attn = mask.any().item()`` of its global attention mask: both
    branches run, the one holding more is answered (global attention, every token global: the
    bound of its counts), and equals a real run with a global attention mask of ones;
    ``--assume`` the other way equals a real run without global attention."""
    pytest.importorskip("transformers")
    from tests.support import hf_models as hf
    inputs = dict(LED, global_attention_mask=("int64", ["B", "S"]))
    report = predict(hf.led, inputs)
    assert any("modeling_led.py" in n and "taken as True, the branch that holds more" in n
               for n in report.notes), report.notes
    ones = dict(LED, global_attention_mask=("int64", ["B", "S"], "ones"))
    check(report, hf.led, inputs, [{"B": 2, "S": 16}],
          real_inputs=lambda pt: example_inputs(ones, pt))
    site = next(n for n in report.notes if "taken as True" in n).split(" at ")[1].split(" ")[0]
    local = predict(hf.led, LED, assume={site: False})
    assert not any("taken as True" in n for n in local.notes), local.notes
    check(local, hf.led, LED, [{"B": 2, "S": 16}, {"B": 3, "S": 24}])


@pytest.mark.parametrize("bound, force", [("max", "same"), ("balanced", "spread")])
def test_top_k_routing_in_an_eager_expert_loop(bound, force):
    import functools
    x = {"x": ("float32", ["B", "S", 16])}
    report = predict(zoo.TopKExperts, x, data_dependent=bound)
    assert any("routing:" in n for n in report.notes), report.notes
    check(report, functools.partial(zoo.TopKExperts, force=force), x,
          [{"B": 2, "S": 4}, {"B": 3, "S": 6}])


@pytest.mark.parametrize("family, note", [("qwen2_moe", "routing:"),
                                           ("jetmoe", "tokens per expert")])
@pytest.mark.parametrize("bound, spread", [("max", False), ("balanced", True)])
def test_mixture_of_experts_routing(family, note, bound, spread):
    """Qwen2-MoE's eager expert loop, and JetMoE's router, which counts the tokens per expert
    (``gates.long().sum(0).tolist()``) and splits the tokens by them: ``max`` routes every
    token to the same k experts (each takes all tokens: the most one expert can),
    ``balanced`` deals them round-robin; each equals a real run whose router is forced so."""
    pytest.importorskip("transformers")
    import functools

    from tests.support import hf_models as hf
    LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
    plain = hf.qwen2_moe_eager if family == "qwen2_moe" else hf.jetmoe
    report = predict(plain, LM, data_dependent=bound)
    assert any(note in n for n in report.notes), report.notes
    forced = getattr(hf, f"{family}_forced")
    check(report, functools.partial(forced, spread), LM, [{"B": 2, "S": 8}, {"B": 3, "S": 6}])

"""Sizes that depend on tensor values (memsim.tracer.data_dependent), answered at a bound and
checked against real CPU runs whose data makes that bound hold: every element of a mask true for
``max``, a given share of them for a fraction."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.oracles.measure import example_inputs
from tests.support.predict import check, figures, predict


class MaskedSum(torch.nn.Module):
    """Boolean indexing, ``masked_select`` and ``torch.where(mask)`` of a mask that real data
    decides: ``x > 0`` of the input."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        keep = x > 0
        rows, cols = torch.where(keep)
        return (h[keep].sum() + torch.masked_select(h, keep).square().sum()
                + h[rows, cols].exp().sum())


INPUTS = {"x": ("float32", ["B", 16])}


def _signed(point, positive):
    """An input whose first ``positive`` elements are positive, the rest not."""
    x = example_inputs(INPUTS, point)["x"].abs() + 0.5
    x.view(-1)[positive:] *= -1
    return {"x": x}


def test_every_element_true_is_the_default_bound_and_exact_when_the_data_makes_it_hold():
    report = predict(MaskedSum, INPUTS)
    assert any("data-dependent size" in n and "--data-dependent max" in n
               for n in report.notes), report.notes
    check(report, MaskedSum, INPUTS, [{"B": 3}, {"B": 8}],
          real_inputs=lambda pt: _signed(pt, 16 * pt["B"]))


def test_a_fraction_of_the_elements():
    """``--data-dependent 0.3``: 30% of the mask's elements, rounded up (ceil(4.8 B)), true
    in the data."""
    report = predict(MaskedSum, INPUTS, data_dependent="0.3")
    assert any("0.3 of its elements" in n for n in report.notes), report.notes
    check(report, MaskedSum, INPUTS, [{"B": 3}, {"B": 8}],
          real_inputs=lambda pt: _signed(pt, -(-16 * pt["B"] * 3 // 10)))
    full = predict(MaskedSum, INPUTS)
    assert figures(report, B=8)["train"]["peak"] < figures(full, B=8)["train"]["peak"]


class KnownMask(torch.nn.Module):
    """A mask whose values the run knows (made of ones): counted exactly, nothing assumed."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        keep = torch.ones_like(h, dtype=torch.bool)
        drop = torch.zeros_like(h, dtype=torch.bool)
        return h[keep].sum() + h[drop].sum()


def test_a_mask_the_run_knows_is_counted_exactly_with_nothing_assumed():
    inputs = {"x": ("float32", ["B", 8])}
    report = predict(KnownMask, inputs)
    assert not any("data-dependent" in n for n in report.notes), report.notes
    check(report, KnownMask, inputs, [{"B": 3}, {"B": 6}])


class ExpertLoop(torch.nn.Module):
    """A loop over the values of a small data-dependent tensor (Hugging Face's mixture-of-
    experts loop iterates over ``mask.nonzero()`` of the experts hit): under the bound every
    expert is hit, and the loop runs over each, as on data that routes to all of them."""

    def __init__(self, experts=4):
        super().__init__()
        self.experts = experts
        self.router = torch.nn.Linear(8, experts)
        self.w = torch.nn.Parameter(torch.randn(experts, 8, 8) / 8)

    def forward(self, x):
        logits = self.router(x)
        hit = (logits.abs().sum(0) > 0).nonzero()
        out = torch.zeros_like(x)
        for e in hit:
            e = e[0]
            if e == self.experts:   # a value read from the known indices
                continue
            tokens = (logits[:, e] > -1e9).nonzero().squeeze(-1)
            out = out.index_add(0, tokens, F.linear(x[tokens], self.w[e]))
        return out.square().sum()


def test_a_loop_over_the_values_of_a_small_data_dependent_tensor():
    inputs = {"x": ("float32", ["T", 8])}
    report = predict(ExpertLoop, inputs)
    check(report, ExpertLoop, inputs, [{"T": 3}, {"T": 7}])


def test_the_bound_is_checked_and_named():
    from memsim.tracer import InputError, StepConfig
    assert str(StepConfig(data_dependent="0.5").data_dependent) == "0.5"
    with pytest.raises(InputError, match="fraction in"):
        StepConfig(data_dependent="all")


def _deberta():
    import transformers as T
    return T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64, num_labels=3))


def _modernbert():
    import transformers as T
    return T.ModernBertForMaskedLM(T.ModernBertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64, sparse_prediction=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))


@pytest.mark.parametrize("factory, inputs, line", [
    # its default loss picks the rows with a label (labels >= 0) with nonzero()
    (_deberta, {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B"])},
     "modeling_deberta_v2.py"),
    # sparse prediction: the head runs on the tokens with a label only (x[labels != -100])
    (_modernbert, {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])},
     "modeling_modernbert.py"),
], ids=["deberta-v2-classification", "modernbert-sparse-prediction"])
def test_hugging_face_losses_that_select_labelled_rows(factory, inputs, line):
    """Every label given (the real inputs' labels are 0): the bound holds, and the figures are
    the real run's."""
    pytest.importorskip("transformers")
    report = predict(factory, inputs)
    assert any("data-dependent size" in n and line in n for n in report.notes), report.notes
    check(report, factory, inputs, [{"B": 2, "S": 9}, {"B": 3, "S": 16}])

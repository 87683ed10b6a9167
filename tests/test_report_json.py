"""The JSON document carries where each formula holds (``valid``: ranges and the trace's other
conditions), evaluable elsewhere; ``Report.at`` refuses a point outside them."""

import pytest
import sympy
import torch.nn as nn
import torch.nn.functional as F

from memsim.render import to_json
from memsim.tracer import OutOfRangeError

from tests.support.predict import check, predict


class PadToFour(nn.Module):
    """Pads S up to a multiple of 4 (Longformer and LED pad to their window so): no pad when S
    is one already, a padded copy otherwise, so the formulas hold under a condition on S."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):  # (B, S, 8)
        x = F.pad(x, (0, 0, 0, (-x.shape[1]) % 4))
        return self.fc(x).square().sum()


def test_the_json_formulas_carry_their_conditions_and_at_refuses_outside_them():
    inputs = {"x": ("float32", ["B", "S", 8])}
    report = predict(PadToFour, inputs, explore=False)
    doc = to_json(report)
    valid = doc["train"]["valid"]
    assert valid["ranges"]["S"]["min"] >= 2 and valid["conditions"], valid
    symbols = {n: sympy.Symbol(n, integer=True, positive=True) for n in doc["symbols"]}
    conditions = [sympy.sympify(c, locals=symbols) for c in valid["conditions"]]
    peak = sympy.sympify(doc["train"]["peak"]["formula"], locals=symbols)
    traced = report.train.trace.hints

    def holds(pt):
        return all(bool(c.subs({symbols[k]: v for k, v in pt.items()})) for c in conditions)
    assert holds(traced)
    inside = next(pt for pt in ({"B": 3, "S": s} for s in range(2, 40)) if holds(pt))
    outside = next(pt for pt in ({"B": 3, "S": s} for s in range(2, 40)) if not holds(pt))
    # where the conditions hold, the JSON's formula is the real run's; elsewhere at() refuses
    assert int(peak.subs({symbols[k]: v for k, v in inside.items()})) == \
        report.at(**inside)["train"]["peak"]
    check(report, PadToFour, inputs, [inside])
    with pytest.raises(OutOfRangeError, match="condition"):
        report.at(**outside)

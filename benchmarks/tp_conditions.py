"""What crossing tensor parallelism's parity conditions costs and gives (``analysis/report.py``:
``cross_conditions``).

At its odd example sizes (B = 5, S = 7) a trace under tensor parallelism assumes
``Ne(Mod(B, 2), 0)`` (DTensor's reshape rule around each linear layer), and with sequence
parallelism S odd too. memsim crosses them: one more trace per condition, and a *side* of the
report where the other side's figures differ. This times ``analyze`` on a 2-layer Llama
(hidden 64, Hugging Face's SDPA attention: ``tests/support/oracles/dist.py``'s ``llama_model``)
over TP 2 and TP 2 with SP, and one with 8 heads (hidden 256) over TP 8 with SP (its sequence
traced at S = 29: ``strategies/compose.py``'s ``_sequence_hints``), on the CPU, with the crossing and
without it (``cross_conditions`` replaced by the identity in this process), and how many points of
the 16 of a sweep (B 1-8 x S 16-128, even and odd) each answers from its formulas, without tracing
again. Run on demand (about two minutes on 2 cores)::

    python -m benchmarks.tp_conditions
"""

from __future__ import annotations

import time
from unittest import mock

import torch

from memsim.analysis import report as R
from memsim.strategies import TensorParallel
from memsim.strategies.compose import analyze

from tests.support.oracles import dist as O  # the real runs' models

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
POINTS = [(b, s) for b in (2, 3, 4, 8) for s in (16, 33, 64, 128)]


def _eight_heads():
    """The same Llama with 8 query and key-value heads (hidden 256), for TP 8."""
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=1024))


CASES = [("TP 2", TensorParallel(2), lambda: O.llama_model(attn="sdpa")),
         ("TP 2 + SP", TensorParallel(2, sequence_parallel=True),
          lambda: O.llama_model(attn="sdpa")),
         ("TP 8 + SP", TensorParallel(8, sequence_parallel=True), _eight_heads)]


def main() -> None:
    cross = R.cross_conditions
    print(f"{'strategy':<10} {'crossing':<9} {'analyze':>8} {'points from formulas':>21}")
    for name, tp, build in CASES:
        for on in (False, True):
            with mock.patch.object(R, "cross_conditions",
                                   cross if on else (lambda report, *a, **k: report)):
                with torch.device("meta"):
                    model = build()
                t0 = time.perf_counter()
                report = analyze(model, LM, device="cpu", inference=False, tp=tp)
                took = time.perf_counter() - t0
            covered = sum(not report.needs_retrace({"B": b, "S": s})
                          or report.side_for({"B": b, "S": s}) is not None for b, s in POINTS)
            print(f"{name:<10} {'on' if on else 'off':<9} {took:>6.1f} s "
                  f"{covered:>14} of {len(POINTS)}", flush=True)


if __name__ == "__main__":
    main()

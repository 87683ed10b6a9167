"""Mutation testing: put one plausible bug at a time into memsim's engine and see a test fail.

Each mutation replaces one exact piece of source (it must occur exactly once in its file) with a
wrong version, in a staged copy of the package; the working tree is never touched, so other
work can go on beside a run. The staged copy is laid out as the installed package
(``memsim/``, ``memsim/tracer``, ``memsim/analysis``, ``memsim/strategies``) and put first on
``PYTHONPATH``, ahead of the editable install, for the tests named with the mutation. A mutation
is *killed* when those tests fail, *survived* when they pass; a mutation whose text is no longer
in its file is *stale* and fails the run, as a survivor does.

    python -m benchmarks.mutations                 # every mutation, killed/survived and the score
    python -m benchmarks.mutations --list          # their names
    python -m benchmarks.mutations --only NAME ... # some of them
    python -m benchmarks.mutations --file analysis/peak.py --old 'a <= b' --new 'a < b' \\
        --tests tests/test_peak.py                 # one ad-hoc mutation, not in the list

Exit 0 when every mutation run was killed. Survivors that no test can kill are listed in
``KNOWN_SURVIVORS`` with the reason, and reported as such instead of failing the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the installed layout: package name -> source folder in the repository
LAYOUT = {"memsim": "memsim", "memsim/tracer": "tracer", "memsim/analysis": "analysis",
          "memsim/strategies": "strategies"}


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One bug: in ``path`` (repository-relative), ``old`` (occurring exactly once) becomes
    ``new``; ``tests`` are the pytest arguments that must fail on it."""
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str = ""


ACC = "tests/test_accuracy.py"
PEAK = "tests/test_peak.py::test_prune_keeps_the_max_at_every_point"
REQ = "tests/test_replay_oracle.py::test_requests_match_the_simulation"
STEADY = "tests/test_replay_oracle.py::test_traced_step_reaches_the_simulated_steady_state"
REG = "tests/test_strategy_registry.py"
MUTATIONS: list[Mutation] = [
    # the recorder: what is an allocation, when it is released
    Mutation("view-counted-as-allocation", "tracer/recorder.py",
             "sid = self._live.get(key)\n        if sid is not None:",
             "sid = None\n        if sid is not None:",
             (f"{ACC}::test_matches_real_run",),
             "a view of a live storage is recorded as a new allocation"),
    Mutation("release-recorded-late", "tracer/recorder.py",
             "            self.run.events.append(Event(-1, sid, self.time))\n",
             "            pending, self._pending = getattr(self, '_pending', None), "
             "Event(-1, sid, self.time)\n"
             "            self.run.events.extend([pending] if pending else [])\n",
             (f"{ACC}::test_matches_real_run",),
             "each release is recorded at the next one: what is allocated in between counts "
             "it live"),
    # every trace starts from the model as given
    Mutation("model-changes-persist", "tracer/module_state.py",
             "changes += _restore(type(model).__name__, saved)", "changes += []",
             ("tests/test_hf.py::test_a_model_that_changes_itself_is_traced_as_given_every_time",),
             "what a forward changes of its model (BigBird's attention) stays for later traces"),
    Mutation("module-set-in-forward-unnamed", "tracer/run_context.py",
             "            name = adopted(mod)", "            name = None",
             ("tests/test_hf.py::test_a_model_that_changes_itself_is_traced_as_given_every_time",),
             "a module the forward sets on the model is charged to its caller"),
    Mutation("lstm-flat-weights-noted", "tracer/module_state.py",
             "    if _tensors(new) or _tensors(old):\n        return None",
             "    if isinstance(new, torch.Tensor):\n        return None",
             ("tests/test_rnn_cuda.py::test_reserve_note_in_text_and_json",),
             "nn.LSTM's lists of flat weights, rebuilt by the trace, noted as the model's change"),
    # the modelled CPU decides, not the host's
    Mutation("lstm-bf16-asks-the-host", "tracer/functions.py",
             "if isa is CpuIsa.AVX512 else set())",
             "if torch.ops.mkldnn._is_mkldnn_bf16_supported() else set())",
             ("tests/test_host.py",),
             "oneDNN's bf16 LSTM is chosen by the host's CPU: another answer on a CPU "
             "without AVX-512"),
    Mutation("lstm-native-asks-the-host", "tracer/functions.py",
             "with torch.backends.mkldnn.flags(enabled=False):",
             "with contextlib.nullcontext():",
             (f"{ACC}::test_lstm_symbolic_in_batch_and_time[uni-bf16-true-avx2]",),
             "modelling a CPU without AVX-512, PyTorch's C++ entry still asks the host"),
    # precision
    Mutation("group-norm-backward-grad-in-fp32", "tracer/kernels.py",
             "if grad_in is not None and grad_in.dtype != x.dtype:", "if False:",
             ("tests/test_unet_precision.py::test_unet_bf16_mixed_matches_real_run",),
             "GroupNorm's backward under CPU autocast gives the input's gradient in fp32"),
    Mutation("bf16-mixed-keeps-fp32-activations", "tracer/precision.py",
             "return {Precision.BF16_MIXED: torch.bfloat16,",
             "return {Precision.BF16_MIXED: torch.float32,",
             ("tests/test_precision.py::test_precision_matches_real_run",),
             "bf16-mixed autocasts to fp32: activations stay fp32"),
    # the peak: dominance pruning against brute force
    Mutation("prune-lower-vs-lower", "analysis/peak.py",
             "(lm[a] >= hm[b]).all(axis=-1)", "(lm[a] >= lm[b]).all(axis=-1)", (PEAK,),
             "bounds dominance compares a's lower bound with b's lower, not its upper bound"),
    Mutation("prune-slack-off-by-one", "analysis/peak.py",
             "slack = sympy.Rational(int(den) - 1, int(den))",
             "slack = sympy.Rational(int(den) - 2, int(den))", (PEAK,),
             "ceiling/floor bounds 1/q too tight"),
    Mutation("prune-negative-coefficient-bound", "analysis/peak.py",
             "for mm, k in b[0 if v > 0 else 1].items():", "for mm, k in b[0].items():",
             (PEAK,), "an atom with a negative coefficient takes its lower bound"),
    Mutation("prune-lows-shifted", "analysis/peak.py",
             "low = {s: lows.get(s.name, 1) for s in symbols}",
             "low = {s: lows.get(s.name, 1) + 1 for s in symbols}", (PEAK,),
             "dominance proven only from one above the lower bounds"),
    # the caching allocator and its replay, against an independent simulation
    Mutation("allocator-rounds-to-256-bytes", "analysis/alloc_conf.py",
             "MIN_BLOCK = 512 ", "MIN_BLOCK = 256 ",
             ("tests/test_caching.py",), "requests rounded to 256-byte blocks"),
    Mutation("caching-round-off-by-one", "analysis/alloc_conf.py",
             "return -(-size // MIN_BLOCK) * MIN_BLOCK",
             "return (size // MIN_BLOCK + 1) * MIN_BLOCK", (REQ,),
             "a multiple of 512 B is rounded up a block more"),
    Mutation("caching-small-pool-strict", "analysis/caching.py",
             "pool = self.pools[size <= SMALL_SIZE]", "pool = self.pools[size < SMALL_SIZE]",
             (REQ,), "a 1 MiB request goes to the large pool"),
    Mutation("caching-first-fit", "analysis/caching.py",
             "        b = pool.blocks[keys[i]]\n        if b.segment is not None:",
             "        b = min((pool.blocks[k] for k in keys[i:] if k[0] == stream), "
             "key=lambda x: x.addr)\n        if b.segment is not None:", (REQ,),
             "first fit (lowest address) instead of best fit"),
    Mutation("allocator-split-threshold", "analysis/caching.py",
             "return size < self.conf.max_split_size and rest > SMALL_SIZE",
             "return size < self.conf.max_split_size and rest >= SMALL_SIZE",
             ("tests/test_caching.py", REQ),
             "a large block is split when exactly 1 MiB would remain"),
    Mutation("caching-large-segment-limit", "analysis/alloc_conf.py",
             "        if size < MIN_LARGE_ALLOC:\n            return self.large_segment_size",
             "        if size <= MIN_LARGE_ALLOC:\n            return self.large_segment_size",
             (REQ,), "a 10 MiB request takes a 20 MiB segment"),
    Mutation("caching-no-merge-with-next", "analysis/caching.py",
             "for other in (block.prev, block.next):", "for other in (block.prev,):", (REQ,),
             "a freed block does not merge with its free successor"),
    Mutation("caching-blocks-by-descending-address", "analysis/caching.py",
             "return (self.stream, self.size, self.addr)",
             "return (self.stream, self.size, -self.addr)", (REQ,),
             "free blocks keyed by descending address"),
    Mutation("replay-one-steady-walk", "analysis/reserved.py",
             "STEADY_WALKS = 6", "STEADY_WALKS = 1", (STEADY,),
             "the allocator replay keeps one steady walk"),
    Mutation("replay-stops-at-equal-figures", "analysis/reserved.py",
             "if figures() == last and now in seen:", "if figures() == last:",
             ("tests/test_replay_oracle.py::test_replay_reaches_the_long_run_after_a_quiet_walk",),
             "the replay stops at the first walk with the same figures, blocks still moving"),
    Mutation("replay-optimizer-state-at-forward", "analysis/reserved.py",
             "opt_at = run.phase_ends.get(Phase.BACKWARD) if trace.train else None",
             "opt_at = run.phase_ends.get(Phase.FORWARD) if trace.train else None", (STEADY,),
             "the lazily made optimizer state is taken at the end of forward"),
    # strategies
    Mutation("sequence-parallel-shards-hidden", "strategies/tp.py",
             "sequence_dim: int = 1", "sequence_dim: int = 2",
             ("tests/test_parallel.py::test_sequence_parallel_llama_matches_real_gloo_run",),
             "sequence parallelism shards the hidden dimension"),
    # optimizers
    Mutation("adam8bit-one-moment", "tracer/optimizers.py",
             '("adam8bit", 2, False)', '("adam8bit", 1, False)',
             ("tests/test_optimizers.py::test_named_optimizers_match_real_run[adam8bit]",
              "tests/test_optimizers.py::test_8bit_layout_equals_bitsandbytes[adam8bit-Adam8bit]"),
             "bitsandbytes' Adam8bit keeps one 8-bit moment instead of two"),
    Mutation("optimizer-state-only-parameter-shaped", "tracer/optimizer_state.py",
             "if isinstance(v, torch.Tensor):",
             "if isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape == p.shape):",
             ("tests/test_optimizers.py::test_adafactor_factors_second_moments",),
             "only parameter-shaped state counts as optimizer state: Adafactor's factors vanish"),
    # what is saved for backward
    Mutation("saved-only-with-grad-fn", "tracer/recorder.py",
             "self.mark_saved(t)", "if t.grad_fn is not None: self.mark_saved(t)",
             ("tests/test_lora.py::test_frozen_base_has_no_gradients_or_state",),
             "a saved tensor without grad_fn (an adapter's input behind frozen embeddings, a "
             "mask) is not counted as saved"),
    Mutation("saved-counts-inputs", "analysis/memory.py",
             "and s.saved and s.category is Category.ACTIVATION])",
             "and s.saved and s.category is not Category.PARAMETER])",
             ("tests/test_lora.py::test_frozen_base_has_no_gradients_or_state",),
             "saved activations also count saved inputs and buffers"),
    # LoRA / QLoRA
    Mutation("qlora-untied-lm-head-not-a-head", "strategies/lora.py",
             "id(mod.weight) in tied or io[1] in vocab", "id(mod.weight) in tied",
             ("tests/test_lora.py::test_qlora_matches_real_bitsandbytes_peft_run",),
             "an untied lm_head is not treated as a head: QLoRA quantizes it"),
    # budget and checkpoint plans
    Mutation("budget-max-batch-against-capacity", "analysis/budget.py",
             "b.max_batch = largest_fitting(model, report, point, batch, usable, notes, memo=memo[batch])",
             "b.max_batch = largest_fitting(model, report, point, batch, capacity, notes, "
             "memo=memo[batch])",
             ("tests/test_examples.py::test_largest_batch_equals_real_cpu_runs",),
             "the largest batch is solved against the whole capacity, not the usable part"),
    Mutation("last-true-skips-past-mid", "analysis/search.py",
             "            lo = mid", "            lo = mid + 1",
             ("tests/test_checkpoint.py::test_optimal_plan_fits_with_fewest_blocks_real_run",),
             "the bisection skips mid where the predicate holds: one block too many"),
    Mutation("optimal-plan-all-blocks-when-none-fits", "strategies/checkpoint.py",
             "    if peak(run(len(found))) > budget:\n        return None",
             "    if peak(run(len(found))) > budget:\n        return run(len(found))",
             ("tests/test_checkpoint.py::test_plans_over_a_range_of_S",),
             "where no plan fits, every block is advised"),
    Mutation("recompute-flops-whole-step", "strategies/checkpoint.py",
             "return PlanResult(list(plan), rep, total, sympy.expand(total - "
             "step_flops(base.train)))",
             "return PlanResult(list(plan), rep, total, sympy.expand(total))",
             ("tests/test_checkpoint.py::test_optimal_plan_fits_with_fewest_blocks_real_run",
              "tests/test_checkpoint_cnn.py::test_optimal_plan_fits_with_fewest_blocks_real_run"),
             "a plan's recomputation is counted as the whole step's FLOPs"),
    # ZeRO (DeepSpeed's engine)
    Mutation("zero2-configured-as-stage-1", "strategies/ds_engine.py",
             'z = {"stage": zero.stage,', 'z = {"stage": 1 if zero.stage == 2 else zero.stage,',
             ("tests/test_zero.py::test_zero2_matches_real_run_where_stage_1_differs",),
             "ZeRO-2 is handed to DeepSpeed as stage 1"),
    Mutation("lora-adapter-with-bias", "strategies/lora.py",
             "self.lora_A = torch.nn.Linear(fan_in, r, bias=False",
             "self.lora_A = torch.nn.Linear(fan_in, r, bias=True",
             ("tests/test_zero.py::test_zero_matches_real_deepspeed_run[lora-llama-z1-fp32]",),
             "LoRA's A adapter gets a bias peft does not give it"),
    Mutation("zero-autotp-lora-not-refused", "strategies/zero.py",
             'if given.get("lora") is not None:', "if False:",
             ("tests/test_zero.py::test_contradictions_name_the_setting",),
             "ZeRO with AutoTP and LoRA, which real DeepSpeed cannot run, is traced"),
    Mutation("fusedadam-traced-as-default-adamw", "strategies/zero.py",
             "return torch.optim.AdamW(params, fused=True)", "return torch.optim.AdamW(params)",
             ("tests/test_zero.py::test_zero_with_autotp_on_gpu",),
             "DeepSpeed's FusedAdam on CUDA traced as torch's default AdamW"),
    Mutation("zero-offload-master-grad-as-optimizer-state", "strategies/ds_engine.py",
             "recorder.set_category(t.grad, Category.GRADIENT)",
             "recorder.set_category(t.grad, Category.OPTIMIZER_STATE)",
             ("tests/test_zero.py::test_zero_offload_splits_device_and_host_on_gpu",),
             "the fp32 master partition's own .grad counted as optimizer state"),
    # the command line
    Mutation("cli-ignores-drop-outputs", "tracer/config.py",
             "value=lambda drop: Loop.DROP if drop else Loop.KEEP",
             "value=lambda drop: Loop.KEEP",
             ("tests/test_hf.py::test_cli_drop_outputs_and_a_misspelled_input",),
             "--drop-outputs is parsed and ignored"),
    # a strategy is one file; a step option one field
    Mutation("strategies-in-registration-order", "strategies/base.py",
             "key=lambda e: (e[1][1].order, e[0])", "key=lambda e: e[0]",
             (f"{REG}::test_registered_order_and_the_front_door_export",),
             "strategies apply in the order their files were imported, not their declared order"),
    Mutation("cli-builds-only-builtin-strategies", "strategies/compose.py",
             "got = cls.from_options(opts, step)",
             "got = cls.from_options(opts, step) if cls.__module__.startswith('memsim') else None",
             (f"{REG}::test_a_strategy_from_its_own_file_reaches_every_front",),
             "the command line reads the options of memsim's own strategies only"),
    Mutation("world-size-adds-dimensions", "strategies/compose.py", "out *= d", "out += d",
             (f"{REG}::test_world_size_is_the_product_over_mesh_dimensions",),
             "the world size adds the mesh dimensions instead of multiplying them"),
    # a Hugging Face model from its configuration (hf:PATH)
    Mutation("hf-config-not-in-cache-key", "memsim/entry.py",
             'hf = word[3:] if word.startswith("hf:") else ""', 'hf = ""',
             ("tests/test_hf_target.py::test_an_answer_kept_for_a_config_depends_on_its_content",),
             "a changed config.json is answered from the cache of the old one"),
    Mutation("hf-causal-lm-without-labels", "memsim/target.py",
             '        out.append("labels=int64[B,S]")', "        pass",
             ("tests/test_hf_target.py::test_a_config_on_disk_is_answered_as_a_real_run",),
             "a causal LM from its configuration is analysed without labels: no loss of its own"),
    Mutation("checkpoint-plan-hides-kv-cache", "strategies/checkpoint.py",
             'if getattr(getattr(model, "config", None), "use_cache", None) is True:\n        out.append(',
             'if False:\n        out.append(',
             ("tests/test_hf_target.py::test_a_checkpoint_plan_states_the_kv_cache_it_assumes",),
             "a Hugging Face model's checkpoint plan does not say it assumes the KV cache off"),
    Mutation("step-hash-misses-a-field", "tracer/config.py",
             "for f in dataclasses.fields(self)))",
             "for f in dataclasses.fields(self) if f.name != 'fold'))",
             (f"{REG}::test_step_options_come_from_the_fields",),
             "a StepConfig field left out of its hash (configs that differ in it collide)"),
    # data-dependent sizes (tracer/data_dependent.py)
    Mutation("data-dependent-count-one-short", "tracer/data_dependent.py",
             "    if bound.kind == \"fraction\":\n        return _ceil_fraction(most, bound.fraction)\n    return most",
             "    if bound.kind == \"fraction\":\n        return _ceil_fraction(most, bound.fraction)\n    return most - 1",
             ("tests/test_data_dependent.py::test_every_element_true_is_the_default_bound_and_exact_when_the_data_makes_it_hold",),
             "the maximum of a mask's count one short of every element"),
    Mutation("data-dependent-fraction-floored", "tracer/data_dependent.py",
             "return (n * f.numerator + f.denominator - 1) // f.denominator",
             "return (n * f.numerator) // f.denominator",
             ("tests/test_data_dependent.py::test_a_fraction_of_the_elements",),
             "a fraction of a count rounded down, not up"),
    Mutation("known-mask-not-counted-exactly", "tracer/data_dependent.py",
             "        return 0 if b[0] == b[1] == 0 else most",
             "        return 0 if b[0] == b[1] == 0 else _bounded(most, op)",
             ("tests/test_data_dependent.py::test_a_mask_the_run_knows_is_counted_exactly_with_nothing_assumed",),
             "a mask the run knows to be all true counted at the bound, with a note"),
    Mutation("nonzero-indices-not-known", "tracer/data_dependent.py",
             "        if idx is not None:\n            known.set_contents(out, idx)",
             "        if idx is None:\n            known.set_contents(out, idx)",
             ("tests/test_data_dependent.py::test_a_loop_over_the_values_of_a_small_data_dependent_tensor",),
             "the indices of a small all-true mask not known: a loop over them cannot run"),

    Mutation("branch-the-smaller-taken", "tracer/branching.py",
             "if there > here:", "if there < here:",
             ("tests/test_data_dependent.py::test_truth_values_read_without_data_take_the_branch_a_run_takes_or_the_larger",),
             "of two branches that both run, the one holding less answered"),
    Mutation("branch-raising-not-left", "tracer/branching.py",
             "given[b.site] = not b.value\n            notes.append",
             "given[b.site] = b.value\n            notes.append",
             ("tests/test_data_dependent.py::test_truth_values_read_without_data_take_the_branch_a_run_takes_or_the_larger",),
             "a branch on which the model raises retried as it was"),
    Mutation("range-against-counts-undecided", "tracer/known_data.py",
             "        if n is None or v is None or _expr(n) != _expr(v):\n            return False",
             "        if True:\n            return False",
             ("tests/test_data_dependent.py::test_a_truth_value_read_without_data_is_tried_both_ways",),
             "arange(n) < counts at n not decided: LED's mask of no global tokens counted full"),
    Mutation("ctc-alpha-one-short", "tracer/data_dependent.py",
             "(log_probs.shape[0], 2 * longest + 1)", "(log_probs.shape[0], 2 * longest)",
             ("tests/test_data_dependent.py::test_ctc_loss_and_a_check_that_raises_on_one_branch",),
             "CTC's log_alpha sized 2 L, not 2 L + 1"),

    Mutation("routing-max-per-expert-all-slots", "tracer/data_dependent.py",
             "        if bound.kind == \"max\":\n            return self.tokens\n",
             "        if bound.kind == \"max\":\n            return self.tokens * self.k\n",
             ("tests/test_data_dependent.py::test_mixture_of_experts_routing",),
             "an expert under max routing counted in every slot of every token"),
    Mutation("routing-every-expert-hit", "tracer/data_dependent.py",
             "return list(range(self.k if bound.kind == \"max\" else self.n))",
             "return list(range(self.n))",
             ("tests/test_data_dependent.py::test_mixture_of_experts_routing",),
             "under max routing every expert hit, not the k that take the tokens"),
    Mutation("one-hot-compares", "tracer/functions.py",
             "        if type(num_classes) is not int or num_classes < 0:\n            return None",
             "        if True:\n            return None",
             ("tests/test_data_dependent.py::test_mixture_of_experts_routing",),
             "F.one_hot left to the fake kernel's comparison (a boolean mask more)"),

    Mutation("json-conditions-dropped", "memsim/render.py",
             "\"conditions\": [formula(c) for c in ((*trace.conditions, *trace.step_conditions())",
             "\"conditions\": [formula(c) for c in (() and (*trace.conditions,)",
             ("tests/test_report_json.py",),
             "the JSON's formulas without the conditions they hold under"),
    Mutation("json-python-mod-unparsable", "memsim/formats.py",
             "swap = {tf.PythonMod: sympy.Mod,", "swap = {",
             ("tests/test_report_json.py",),
             "PyTorch's PythonMod left in a formula: sympy cannot evaluate it"),
    Mutation("left-aligned-not-branched", "tracer/data_dependent.py",
             "    v = decide(None)\n    if v is None:\n        return func(*args, **kwargs)\n    return bool(v)",
             "    return func(*args, **kwargs)",
             ("tests/test_data_dependent.py::test_torch_transformer_with_masks",),
             "nn.TransformerEncoder's left-aligned check sent to a kernel fake mode lacks"),
    Mutation("routing-tolist-not-followed", "tracer/kernels.py",
             "    if tokens is not None:\n        return tokens\n",
             "    if False:\n        return tokens\n",
             ("tests/test_data_dependent.py::test_mixture_of_experts_routing",),
             "JetMoE's tokens per expert read as sizes refused"),

    Mutation("inference-failure-kills-training", "analysis/build.py",
             "            if tr_step is None:\n                raise\n            # a failure only inference meets",
             "            if True:\n                raise\n            # a failure only inference meets",
             ("tests/test_data_dependent.py::test_a_failure_only_inference_meets_leaves_the_training_answer",),
             "an inference-only failure fails the whole analysis"),

    Mutation("interpolate-symbolic-size-refused", "tracer/functions.py",
             "        if len(out) != dim or not any(isinstance(s, torch.SymInt) for s in out):",
             "        if True:",
             ("tests/test_vision_sizes.py",),
             "F.interpolate by a symbolic size left to the composite (concrete sizes only)"),

    Mutation("usage-error-prints-usage", "memsim/options.py",
             "def parser() -> argparse.ArgumentParser:\n    p = _Parser(",
             "def parser() -> argparse.ArgumentParser:\n    p = argparse.ArgumentParser(",
             ("tests/test_errors.py::test_an_unknown_option_value_is_one_line_and_a_hint",),
             "argparse's whole usage printed above a usage error"),

    Mutation("misspelled-input-caught-after-the-trace", "tracer/step_checks.py",
             "            near = did_you_mean(n, known)\n            if near:",
             "            near = did_you_mean(n, known)\n            if False:",
             ("tests/test_errors.py::test_a_misspelled_input_is_caught_before_the_trace",),
             "a near miss of a forward parameter found only after the trace"),

    Mutation("position-limit-checked-after-the-trace", "memsim/cli.py",
             "        if point.get(name, 0) > most:",
             "        if False:",
             ("tests/test_errors.py::test_a_size_past_the_models_positions_is_refused_before_the_trace",),
             "a size past the model's positions found only after the trace"),

    Mutation("count-noted-unread", "tracer/known_data.py",
             "            self.because[st] = bound_note(\"a count of true elements\")",
             "            self.because[st] = bound_note(\"a count of true elements\")\n"
             "            assume(self.because[st])",
             ("tests/test_data_dependent.py::test_a_mask_the_run_knows_is_counted_exactly_with_nothing_assumed",),
             "a count of true elements noted where it is made, not where a size reads it"),

    Mutation("count-element-not-read", "tracer/known.py",
             "            if size is None and self.exactly and type(t.numel()) is int and t.numel() == 1:",
             "            if False:",
             ("tests/test_data_dependent.py::test_an_element_of_counts_read_as_a_size",),
             "one element of counts of true elements read as a number refused"),


    Mutation("step-not-applied-to-the-input", "tracer/run_context.py",
             "                symints[name] = symints[name] * step",
             "                pass",
             ("tests/test_multiples.py::test_a_stepped_symbol_has_polynomial_formulas_equal_to_real_runs",),
             "a stepped symbol's input sized by its count of steps"),

    Mutation("step-not-divided-back", "tracer/trace.py",
             "    to_user = {raw: user[n] / table.steps.get(n, 1) for n, raw in table.raw.items()}",
             "    to_user = {raw: user[n] for n, raw in table.raw.items()}",
             ("tests/test_multiples.py::test_a_stepped_symbol_has_polynomial_formulas_equal_to_real_runs",),
             "formulas of a stepped symbol in its count of steps"),

    Mutation("step-range-not-scaled", "tracer/trace.py",
             "        ranges[name] = (lower[raw] * step, hi)",
             "        ranges[name] = (lower[raw], hi)",
             ("tests/test_multiples.py::test_a_stepped_symbol_has_polynomial_formulas_equal_to_real_runs",),
             "a stepped symbol's range in steps, not sizes"),

    Mutation("step-condition-ignored", "analysis/memory.py",
             "        return [c for c in (*self.trace.conditions, *self.trace.step_conditions())",
             "        return [c for c in (*self.trace.conditions, *())",
             ("tests/test_multiples.py::test_a_stepped_symbol_has_polynomial_formulas_equal_to_real_runs",),
             "a size off the step answered from the formulas"),

    Mutation("off-step-size-crossed", "analysis/explore.py",
             "             and not (n in steps and (v % steps[n] or v < report.ranges[n][0]))}",
             "             }",
             ("tests/test_multiples.py::test_a_stepped_symbol_has_polynomial_formulas_equal_to_real_runs",),
             "a size off the step traced at another example size instead of at that size"),

    Mutation("division-remainder-unchecked", "tracer/divisions.py",
             "    if not (_nonnegative(r, lower) and _nonnegative(sympy.expand(b - r - 1), lower)):",
             "    if False:",
             ("tests/test_doctests.py",),
             "a floor division replaced by its quotient where the remainder can exceed the divisor"),

    # (without a step at all Swin's trace runs for minutes: the test would time out, not fail)
    Mutation("swin-step-wrong", "tracer/hf.py",
             "        step = patch * window * 2 ** (len(depths) - 1)",
             "        step = patch * window * 2 ** len(depths)",
             ("tests/test_vision_sizes.py::test_swin_is_traced_at_multiples_of_its_step",),
             "Swin's step not the one its stages pad to"),

    Mutation("asked-sizes-not-tried", "tracer/example_sizes.py",
             "    for pt in points or ():\n        add(",
             "    for pt in ():\n        add(",
             ("tests/test_example_sizes.py::test_the_sizes_asked_for_are_tried_first",),
             "the sizes asked for not tried when the example sizes fail"),

    Mutation("named-sizes-not-tried", "tracer/example_sizes.py",
             "                    if 2 <= int(x) <= 4096} - set(hints.values()))[:4]",
             "                    if False} - set(hints.values()))[:4]",
             ("tests/test_example_sizes.py::test_multiples_of_a_size_the_failure_names",),
             "multiples of the sizes a failure names not tried"),

    Mutation("retry-past-the-limit", "tracer/example_sizes.py",
             "            n not in limits or v <= limits[n])",
             "            True)",
             ("tests/test_example_sizes.py::test_retried_sizes_stay_within_limits_and_steps",),
             "example sizes past the model's limit tried"),

    Mutation("fit-past-the-limit", "analysis/build.py",
             "        config = config.replace(limits={**hf.limits(model, inputs), **config.limits})",
             "        pass",
             ("tests/test_example_sizes.py::test_reformer_at_its_fixed_length",),
             "a pinned symbol fitted at sizes past the model's positions"),

    Mutation("whole-range-max-unknown", "tracer/known.py",
             "        if func in _EXTREMES and self._whole_range(func, args, out):",
             "        if False:",
             ("tests/test_example_sizes.py::test_reformer_at_its_fixed_length",),
             "the largest id of an expanded arange read as unknown (Reformer's inference refused)"),

    Mutation("fit-sizes-one-at-a-time", "analysis/fitted.py",
             "                    retracer.ahead({name: ahead}, already)",
             "                    pass",
             ("tests/test_fit.py::test_a_fits_sizes_are_traced_two_at_a_time",),
             "a fit's next size not traced beside the one before it"),

    Mutation("fit-answers-off-the-step", "analysis/fitted.py",
             "        if 1 <= x < lo or x % step:",
             "        if 1 <= x < lo:",
             ("tests/test_vision_sizes.py::test_mobilenet_v2_is_fitted_at_multiples_of_its_output_stride",),
             "a fitted stepped symbol answered from the fit at a size off its step"),

    Mutation("answer-not-first", "memsim/render.py",
             "    out = [] if verdict is None else [answer_line(verdict), *options_lines(verdict), \"\"]",
             "    out = []",
             ("tests/test_cli.py::test_the_answer_comes_first",),
             "the verdict buried in the budget section instead of the first line"),

    Mutation("compare-progress-unnamed", "memsim/cli.py",
             "            _SHOWN.what = (f\"configuration {i} of {len(prepared)} \"",
             "            _SHOWN.what = None and (f\"configuration {i} of {len(prepared)} \"",
             ("tests/test_cli.py::test_compare_progress_names_the_configuration",),
             "compare's progress not saying which configuration it traces"),

    Mutation("traces-needed-unannounced", "analysis/build.py",
             "    progress.expect(int(bool(train)) + int(bool(inference)))\n",
             "",
             ("tests/test_cli.py::test_progress_on_stderr",),
             "the progress saying 'trace 1 of 1' where the step and inference are both traced"),

    Mutation("rank-traces-unannounced", "strategies/compose.py",
             "        progress.expect(per_rank * left)\n",
             "",
             ("tests/test_pipeline.py::test_progress_names_the_rank_traced",),
             "the progress counting one rank's traces where every pipeline rank is traced"),

    Mutation("compare-traces-unannounced", "memsim/cli.py",
             "        progress.expect(len(prepared) - i + 1)   # this one and those after it\n",
             "",
             ("tests/test_cli.py::test_compare_progress_names_the_configuration",),
             "compare's progress counting one configuration's traces of several"),

    Mutation("time-left-from-unfinished-runs", "tracer/progress.py",
             "    took = [s for n, s in _took if n > since]",
             "    took = [s for n, s in _took]",
             ("tests/test_progress.py",),
             "the estimate of the time left fed by runs of earlier commands"),

    Mutation("offload-offered-on-a-cpu", "memsim/suggest.py",
             "    if config.device != \"cuda\":\n        return None\n    zero = strategy",
             "    zero = strategy",
             ("tests/test_suggest.py::test_what_would_make_it_fit_equals_real_runs_with_each_option",),
             "offload listed where host and device are one memory (its figure the same sum)"),

    Mutation("offload-leaves-stage-3-parameters", "memsim/suggest.py",
             "        params = zero.stage == 3",
             "        params = False",
             ("tests/test_suggest.py::test_offload_is_an_option_traced_on_a_gpu",),
             "ZeRO-3's offload option keeping the parameter partitions on the device"),

    Mutation("offload-under-autocast-bf16", "memsim/suggest.py",
             "    if config.precision is Precision.BF16_MIXED:",
             "    if False:",
             ("tests/test_suggest.py::test_offload_is_an_option_traced_on_a_gpu",),
             "the offload option under bf16-mixed, which DeepSpeed does not run"),

    Mutation("model-file-error-unwrapped", "memsim/target.py",
             "            except Exception as e:\n                raise _failed(where, e) from e\n"
             "            finally:",
             "            finally:",
             ("tests/test_errors.py::test_a_model_file_that_raises_names_its_line",),
             "a model file raising as it loads shown as memsim's own traceback"),

    Mutation("plan-accumulation-shares-a-program", "memsim/plan.py",
             "        return (*self.degrees, self.accumulate > 1)",
             "        return (*self.degrees, False)",
             ("tests/test_plan.py::test_accumulation_is_one_program_and_memory_rises_with_the_micro_batch",),
             "a layout with gradient accumulation answered from the trace without it (the "
             "first micro-step's gradients missing from the second's forward)"),

    Mutation("plan-recomputation-ranked-first", "memsim/plan.py",
             "    \"default\": lambda r: (r.layout.checkpoint != \"none\", r.layout.tp,",
             "    \"default\": lambda r: (r.layout.checkpoint == \"none\", r.layout.tp,",
             ("tests/test_plan.py::test_ranking_rules",),
             "the plan preferring checkpointed layouts over those that fit without"),

    Mutation("plan-states-reason-lost", "memsim/plan.py",
             "            if r.states is not None and r.states >= usable:",
             "            if False:",
             ("tests/test_plan.py::test_plan_text_names_the_best_layout_and_the_reasons",),
             "a layout whose model states alone exceed the card blamed on its activations"),

    Mutation("plan-batch-divisibility-unchecked", "memsim/plan.py",
             "            if global_batch % dp:\n",
             "            if False:\n",
             ("tests/test_plan.py::test_layouts_reach_the_global_batch",),
             "a data-parallel degree that cannot reach the global batch planned anyway"),

    Mutation("plan-traced-after-loading", "memsim/cli.py",
             "    check_rank_by(args.rank_by)\n",
             "",
             ("tests/test_plan.py::test_errors_come_before_any_trace",),
             "an unknown --rank-by found only after the model is loaded and traced"),

    Mutation("plan-cluster-task-not-retried", "memsim/plan_run.py",
             "            task = ray.remote(max_retries=3)(answer)",
             "            task = ray.remote(max_retries=0)(answer)",
             ("tests/test_plan_cluster.py::test_a_ray_cluster_gives_the_plan_this_process_gives_and_loses_no_layout",),
             "a plan on a cluster losing the layouts of a task whose worker died"),

    Mutation("plan-cluster-prints-on-stdout", "memsim/plan_run.py",
             "    with contextlib.redirect_stdout(sys.stderr):\n        try:\n            task",
             "    with contextlib.nullcontext():\n        try:\n            task",
             ("tests/test_plan_cluster.py::test_a_ray_cluster_gives_the_plan_this_process_gives_and_loses_no_layout",),
             "Ray's report of a dead worker printed into --json's document"),

    Mutation("plan-page-verdict-after-picture", "memsim/render_plan.py",
             "    parts = [head, f\"<p>{r.traces} traces answered \"",
             "    parts = [f\"<p>{r.traces} traces answered \"",
             ("tests/test_plan.py::test_the_html_page_answers_first",),
             "the plan's page without its answer at the top"),

    Mutation("other-warnings-not-held", "memsim/cli.py",
             "    logging.Logger.handle = hold\n",
             "",
             ("tests/test_cli.py::test_other_libraries_warnings_come_after_the_answer",),
             "another library's logging warning printed while tracing, before the answer"),

    Mutation("cut-run-progress-unsaid", "tracer/fold_stack.py",
             "    mod.__dict__[\"_memsim_whole\"] = len(saved)",
             "    pass",
             ("tests/test_cli.py::test_progress_on_stderr",),
             "a folded stack's cut run shown as if the model had only its blocks (4 / 5)"),

    Mutation("pp-sends-not-held", "strategies/pipeline.py",
             "            return [HeldWork(w, [op.tensor]) for w, op in zip(works, p2p_ops)]",
             "            return works",
             ("tests/test_pipeline.py::test_every_pipeline_rank_equals_a_real_gloo_run",),
             "a pipeline send released at once, where gloo's Work holds it until dropped"),
    Mutation("pp-other-stages-kept", "strategies/pipeline.py",
             "                model._modules[name] = nn.Identity()",
             "                pass",
             ("tests/test_pipeline.py::test_a_rank_holds_only_its_own_stages",),
             "a pipeline rank holding every stage's parameters"),
    Mutation("pp-warmup-grads-unlabelled", "strategies/pipeline.py",
             "        self.label_gradients(recorder)   # the warm-up step's, alive until zero_grad",
             "        pass",
             ("tests/test_pipeline.py::test_every_pipeline_rank_equals_a_real_gloo_run",),
             "the previous step's gradients counted in a pipeline rank's activation peak"),
    Mutation("pp-uneven-split-last-first", "strategies/pipeline.py",
             "                at += per + (1 if s < extra else 0)",
             "                at += per + (1 if s >= k - extra else 0)",
             ("tests/test_pipeline.py",),
             "the children that do not divide given to the last stages"),
    Mutation("pp-decoder-loss-of-the-logits", "strategies/pipeline.py",
             "            if target is None:\n                return loss_fn(out)",
             "            if True:\n                return loss_fn(out)",
             ("tests/test_pipeline.py::"
              "test_a_hugging_face_decoder_by_its_layers_equals_a_real_gloo_run",),
             "a decoder's last stage taking the loss of its logits, not its own loss of the "
             "labels"),
    Mutation("pp-decoder-embeddings-on-every-rank", "strategies/pipeline.py",
             "        if 0 not in ids:\n            base.embed_tokens = nn.Identity()",
             "        if False:\n            base.embed_tokens = nn.Identity()",
             ("tests/test_pipeline.py::"
              "test_a_hugging_face_decoder_by_its_layers_equals_a_real_gloo_run",),
             "every pipeline rank holding the decoder's embeddings"),
    Mutation("largest-size-off-the-step", "analysis/budget.py",
             "    step = report.config.multiples.get(name, 1)\n",
             "    step = 1\n",
             ("tests/test_multiples.py::"
              "test_the_largest_stepped_size_that_fits_is_a_multiple_of_its_step",),
             "the largest size that fits searched over every integer, off a stepped symbol's "
             "step (a pipeline's batch that its micro-batches do not split)"),
    Mutation("pp-no-autocast", "strategies/pipeline.py",
             "        with forward_context(self.precision):",
             "        with forward_context(type(self.precision).TRUE32):",
             ("tests/test_pipeline.py::test_bf16_autocast_around_the_schedule_equals_a_real_run",),
             "a pipeline step traced without the step's autocast"),
    Mutation("verdict-about-the-shown-rank", "memsim/cli.py",
             "        report = worst_rank(report, point)\n",
             "",
             ("tests/test_pipeline.py::"
              "test_the_verdict_is_about_the_rank_whose_peak_is_largest_at_the_point",),
             "the verdict about the rank largest at the example sizes, not at the point"),
    Mutation("largest-size-of-one-rank", "memsim/cli.py",
             "                if theirs is not None and (mine is None or theirs < mine):",
             "                if False:",
             ("tests/test_pipeline.py::"
              "test_the_verdict_is_about_the_rank_whose_peak_is_largest_at_the_point",),
             "the largest batch that fits one rank, where another rank runs out first"),
    Mutation("fit-option-not-applied", "memsim/suggest.py",
             "                         **{**strategy, **extra})",
             "                         **strategy)",
             ("tests/test_suggest.py::test_what_would_make_it_fit_equals_real_runs_with_each_option",),
             "an option's figure traced without the option"),
    Mutation("fit-options-unsorted", "memsim/suggest.py",
             "    return ok + rest\n",
             "    return rest + ok\n",
             ("tests/test_suggest.py::test_what_would_make_it_fit_equals_real_runs_with_each_option",),
             "the options that do not fit listed before those that do"),
    Mutation("progress-rank-unsaid", "memsim/cli.py",
             "        rank = progress.context()\n",
             "        rank = None\n",
             ("tests/test_pipeline.py::test_progress_names_the_rank_traced",),
             "the progress of a strategy's ranks not saying which rank is traced"),
    Mutation("pp-saved-tensors-temporaries", "tracer/step.py",
             "    recorder.run.interleaved = driver.owns_backward\n",
             "    recorder.run.interleaved = False\n",
             ("tests/test_pipeline.py::"
              "test_what_a_micro_batch_keeps_for_its_backward_is_an_activation",),
             "what a pipeline's micro-batch keeps for its backward labelled a temporary"),
    Mutation("pp-batch-not-split-evenly", "strategies/pipeline.py",
             "        return config.replace(multiples={**config.multiples, dim: step})",
             "        return config",
             ("tests/test_pipeline.py::test_every_pipeline_rank_equals_a_real_gloo_run",),
             "the batch traced at any size, its micro-batches uneven"),
    Mutation("pointwise-contiguous-strides", "tracer/pointwise.py",
             "        strides = compute_elementwise_output_strides(*args)",
             "        strides = torch._prims_common.make_contiguous_strides_for(args[0].shape)",
             ("tests/test_pointwise.py",),
             "a fast pointwise output contiguous whatever its operands' layout"),
    Mutation("pointwise-inplace-copy", "tracer/pointwise.py",
             "            return self\n",
             "            return torch.empty_like(self)\n",
             ("tests/test_pointwise.py",),
             "an in-place pointwise op's fast kernel returns a new tensor"),
    Mutation("pointwise-int-promotion", "tracer/pointwise.py",
             "    _aten.tanh.default: (_FLOAT, False),",
             "    _aten.tanh.default: (_SAME, False),",
             ("tests/test_pointwise.py",),
             "tanh of an integer tensor keeps its dtype"),
    Mutation("pp-fsdp-default-group", "strategies/pipeline.py",
             "                                output_args=outs[s].requires_grad_(True), group=group)",
             "                                output_args=outs[s].requires_grad_(True), group=None)",
             ("tests/test_pipeline.py::test_pipeline_with_fsdp2_equals_real_gloo_runs",),
             "pipeline stages under FSDP2 talk over the whole world instead of their pp group"),
    Mutation("pp-fsdp-ranks-alike", "strategies/pipeline.py",
             "                            for c in rank_classes(plan.model, fsdp, tp))",
             "                            for c in [tuple(range(inner))])",
             ("tests/test_pipeline.py::test_pipeline_with_fsdp2_equals_real_gloo_runs",),
             "every data-parallel rank of a pipeline rank taken alike, shards uneven or not"),
    Mutation("pp-fsdp-stage-only", "strategies/pipeline.py",
             "                    self.fsdp.shard_stage(mod, self.split.pieces(mod), dp_mesh)",
             "                    self.fsdp.shard_stage(mod, [], dp_mesh)",
             ("tests/test_pipeline.py::test_pipeline_with_fsdp2_equals_real_gloo_runs",),
             "a pipeline stage sharded as one FSDP2 unit, not block by block"),
    Mutation("fake-module-holds-last", "tracer/run_context.py",
             "        new = t = None\n",
             "\n",
             ("tests/test_pipeline.py::test_pipeline_with_fsdp2_equals_real_gloo_runs",),
             "the run's fake-parameter swap keeps the last parameter made alive"),
    Mutation("pp-tp-wrong-mesh", "strategies/pipeline.py",
             "                    tp.parallelize(model, pipeline_meshes(pp.pp, dp, tp_n, rank)[2])",
             "                    tp.parallelize(model, pipeline_meshes(pp.pp, dp, tp_n, rank)[1])",
             ("tests/test_pipeline.py::test_pipeline_with_tensor_parallelism_equals_real_gloo_runs",),
             "a pipeline rank's layers sharded over its data-parallel group, not its TP group"),
    Mutation("pp-tp-ranks-forgotten", "strategies/pipeline.py",
             "                            for c in rank_classes(plan.model, fsdp, tp))",
             "                            for c in rank_classes(plan.model, fsdp, None))",
             ("tests/test_pipeline.py::test_pipeline_with_tensor_parallelism_equals_real_gloo_runs",),
             "the tensor-parallel ranks of each pipeline rank left out of the ranks listed"),
    Mutation("html-blocks-not-grouped", "memsim/plots.py",
             '        key = (re.sub(r"(^|\\.)\\d+(?=\\.|$)", r"\\1*", g.module), g.category)',
             "        key = (g.module, g.category)",
             ("tests/test_report_html.py",),
             "the live-at-the-peak table lists every block of a stack on its own"),
    Mutation("timeline-reserved-squashes", "memsim/plots.py",
             "    clipped = most > 3 * tl.peak",
             "    clipped = False",
             ("tests/test_timeline.py",),
             "a reserved line far above the step scales the axis, the step squashed at its foot"),
    Mutation("timeline-card-squashes", "memsim/plots.py",
             "        (cards if b <= 2 * data else above).append((label, b, style))",
             "        cards.append((label, b, style))",
             ("tests/test_report_html.py",),
             "a card far above the step drawn, scaling the axis"),
    Mutation("timeline-no-oom-marker", "memsim/plots.py",
             "            first = next((j for j, v in enumerate(tl.reserved) if v > limit), None)",
             "            first = None",
             ("tests/test_report_html.py",),
             "where the allocator confined to the card runs out is not marked"),
    Mutation("timeline-thin-loses-highs", "memsim/plots.py",
             "        keep.append(max(range(lo, min(hi, n)), key=tl.totals.__getitem__))",
             "        keep.append(lo)",
             ("tests/test_timeline.py",),
             "a long step drawn at the first event of each column, its highs (the peak) lost"),
    Mutation("scaling-point-unmarked", "memsim/plots.py",
             "            if c.at is not None and c.at <= right:",
             "            if False:",
             ("tests/test_scaling.py",),
             "the size asked for is not marked on the curve"),
    Mutation("scaling-whole-range", "memsim/plots.py",
             "        right = min(max(max(c.sizes) for c in cs), max(2 * max(interest), 8))",
             "        right = max(max(c.sizes) for c in cs)",
             ("tests/test_scaling.py",),
             "the size axis runs over every size drawn, not the useful range"),
    Mutation("timeline-output-is-activation", "analysis/timeline.py",
             '        return OUTPUT if st.held or st.op.startswith("<previous ") else st.category.value',
             "        return st.category.value",
             ("tests/test_timeline.py",),
             "the output and loss the loop holds drawn as activations"),
    Mutation("progress-traces-uncounted", "tracer/trace.py",
             "    progress.started()\n",
             "\n",
             ("tests/test_cli.py",),
             "progress never says which of the command's traces it is in"),
    Mutation("mesh-recorded", "tracer/recorder.py",
             "        with _disable_current_modes():\n            return fn(*args, **kwargs)",
             "        with torch._subclasses.fake_tensor.unset_fake_temporarily():\n"
             "            return fn(*args, **kwargs)",
             ("tests/test_pipeline.py::test_pipeline_with_fsdp2_equals_real_gloo_runs",),
             "a device mesh a pipeline rank builds while recording counted as the step's memory"),
    Mutation("budget-cache-claimed-after-oom", "memsim/render.py",
             "        if k == \"allocator_cache\" and b.replay is not None and b.replay.oom is not None:",
             "        if False:",
             ("tests/test_report_html.py",),
             "the budget's text says the allocator caches 0 B where its replay ran out"),
    Mutation("allocator-limit-whole-usable", "analysis/budget.py",
             '    return usable - overhead["cuda_context"] - overhead["comm_buffers"]',
             "    return usable",
             ("tests/test_report_html.py",),
             "the allocator confined to the usable share with the CUDA context inside it"),
    # expert parallelism (strategies/ep.py, tracer/known_data.py's Tallies)
    Mutation("ep-exchange-from-rank-0", "tracer/known_data.py",
             "mine = at.reshape(-1)[me * each:(me + 1) * each]",
             "mine = at.reshape(-1)[0:each]",
             ("tests/test_ep.py::test_every_expert_rank_equals_a_real_gloo_run",),
             "every expert rank receives the tokens of the first rank's experts"),
    Mutation("ep-counts-without-bound", "tracer/known_data.py",
             "counts = [route.tokens_of(e, bound) if e < route.n else 0 for e in range(n)]",
             "counts = [route.tokens if e < route.n else 0 for e in range(n)]",
             ("tests/test_ep.py::test_every_expert_rank_equals_a_real_gloo_run",),
             "every expert counted at all the tokens, whatever the routing bound"),
    Mutation("ep-ranks-not-by-expert-rank", "strategies/ep.py",
             "sig = (r % ep,) + tuple(", "sig = () + tuple(",
             ("tests/test_ep.py::test_every_expert_rank_equals_a_real_gloo_run",),
             "the expert ranks grouped as one, the first one's figures for all"),
    Mutation("ep-dp-divisibility-unchecked", "strategies/ep.py",
             "        if fsdp.dp % self.ep:\n", "        if False:\n",
             ("tests/test_ep.py::test_bad_layouts_are_refused_before_any_trace",),
             "an --ep that does not divide --dp goes on to the trace"),
    Mutation("ep-even-routing-note-at-max", "memsim/cli.py",
             'config.replace(data_dependent="balanced")', "config",
             ("tests/test_ep.py::test_the_command_line_names_the_degree",),
             "the even routing's figure beside the verdict traced at the worst case again"),
    Mutation("ep-even-routing-note-twice", "memsim/cli.py",
             "        budget.notes = [*budget.notes, text]   # said with the verdict, not again above it\n"
             "        return report, shown\n",
             "        budget.notes = [*budget.notes, text]   # said with the verdict, not again above it\n",
             ("tests/test_ep.py::test_the_command_line_names_the_degree",),
             "the even routing's figure said twice, above the verdict and with it"),
    # memsim plan: expert parallelism searched, programs in a pool of processes
    Mutation("plan-ep-not-searched", "memsim/plan.py",
             "        eps = [1] + [e for e in _divisors(dp)", "        eps = [1] + [e for e in ()",
             ("tests/test_plan.py::test_a_mixture_of_experts_is_planned_with_expert_parallelism",),
             "a mixture of experts planned without its expert-parallel layouts"),
    Mutation("plan-pool-no-second-round", "memsim/plan_run.py",
             "    for _ in range(2):\n        failed = {}", "    for _ in range(1):\n        failed = {}",
             ("tests/test_plan.py::test_processes_give_the_plan_this_process_gives",),
             "the programs a dead process left unanswered are not run again"),

]

# mutations no test can kill, with the reason (name -> why)
KNOWN_SURVIVORS: dict[str, str] = {}


def stage(into: str) -> str:
    """Copy the package, laid out as installed, under ``into``; returns the folder to put on
    ``PYTHONPATH``."""
    for pkg, src in LAYOUT.items():
        shutil.copytree(os.path.join(ROOT, src), os.path.join(into, pkg),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return into


def staged_path(staging: str, path: str) -> str:
    """Where the repository file ``path`` lies in the staged package."""
    top, _, rest = path.partition("/")
    for pkg, src in LAYOUT.items():
        if src == top:
            return os.path.join(staging, pkg, rest)
    raise SystemExit(f"{path}: not in the engine's packages ({', '.join(LAYOUT.values())})")


def apply(staging: str, m: Mutation) -> str | None:
    """Apply ``m`` to the staged copy; None, or why it could not be applied."""
    target = staged_path(staging, m.path)
    with open(target) as f:
        text = f.read()
    count = text.count(m.old)
    if count != 1:
        return f"stale: the text to mutate occurs {count} times in {m.path}"
    with open(target, "w") as f:
        f.write(text.replace(m.old, m.new))
    return None


def staged_env(staging: str) -> dict:
    """The environment that imports memsim from ``staging``: first on ``PYTHONPATH``, and
    ``PYTHONSAFEPATH`` so that no Python process (the tests' subprocesses too) puts the
    repository's own ``memsim/`` ahead of it from the working directory. The repository's root
    comes second, for what is only there (``tests.support``, ``benchmarks``)."""
    path = [staging, ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONSAFEPATH="1",
                PYTHONDONTWRITEBYTECODE="1")


def run_tests(staging: str, tests: tuple[str, ...], extra: list[str]) -> tuple[int, float, str]:
    env = staged_env(staging)
    start = time.monotonic()
    # -m "": the tests named run whatever their markers (wide and heavy are deselected by
    # default)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "--no-header",
                           "--import-mode=importlib", "-m", "", *extra,
                           *tests], cwd=ROOT, env=env, capture_output=True, text=True)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, time.monotonic() - start, (out[-1] if out else "")


_CHECKED: list[str] = []


def check_staging(staging: str) -> None:
    """The staged copy, not the editable install, is what the tests import, and the tests'
    helpers are the repository's (checked for the first copy: every copy is staged the same
    way)."""
    if _CHECKED:
        return
    _CHECKED.append(staging)
    env = staged_env(staging)
    code = "import memsim.analysis as a, tests.support as s; print(a.__file__); print(s.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    where = done.stdout.split()
    if done.returncode or not where[0].startswith(staging):
        raise SystemExit(f"the tests would import memsim from {where[:1]!r}, not the staged "
                         f"copy: {done.stderr.strip()[-500:]}")
    if not where[1].startswith(os.path.join(ROOT, "tests")):
        raise SystemExit(f"the tests would import their helpers from {where[1]!r}")


def mutate(m: Mutation, extra: list[str]) -> tuple[str, float, str]:
    """('killed' | 'survived' | 'stale' | 'error', seconds, pytest's last line)."""
    with tempfile.TemporaryDirectory(prefix="memsim-mutant-") as tmp:
        staging = stage(tmp)
        check_staging(staging)
        why = apply(staging, m)
        if why is not None:
            return "stale", 0.0, why
        rc, secs, last = run_tests(staging, m.tests, extra)
    # pytest: 0 all passed, 1 some failed; 2-5 interrupted, internal or usage error, none ran
    status = {0: "survived", 1: "killed"}.get(rc, "error")
    return status, secs, last


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print the mutations' names")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    ap.add_argument("--file", help="an ad-hoc mutation: the file (repository-relative)")
    ap.add_argument("--old", help="an ad-hoc mutation: the exact text to replace")
    ap.add_argument("--new", help="an ad-hoc mutation: its replacement")
    ap.add_argument("--tests", nargs="+", help="an ad-hoc mutation: pytest arguments")
    ap.add_argument("--pytest-args", default="", help="more arguments for every pytest run")
    args = ap.parse_args(argv)
    names = [m.name for m in MUTATIONS]
    if len(set(names)) != len(names):
        raise SystemExit("two mutations share a name")
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name}: {m.path}  {m.what}")
        return 0
    if args.file:
        if not (args.old and args.new is not None and args.tests):
            raise SystemExit("--file needs --old, --new and --tests")
        chosen = [Mutation("ad-hoc", args.file, args.old, args.new, tuple(args.tests))]
    else:
        unknown = set(args.only or ()) - set(names)
        if unknown:
            raise SystemExit(f"unknown mutation(s): {', '.join(sorted(unknown))}")
        chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    extra = args.pytest_args.split()
    results = []
    for m in chosen:
        status, secs, last = mutate(m, extra)
        if status == "survived" and m.name in KNOWN_SURVIVORS:
            status = "known survivor"
        results.append((m, status))
        print(f"{status:>14}  {m.name}  ({secs:.0f} s)  {last}", flush=True)
        if status == "known survivor":
            print(f"{'':>16}why: {KNOWN_SURVIVORS[m.name]}")
    killed = sum(s == "killed" for _, s in results)
    print(f"\nscore: {killed} of {len(results)} mutations killed"
          + "".join(f"; {sum(s == k for _, s in results)} {k}"
                    for k in ("survived", "known survivor", "stale", "error")
                    if any(s == k for _, s in results)))
    return 0 if all(s in ("killed", "known survivor") for _, s in results) else 1


if __name__ == "__main__":
    sys.exit(main())

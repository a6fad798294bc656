"""DPPO is unbiased as users run it: bench/unbiasedness.py drives the trainer's own step (ExperienceMaker: prompt draw
from a pool four steps' worth, prompt level, rewards, advantages, history, full-batch counts, DAPO filter, completion
level) over a fixed world, 12,000 draws per shipped configuration, every loss aggregation, and Dense Prompt Packing
at DP=2. Each draw is compared with its own drawn prompts' full batch.

Tolerances: an unbiased configuration's mean gradient is within 3 standard errors of the gradient it estimates (the
drawn samples over the rule's count) along that gradient's direction (one z-score per configuration and aggregation),
within 4 standard errors on every coordinate (16 coordinates x 3 aggregations x 19 pairs of an unbiased configuration
and a rollout correction: with fixed seeds the outcome is reproducible, and at 4 SE a true-zero bias exceeds it
somewhere with probability about 5%), with a scale standard error under 2% (enough to show a 6% bias; the bench's
default of 20,000 draws keeps it under 1.5%, the test runs 12,000 for the suite's time); the gradient through packing
equals the linear form Σ w_i ∇f_i / Z to 1e-6 relative (the packed batch holds the sample weights in float32), and
each draw's normaliser is the rule's, computed from the draw alone. Against the full batch's loss (the drawn
candidates' real counts): with exact history lengths the scale is 1 within 3 SE; with stale ones (recorded when the
answers were up to 40% shorter) the token-mean scale is the predicted real count / the rule's count within 3 SE,
about 1.22, many SE from 1, so the check can tell them apart. Deterministic DPPO, DPPO without importance weights,
DAPO's dynamic sampling, CPPO and D3S are shown biased: relative error above 20%, against their own full batch or the
real one (dynamic sampling draws whole varied groups, so its bias is its normaliser, the kept batch's). The shipped
configurations include the prompt level's refill (a fixed draw of M = B / (1 - rate) candidates of which the
systematic design keeps exactly B, or the previous Bernoulli coins), its prior for prompts never seen, the in-step
probe (two of a group's samples first, then exactly B groups continued, weighted 1 / P(continue)), and partial
rollouts (each draw continued chunk by chunk over two steps, trained whole; the weights do not change here, so this
covers their bookkeeping, the off-policy part aside). With an engine that disagrees with the trainer, the embedded
default's draws are unbiased under each of the six rollout corrections for the full batch with the same correction
(the same standards; a power of 4.5% scale SE there, its gradients being noisier), and each correction moves that
gradient (so none is checked while doing nothing).
"""

import json
import subprocess
import sys

import pytest

from megatron_dppo.launch.rollout_correction_flags import ROLLOUT_CORRECTIONS
from tests.launch import REPO_ROOT, kill_group

BENCH = REPO_ROOT / "bench" / "unbiasedness.py"
DRAWS = 12_000
NUM_CONFIGURATIONS = 19
CORRECTED = "embedded default, engine disagrees, every correction"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """The bench's rows, its configurations split over two processes (one per core)."""
    out = tmp_path_factory.mktemp("unbiasedness")
    halves = [list(range(0, NUM_CONFIGURATIONS, 2)), list(range(1, NUM_CONFIGURATIONS, 2))]
    processes = []
    for index, half in enumerate(halves):
        command = [sys.executable, str(BENCH), "--draws", str(DRAWS), "--biased-draws", "500", "--only",
                   *map(str, half), "--json", str(out / f"rows_{index}.json")]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          cwd=REPO_ROOT, start_new_session=True))
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=1200)
            assert process.returncode == 0, output[-6000:]
            outputs.append(output)
    finally:
        for process in processes:
            kill_group(process)
    print("\n".join(outputs))
    return [row for index in range(2) for row in json.loads((out / f"rows_{index}.json").read_text())]


def test_every_shipped_configuration_ran_with_every_aggregation(rows):
    configurations = {row["configuration"] for row in rows}
    assert len(configurations) == NUM_CONFIGURATIONS
    assert {row["aggregation"] for row in rows} == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
    assert all(row["draws"] >= DRAWS for row in rows if row["unbiased"])
    corrected = {(row["correction"], row["aggregation"]) for row in rows if row["configuration"] == CORRECTED}
    assert corrected == {(correction, row["aggregation"]) for correction in ROLLOUT_CORRECTIONS for row in rows}


def test_unbiased_configurations_match_their_full_batch_gradient_through_the_trainer_path(rows):
    for row in (row for row in rows if row["unbiased"]):
        where = f"{row['configuration']}, {row['correction']}, {row['aggregation']}"
        assert row["max_bias_se"] <= 4.0, f"{where}: {row['max_bias_se']:.2f} standard errors"
        assert row["projection_bias_se"] <= 3.0, f"{where}: {row['projection_bias_se']:.2f} standard errors"
        # the disagreeing engine's world gives noisier gradients along their mean (measured: 1.5 to 3 times the scale
        # SE of the embedded default at equal draws): its draws show a 13.5% bias (3 SE), below the 18-38% share of
        # tokens its corrections cap or mask, by about which a normaliser over the kept tokens would be off
        power = 0.045 if row["configuration"] == CORRECTED else 0.02
        assert row["scale_se"] <= power, f"{where}: too few draws to see a {3 * power:.0%} bias ({row['scale_se']:.4f})"
        assert row["cosine_to_full"] > 0.995, f"{where}: the mean gradient points away from the full batch's"
        assert row["normaliser_from_draw"], f"{where}: the normaliser was not the rule's count of the draw"
        assert row["packed_max_error"] <= 1e-6, f"{where}: packing at DP=2 changed the gradient"


def test_with_exact_history_lengths_dppo_estimates_the_full_batch_gradient(rows):
    exact = [row for row in rows if row["history_lengths"] == "exact"]
    assert {row["aggregation"] for row in exact} == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
    for row in exact:
        where = f"{row['configuration']}, {row['aggregation']}"
        assert row["predicted_scale"] == pytest.approx(1.0, abs=1e-12), where
        assert abs(row["scale"] - 1.0) <= 3 * row["scale_se"], \
            f"{where}: scale {row['scale']:.4f} ± {row['scale_se']:.4f}"


def test_sequence_normalised_dppo_targets_the_full_batch_gradient_whatever_the_lengths(rows):
    # A sequence-count normaliser is the full batch's exactly: the history lengths do not enter it.
    for row in rows:
        if row["unbiased"] and row["aggregation"] != "token-mean":
            where = f"{row['configuration']}, {row['aggregation']}"
            assert row["predicted_scale"] == pytest.approx(1.0, abs=1e-12), where
            assert abs(row["scale"] - 1.0) <= 3 * row["scale_se"], where


def test_stale_history_lengths_scale_the_token_mean_gradient_by_real_over_estimated_count(rows):
    # The prompt level counts a prompt it may prune by its history length (fixed before the draw, docs/algorithms.md):
    # stale lengths scale the step's token-mean gradient by the real count / the rule's count, no more, and the
    # scale is far enough from 1 here that a test expecting 1 would fail.
    stale = [row for row in rows if row["unbiased"] and row["history_lengths"] == "stale"
             and row["aggregation"] == "token-mean" and not row["configuration"].startswith("grpo")]
    assert len(stale) == 7 + len(ROLLOUT_CORRECTIONS)
    for row in stale:
        where = f"{row['configuration']}: scale {row['scale']:.4f} ± {row['scale_se']:.4f}"
        assert abs(row["scale"] - row["predicted_scale"]) <= 3 * row["scale_se"], \
            f"{where}, predicted {row['predicted_scale']:.4f}"
        assert row["predicted_scale"] - 1.0 > 5 * row["scale_se"], f"{where}: too close to 1 to tell them apart"


def test_dppo_with_each_rollout_correction_is_unbiased_for_the_full_batch_with_the_same_correction(rows):
    # The engine disagrees with the trainer (per-token log ratios ~ N(0, 0.3²)); the same 12,000 draws of the
    # embedded default (prompt level with refill, DAPO filter, completion level) are compared, under each
    # correction, with the drawn prompts' full batch under that correction: within 4 SE on every coordinate (the
    # general check above), the gradient through packing at DP=2 is the linear form, and each correction changes
    # the full batch's gradient (so none of them is checked while doing nothing).
    corrected = [row for row in rows if row["configuration"] == CORRECTED]
    assert {row["correction"] for row in corrected} == set(ROLLOUT_CORRECTIONS)
    for row in corrected:
        where = f"{row['correction']}, {row['aggregation']}"
        assert row["unbiased"] and row["max_bias_se"] <= 4.0 and row["packed_max_error"] <= 1e-6, where
        if row["correction"] != "none":
            assert row["correction_shift"] > 0.3, f"{where}: the correction hardly changes the gradient"


def test_deterministic_and_uncorrected_dppo_dynamic_sampling_cppo_and_d3s_are_biased(rows):
    biased = [row for row in rows if not row["unbiased"]]
    assert {row["configuration"].split(" ")[0] for row in biased} == {"dppo", "grpo,", "cppo", "d3s"}
    assert len({row["configuration"] for row in biased}) == 5
    for row in biased:
        error = max(row["relative_error"], abs(row["scale"] - 1.0))
        assert error > 0.2, f"{row['configuration']}, {row['aggregation']}: {row}"


def test_proportional_keep_probabilities_lower_the_gradient_variance_when_the_history_predicts():
    """p ∝ sqrt(1 - z) spends the keep budget on the prompts predicted to teach: with a history whose recorded
    outcomes are the true ones it has a lower mean squared error than a uniform keep of the same rate, in every
    aggregation. (The shipped world above also records twelve informative prompts as all-correct: those carry weight
    up to 1 / p_min, and there the proportional rule can cost variance instead; docs/algorithms.md has both.)
    3000 draws each: the MSE estimates are within a few percent, the gap about 25% (seq-mean) and 14% (token-mean)."""
    import bench.unbiasedness as bench

    proportional, uniform = (
        {row.aggregation: row.mean_squared_error for row in bench.check_configuration(
            name, bench.CONFIGURATIONS[name], 3000, packed_draws=0, mispredicted=False)}
        for name in ("embedded default (dppo: success-rate score, systematic sampler, auto rate, refill, DAPO)",
                     "dppo uniform keep, refill, DAPO"))
    for aggregation, error in proportional.items():
        assert error < 0.95 * uniform[aggregation], (aggregation, error, uniform[aggregation])

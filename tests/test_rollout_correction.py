"""The rollout corrections (algo/rollout_correction.py) as the policy loss applies them, their flags, and the embedded
engine's perturbed copy of the weights that makes engine and trainer disagree by a controlled amount.

- each correction against a hand-computed case: two sequences whose token ratios (trainer over engine) are 3, 0.6 and
  2.5, 1.6, so that every correction caps, masks or rejects something and keeps something;
- weights are detached and the normaliser is the full batch's: a rejected sequence still counts;
- a sequence ratio far beyond exp(20) is capped or rejected without overflow;
- the flags: the six choices in --help, --tis-cap as the alias of token TIS, and each bad setting refused in one line;
- the engine's weight noise: reproducible, of the relative size asked, re-applied (not accumulated) on every load;
- bench/rollout_correction.py on a small case: the trainer's sampled steps average to its exact expectation, and the
  engine serves its perturbed copy.
(DPPO's 1/p weights composed with each correction: bench/unbiasedness.py, tests/test_unbiasedness_e2e.py.)
"""

import math

import pytest
import torch

from megatron_dppo.algo.losses import LossConfig, combine_metrics, policy_loss
from megatron_dppo.algo.rollout_correction import CORRECTIONS, DEFAULT_BANDS, DEFAULT_CAP, RolloutCorrection
from megatron_dppo.launch.arguments import build_parser, parse_args
from megatron_dppo.launch.rollout_correction_flags import (
    ROLLOUT_CORRECTION_BANDS,
    ROLLOUT_CORRECTION_CAP,
    ROLLOUT_CORRECTIONS,
)
from megatron_dppo.pipeline.experience import loss_config

RATIOS = [3.0, 0.6, 2.5, 1.6]  # sequence A: tokens 0-1 (ratio 1.8, geometric mean 1.342); B: tokens 2-3 (4, 2)
ADVANTAGES = [1.0, 1.0, -0.5, -0.5]
# name → (correction, its weights v_t by hand, capped, masked, rejected sequences)
HAND_COMPUTED = {
    "none": (RolloutCorrection("none"), [1.0, 1.0, 1.0, 1.0], 0, 0, 0),
    "token-tis": (RolloutCorrection("token-tis", cap=2.0), [2.0, 0.6, 2.0, 1.6], 2, 0, 0),
    "seq-tis": (RolloutCorrection("seq-tis", cap=2.0), [1.8, 1.8, 2.0, 2.0], 2, 0, 0),
    "seq-mis": (RolloutCorrection("seq-mis", cap=2.0), [1.8, 1.8, 0.0, 0.0], 0, 2, 1),
    "geo-rs": (RolloutCorrection("geo-rs", band=(0.8, 1.5)), [1.0, 1.0, 0.0, 0.0], 0, 2, 1),
    "icepop": (RolloutCorrection("icepop", band=(0.5, 2.8)), [0.0, 0.6, 2.5, 1.6], 0, 1, 0),
}


def hand_case(correction: RolloutCorrection, aggregation: str = "token-mean", normalizer: float = 4.0):
    """policy_loss of the hand case: current = old log-probs (ratio 1, no clip), engine log-probs = old - log ρ."""
    logprobs = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        LossConfig(aggregation=aggregation, rollout_correction=correction), logprobs=logprobs,
        old_logprobs=torch.zeros(4, dtype=torch.float64), advantages=torch.tensor(ADVANTAGES, dtype=torch.float64),
        loss_mask=torch.ones(4, dtype=torch.float64), sample_weights=torch.ones(4, dtype=torch.float64),
        sample_ids=torch.tensor([3, 3, 8, 8]), normalizer=normalizer,
        rollout_logprobs=-torch.tensor(RATIOS, dtype=torch.float64).log())
    return logprobs, loss, metrics


def test_the_six_corrections_are_the_flag_choices_and_the_defaults_agree():
    assert CORRECTIONS == ROLLOUT_CORRECTIONS and set(HAND_COMPUTED) == set(CORRECTIONS)
    assert ROLLOUT_CORRECTION_CAP == DEFAULT_CAP and ROLLOUT_CORRECTION_BANDS == DEFAULT_BANDS
    assert "{none,token-tis,seq-tis,seq-mis,geo-rs,icepop}" in build_parser().format_help()


@pytest.mark.parametrize("name", list(HAND_COMPUTED))
def test_each_correction_weighs_the_policy_gradient_as_computed_by_hand(name):
    correction, weights, capped, masked, rejected = HAND_COMPUTED[name]
    logprobs, loss, metrics = hand_case(correction)
    # token-mean over the 4 tokens of the full batch; each token's term is -A ρ v = -A v at ρ = 1
    expected = sum(-a * v for a, v in zip(ADVANTAGES, weights)) / 4
    assert loss.item() == pytest.approx(expected)
    (gradient,) = torch.autograd.grad(loss, logprobs)  # the weights are data: d/dlogp of -A ρ v is -A v
    torch.testing.assert_close(gradient, -torch.tensor(ADVANTAGES, dtype=torch.float64)
                               * torch.tensor(weights, dtype=torch.float64) / 4)
    if correction.enabled:
        assert metrics["rollout_correction_weight_mean"] == pytest.approx(sum(weights) / 4)
        assert metrics["rollout_correction_capped_fraction"] == capped / 4
        assert metrics["rollout_correction_masked_fraction"] == masked / 4
        assert metrics["rollout_correction_rejected_sequence_fraction"] == rejected / 2
    else:
        assert not any(key.startswith("rollout_correction") for key in metrics)


def test_a_rejected_sequence_still_counts_in_the_normaliser():
    # seq-mean-token-mean over the full batch's 2 sequences: B rejected, A's mean term -1.8 divided by 2, not by 1
    _, loss, _ = hand_case(HAND_COMPUTED["seq-mis"][0], "seq-mean-token-mean", normalizer=2.0)
    assert loss.item() == pytest.approx(-1.8 / 2)


def test_a_sequence_ratio_beyond_exp_20_is_capped_or_rejected_without_overflow():
    logprobs = torch.zeros(30, dtype=torch.float64)
    inputs = dict(logprobs=logprobs, old_logprobs=logprobs, advantages=torch.ones(30, dtype=torch.float64),
                  loss_mask=torch.ones(30, dtype=torch.float64), sample_weights=torch.ones(30, dtype=torch.float64),
                  sample_ids=torch.zeros(30, dtype=torch.int64), normalizer=30.0,
                  rollout_logprobs=torch.full((30,), -5.0, dtype=torch.float64))  # sequence log ratio 150
    capped, _ = policy_loss(LossConfig(aggregation="token-mean",
                                       rollout_correction=RolloutCorrection("seq-tis", cap=2.0)), **inputs)
    rejected, metrics = policy_loss(LossConfig(aggregation="token-mean",
                                               rollout_correction=RolloutCorrection("seq-mis", cap=2.0)), **inputs)
    assert capped.item() == pytest.approx(-2.0) and rejected.item() == 0.0
    assert metrics["rollout_correction_rejected_sequence_fraction"] == 1.0


def test_step_metrics_weigh_token_means_by_tokens_and_sequence_means_by_sequences():
    rejected = "rollout_correction_rejected_sequence_fraction"
    first = {"num_tokens": 3.0, "num_sequences": 1.0, "pg_loss": 1.0, rejected: 1.0}
    second = {"num_tokens": 1.0, "num_sequences": 3.0, "pg_loss": 5.0, rejected: 0.0}
    assert combine_metrics([first, second]) == {"pg_loss": 2.0, rejected: 0.25}
    assert combine_metrics([]) == {}


def test_the_flags_build_the_loss_config_and_tis_cap_is_the_alias_of_token_tis():
    assert loss_config(parse_args([])).rollout_correction == RolloutCorrection("token-tis", cap=2.0)  # as before
    alias = loss_config(parse_args(["--tis-cap", "3"])).rollout_correction
    assert alias == loss_config(parse_args(["--rollout-correction", "token-tis", "--rollout-correction-cap", "3"])
                                ).rollout_correction == RolloutCorrection("token-tis", cap=3.0)
    assert loss_config(parse_args(["--tis-cap", "3", "--rollout-correction-cap", "3"])).rollout_correction == alias
    assert loss_config(parse_args(["--rollout-correction", "icepop"])).rollout_correction.band == (0.5, 5.0)
    assert loss_config(parse_args(["--rollout-correction", "geo-rs", "--rollout-correction-band", "0.99", "1.02"])
                       ).rollout_correction == RolloutCorrection("geo-rs", band=(0.99, 1.02))
    assert not loss_config(parse_args(["--rollout-correction", "none"])).rollout_correction.enabled


@pytest.mark.parametrize("flags, says", [
    (["--rollout-correction", "icepop", "--rollout-correction-band", "2", "1"], "is empty: give LOW < HIGH"),
    (["--rollout-correction", "geo-rs", "--rollout-correction-band", "1.01", "1.02"], "leaves out ratio 1"),
    (["--rollout-correction-band", "0.5", "2"], "applies to --rollout-correction geo-rs and icepop, not token-tis"),
    (["--rollout-correction", "icepop", "--rollout-correction-cap", "3"], "this one reads --rollout-correction-band"),
    (["--rollout-correction", "seq-tis", "--tis-cap", "3"], "but --rollout-correction is seq-tis: drop --tis-cap"),
    (["--tis-cap", "3", "--rollout-correction-cap", "4"], "give token TIS two caps"),
    (["--rollout-correction-cap", "0"], "argument --rollout-correction-cap: 0 is out of range"),
    (["--rollout-engine-weight-noise", "0.1", "--rollout-backend", "external", "--rollout-urls", "http://127.0.0.1:1",
      "--hf-checkpoint", "model", "--dry-run"], "perturbs the embedded engine's weights"),
], ids=["empty band", "band without 1", "band to token-tis", "cap to icepop", "tis-cap to seq-tis",
        "two caps", "cap 0", "noise to external servers"])
def test_bad_settings_are_refused_at_parse_time_in_one_line(flags, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and says in lines[0], lines


def test_engine_weight_noise_is_reproducible_relative_and_reapplied_on_every_load(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config
    from megatron_dppo.servers.embedded.engine import EmbeddedEngine

    model_dir = save_random_hf_model(tiny_hf_config(vocab_size=32, hidden_size=32, num_heads=2, num_kv_heads=1),
                                     tmp_path / "model")
    clean = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    engines = [EmbeddedEngine(str(model_dir), weight_noise=0.05, weight_noise_seed=seed) for seed in (7, 7, 8)]
    perturbed = [dict(engine.model.named_parameters()) for engine in engines]
    for name, weight in clean.items():
        if weight.square().mean() > 0:
            relative = ((perturbed[0][name] - weight).square().mean() / weight.square().mean()).sqrt().item()
            assert relative == pytest.approx(0.05, rel=0.5 if weight.numel() < 100 else 0.15), name
        assert torch.equal(perturbed[0][name], perturbed[1][name]), f"{name}: the same seed must perturb alike"
    assert any(not torch.equal(perturbed[0][name], perturbed[2][name]) for name in clean)
    engines[0].weights.load_from_disk({"model_path": str(model_dir)})  # the trainer's weights arrive again
    for name in clean:
        assert torch.equal(dict(engines[0].model.named_parameters())[name], perturbed[1][name]), \
            f"{name}: noise added to the loaded weights, not to the perturbed ones"
    assert not math.isnan(sum(p.sum().item() for p in perturbed[0].values()))


def test_rollout_correction_bench_steps_average_to_its_exact_expectation_and_its_engine_serves_the_perturbed_copy(
        tmp_path):
    """bench/rollout_correction.py's table rests on two things checked here on a small case (2 prompts, one gap):
    the trainer's own sampled steps (select_samples, policy_loss, DPPO off and on) average to the bench's exact
    expectation under every correction (norm of the difference over its standard error, about 1 when they agree),
    and the embedded engine started with --weight-noise serves the log-probs of the bench's perturbed copy."""
    import argparse
    import re

    import bench.rollout_correction as bench

    # 400 draws: DPPO's prompt weights reach 1 / p_min = 5, and at 40 draws their sample variance was too unsteady
    # for a 3 SE bound (3.75 on seed 0, where 160, 400 and 2,000 draws read 2.28, 2.53, 1.77); a draw costs ~0.04 s
    options = argparse.Namespace(noise=[0.01], draws=400, batch=2, group=4, out_dir=tmp_path)
    rows, notes = bench.run_repeat(0, options)
    assert float(re.search(r"at most ([0-9.e+-]+);", notes[0]).group(1)) < 1e-4, notes
    assert {row.correction for row in rows if row.noise} == set(bench.CORRECTIONS)
    for row in rows:  # with DPPO on, against the full step's exact expectation: DPPO's pruned step is unbiased
        assert row.check_se < 3.0, row
    by_key = {(row.noise, row.dppo, row.correction): row for row in rows}
    assert by_key[0.01, False, "seq-tis"].bias < by_key[0.01, False, "none"].bias  # the sequence's own IS weight

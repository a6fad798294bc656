"""DPPO's predictive prompt level: the history's zero-variance prediction and prior, the refill's fixed draw, the keep
probabilities and their correction, and DAPO's dynamic sampling beside it (experience.py)."""

import math

import pytest
import torch

from megatron_dppo.algo import PromptHistory, build_pruner, full_batch_counts
from megatron_dppo.algo.history import zero_variance_groups
from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.pipeline.experience import ExperienceMaker
from megatron_dppo.pipeline.tasks import Prompt, Task
from megatron_dppo.rewards import RewardBatch
from megatron_dppo.rollout.client import Completion

G = 4
ALL_RIGHT, ALL_WRONG, MIXED = [1.0] * G, [0.0] * G, [1.0, 0.0, 1.0, 0.0]


def exact_match(responses, rows) -> RewardBatch:
    """A reward of 1 where the decoded response is the label itself."""
    return RewardBatch.of([float(response == row.label) for response, row in zip(responses, rows)])


def history_with(visits: list[tuple[int, str, list[float]]], decay=0.5, prior=2.0) -> PromptHistory:
    """A history fed one visit per (prompt id, difficulty, rewards), in order, each with mean length 10."""
    history = PromptHistory(decay, prior)
    for prompt_id, difficulty, rewards in visits:
        history.update([prompt_id], [0.0], [10.0], rewards=[rewards], difficulties=[difficulty])
    return history


def test_zero_variance_prediction_shrinks_a_prompts_visits_towards_its_stratum():
    history = history_with([(0, "easy", ALL_RIGHT), (1, "easy", MIXED), (0, "easy", ALL_RIGHT)], decay=0.5, prior=2.0)
    # the stratum's share: discounted groups 0.98² + 0.98 + 1, zero-variance ones 0.98² + 1
    stratum = (0.98**2 + 1) / (0.98**2 + 0.98 + 1)
    # prompt 0: two zero-variance visits, discounted 0.5 per visit: total 1.5 of weight 1.5
    expected = (2.0 * stratum + 1.5) / (2.0 + 1.5)
    assert history.zero_variance_probability([0], ["easy"]).item() == pytest.approx(expected)
    assert history.zero_variance_probability([1], ["easy"]).item() == pytest.approx(2.0 * stratum / 3.0)


def test_a_prompt_never_seen_gets_its_stratums_prior_then_the_pools():
    history = history_with([(0, "easy", ALL_RIGHT), (1, "easy", ALL_RIGHT), (2, "hard", MIXED)])
    z = history.zero_variance_probability([7, 8, 9], ["easy", "hard", "unknown"]).tolist()
    assert z[0] == pytest.approx(1.0) and z[1] == pytest.approx(0.0)
    assert 0.0 < z[2] < 1.0  # a stratum never seen falls back to the pool's share
    assert math.isnan(PromptHistory().zero_variance_probability([7], ["easy"]).item())  # nothing rolled out yet
    history.update([3], [0.0], [30.0], rewards=[MIXED], difficulties=["hard"])
    lengths = history.expected_lengths([3, 8, 9], ["hard", "hard", "unknown"]).tolist()
    assert lengths[0] == 30.0 and 10.0 < lengths[1] < 30.0 and 10.0 < lengths[2] < 30.0


def test_stratum_shares_weigh_each_group_by_its_inverse_keep_probability():
    history = PromptHistory()
    history.update([0, 1], [0.0, 0.0], [10.0, 10.0], rewards=[ALL_RIGHT, MIXED], difficulties=["a", "a"],
                   weights=[1.0, 4.0])
    assert history.zero_variance_share() == pytest.approx(0.98 / (0.98 + 4.0))  # one decay step for the first


def test_history_state_round_trips_and_predicts_the_same():
    history = history_with([(0, "easy", ALL_RIGHT), (1, "hard", MIXED), (0, "easy", MIXED), (2, "hard", ALL_WRONG)])
    restored = PromptHistory(0.9, 7.0)
    restored.load_state_dict(history.state_dict())
    ids, difficulties = [0, 1, 2, 5], ["easy", "hard", "hard", "easy"]
    torch.testing.assert_close(restored.zero_variance_probability(ids, difficulties),
                               history.zero_variance_probability(ids, difficulties))
    torch.testing.assert_close(restored.expected_lengths(ids, difficulties),
                               history.expected_lengths(ids, difficulties))
    assert restored.zero_variance_share() == history.zero_variance_share()


def saturated_history(num_prompts=40) -> tuple[PromptHistory, list[str]]:
    """Half the prompts all-right twice (predicted zero-variance), half mixed: a pool share of one half."""
    visits = [(i, "cell", ALL_RIGHT if i % 2 else MIXED) for i in range(num_prompts)]
    return history_with(visits + visits), ["cell"] * num_prompts


def test_refill_draws_batch_over_one_minus_the_pools_zero_variance_share_and_rolls_out_about_the_batch():
    history, difficulties = saturated_history()
    pruner = build_pruner("dppo", group_size=G)
    share = history.zero_variance_share()
    drawn = pruner.prompts_to_sample(8, history)
    assert drawn == math.ceil(8 / (1 - share) - 1e-9) and drawn > 8
    decision = pruner.select_prompts(list(range(drawn)), history, step=0, difficulties=difficulties[:drawn])
    assert decision.keep_probs.sum().item() == pytest.approx(8.0, abs=1.0)  # Σ p = the batch (floors aside)
    assert decision.keep_probs.min().item() >= 0.2 - 1e-12  # the floor, --dppo-prompt-p-min
    order = decision.predicted_zero_variance.argsort()
    assert (decision.keep_probs[order].diff() <= 1e-12).all()  # informative ones first
    assert build_pruner("dppo", refill_max=1.5).prompts_to_sample(8, history) <= 12
    assert build_pruner("dppo", refill=False).prompts_to_sample(8, history) == 8


def test_deterministic_refill_keeps_the_lowest_predicted_zero_variance_and_rescales():
    history, difficulties = saturated_history()
    pruner = build_pruner("dppo", mode="deterministic")
    decision = pruner.select_prompts(list(range(20)), history, 0, difficulties[:20])
    assert len(decision.kept) < 20
    kept_z = decision.predicted_zero_variance[decision.kept]
    dropped = torch.ones(20, dtype=torch.bool)
    dropped[decision.kept] = False
    assert kept_z.max() <= decision.predicted_zero_variance[dropped].min()
    torch.testing.assert_close(decision.weights, torch.full_like(decision.weights, 20 / len(decision.kept)))


def test_without_importance_weights_the_kept_prompts_stand_for_the_batch():
    history, difficulties = saturated_history()
    decision = build_pruner("dppo", importance_weights=False).select_prompts(list(range(20)), history, 0,
                                                                             difficulties[:20])
    assert (decision.weights == 1.0).all() and not decision.corrected
    lengths = torch.full((len(decision.kept), G), 7)
    counts = full_batch_counts(decision, lengths)
    assert (counts.num_sequences, counts.num_response_tokens) == (len(decision.kept) * G, 7.0 * len(decision.kept) * G)


# ------------------------------------------------------------------------------------ the experience maker


class ScriptedClient:
    """Every prompt's G completions from a script: prompt token → rewards pattern (1 = the right answer)."""

    def __init__(self, right: dict[int, list[float]]):
        self.right = right
        self.requests = 0

    def generate(self, prompts, params, n=1):
        self.requests += 1
        return [Completion(index, sample, [7 if self.right[prompt[0]][sample] else 8], [-0.1], "stop", None)
                for index, prompt in enumerate(prompts) for sample in range(n)]


class ScriptedTokenizer:
    eos_token_id = 0

    def decode(self, ids):
        return "right" if ids == [7] else "wrong"


def scripted_maker(flags: list[str], patterns: list[list[float]]) -> tuple[ExperienceMaker, ScriptedClient]:
    prompts = [Prompt(i, [i], "right", difficulty="cell") for i in range(len(patterns))]
    task = Task(prompts, [], exact_match, seed=0)
    args = parse_args(["--n-samples-per-prompt", str(G), "--rollout-batch-size", "4", *flags])
    client = ScriptedClient(dict(enumerate(patterns)))
    return ExperienceMaker(args, task, ScriptedTokenizer(), client), client


def test_dapo_dynamic_sampling_rolls_out_rounds_until_the_batch_holds_varied_groups():
    patterns = [MIXED if i % 8 == 0 else ALL_RIGHT for i in range(64)]  # one prompt in eight teaches
    maker, client = scripted_maker(["--algorithm", "grpo", "--dapo-dynamic-sampling"], patterns)
    rollouts = maker.generate(step=1)
    assert len(rollouts.prompts) == 4 and not zero_variance_groups(rollouts.rewards).any()
    assert client.requests == rollouts.stats["dapo_rounds"] > 1  # a round of 4 finds about half a varied group
    assert rollouts.num_drawn == 4 * client.requests
    assert rollouts.tokens_generated == rollouts.num_drawn * G  # discarded groups' tokens are counted
    assert rollouts.stats["groups_rolled_out"] == rollouts.num_drawn
    assert rollouts.stats["zero_variance_groups_rolled_out"] <= rollouts.num_drawn - 4  # 4 varied (or more)
    experience = maker.make(rollouts, 1, 0.0)
    assert experience.normalizer_counts.num_sequences == 4 * G  # the kept batch normalises (DAPO)


def test_dapo_dynamic_sampling_stops_at_its_round_limit_with_a_short_batch():
    maker, client = scripted_maker(["--algorithm", "grpo", "--dapo-dynamic-sampling", "--dapo-max-rounds", "2"],
                                   [ALL_RIGHT] * 32)
    rollouts = maker.generate(step=1)
    assert client.requests == 2 and len(rollouts.prompts) == 0 and rollouts.stats["dapo_batch_shortfall"] == 4


def test_dapo_dynamic_sampling_is_refused_beside_dppos_own_refill(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--algorithm", "dppo", "--dapo-dynamic-sampling"])
    assert "--dapo-dynamic-sampling" in capsys.readouterr().err


def test_the_maker_draws_the_refill_and_records_each_groups_prediction_and_outcome():
    patterns = [MIXED if i % 2 else ALL_RIGHT for i in range(32)]
    maker, client = scripted_maker([], patterns)
    for step in range(1, 13):  # past the first epoch, every prompt has a history
        rollouts = maker.generate(step)
        experience = maker.make(rollouts, step, 0.0)
    assert rollouts.num_drawn > 4  # the refill draws more than the batch once half the groups are zero-variance
    outcomes = experience.stats["prompt_outcomes"]
    assert len(outcomes) == len(rollouts.prompts)
    for outcome in outcomes:
        assert outcome["zero_variance"] == (outcome["prompt_id"] % 2 == 0)
        assert outcome["predicted_zero_variance"] is not None and 0.0 < outcome["keep_prob"] <= 1.0
    assert experience.stats["prompts_pruned"] == rollouts.num_drawn - len(rollouts.prompts)


def prompt_prediction_bench():
    """bench/prompt_prediction.py, loaded as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "prompt_prediction.py"
    spec = importlib.util.spec_from_file_location("prompt_prediction", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_prompt_prediction_bench_replays_outcomes_through_the_trainers_history(tmp_path):
    import json

    bench = prompt_prediction_bench()
    # prompts 0-9 always all-right, 10-19 always mixed, each visited on 5 steps
    records = [{"step": step, "prompt_id": i, "difficulty": "c", "rewards": ALL_RIGHT if i < 10 else MIXED,
                "zero_variance": i < 10, "response_length_mean": 10.0} for step in range(5) for i in range(20)]
    (tmp_path / "prompt_outcomes.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    kinds = bench.replay([bench.read_outcomes(tmp_path)], decay=0.5, prior=2.0)
    seen = bench.quality(*kinds["seen"])
    assert seen.visits == 80 and seen.precision == 1.0 and seen.recall == 1.0 and seen.brier < seen.base_brier
    assert kinds["first"] == ([], [])  # every first visit came before any group: no prior, no prediction


def test_keep_rule_gain_measures_what_the_history_buys_against_uniform_keeping_and_a_perfect_predictor():
    bench = prompt_prediction_bench()
    # prompts 0-9 always all-right (no gradient), 10-19 always mixed: once seen, the history tells them apart
    learnable = [{"step": step, "prompt_id": i, "difficulty": "c", "rewards": ALL_RIGHT if i < 10 else MIXED,
                  "zero_variance": i < 10, "response_length_mean": 10.0} for step in range(6) for i in range(20)]
    gain = bench.keep_rule_gain([learnable], keep_fraction=0.5)
    assert gain.base_share == 0.5 and gain.informative_share > 0.6
    assert 1.2 < gain.variance_gain <= gain.oracle_gain + 1e-9
    # outcomes that no history predicts (each prompt alternates): nothing to buy over uniform keeping
    coin = [{**r, "rewards": MIXED if (r["step"] + r["prompt_id"]) % 2 else ALL_RIGHT,
             "zero_variance": not (r["step"] + r["prompt_id"]) % 2} for r in learnable]
    assert bench.keep_rule_gain([coin], keep_fraction=0.5).variance_gain < 1.05

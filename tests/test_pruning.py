import io
import itertools
import math

import pytest
import torch

from megatron_dppo.algo import (
    PRUNERS,
    DAPOConfig,
    DAPOFilter,
    FullBatchInfo,
    LossConfig,
    PromptDecision,
    PromptHistory,
    build_pruner,
    compute_advantages,
    full_batch_counts,
    loss_normalizer,
    max_variance_subset,
    proportional_keep_probs,
    score_prompts,
)
from tests.test_losses import FULL_CONFIG, make_policy_batch

PRUNER_OPTIONS = {
    "none": {},
    # the EMA-score prompt level with a fixed rate and no refill: the tests of that path; the predictive level with
    # refill has its own tests below
    "dppo": dict(prompt_prune_rate=0.5, completion_prune_rate=0.5, prompt_score="mean_abs_advantage", refill=False),
    "cppo": dict(prune_rate=0.5),
    "d3s": {},
}


def random_batch(num_prompts=6, group_size=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.rand(num_prompts, group_size, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, 20, (num_prompts, group_size), generator=generator)
    return rewards, compute_advantages(rewards), lengths


def seen_history(prompt_ids, rewards, advantages, lengths) -> PromptHistory:
    history = PromptHistory()
    history.update(prompt_ids, score_prompts(rewards, advantages), lengths.double().mean(dim=1))
    return history


def run_step(pruner, rewards, advantages, lengths, history=None, step=0, prompt_ids=None, progress=0.0):
    """select_prompts, the full batch's counts, then select_completions on the kept prompts, as the trainer does."""
    prompt_ids = list(range(rewards.shape[0])) if prompt_ids is None else prompt_ids
    prompt_decision = pruner.select_prompts(prompt_ids, history, step)
    kept = prompt_decision.kept
    full_batch = full_batch_counts(prompt_decision, lengths[kept])
    return prompt_decision, pruner.select_completions(
        rewards[kept], advantages[kept], lengths[kept], prompt_decision, full_batch, step, progress
    )


# ------------------------------------------------------------------------------------------- keep probabilities


@pytest.mark.parametrize("keep_fraction", [0.1, 0.3, 0.5, 0.9])
def test_proportional_keep_probs_hit_the_keep_fraction_within_floor_and_cap(keep_fraction):
    generator = torch.Generator().manual_seed(4)
    scores = torch.rand(200, generator=generator, dtype=torch.float64) ** 3
    scores[:20] = 0.0
    probs = proportional_keep_probs(scores, keep_fraction, p_min=0.05)
    assert probs.mean().item() == pytest.approx(keep_fraction, abs=1e-12)
    assert probs.min().item() >= 0.05 and probs.max().item() <= 1.0
    order = scores.argsort()
    assert (probs[order].diff() >= -1e-15).all(), "keep probability must not decrease with the score"
    free = (probs > 0.05) & (probs < 1.0)
    ratios = probs[free] / scores[free]
    torch.testing.assert_close(ratios, ratios[:1].expand_as(ratios), msg="p = c · score between floor and cap")


def test_proportional_keep_probs_share_the_remainder_when_most_scores_are_zero():
    scores = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0, 1.0], dtype=torch.float64)
    probs = proportional_keep_probs(scores, 0.6, p_min=0.05)
    torch.testing.assert_close(probs, torch.tensor([0.4, 0.4, 0.4, 0.4, 1.0, 1.0], dtype=torch.float64))


def test_keep_probability_of_zero_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="keep probability of 0"):
        build_pruner("dppo", prompt_prune_rate=1.0)
    with pytest.raises(ValueError, match="keep probability of 0"):
        build_pruner("dppo", completion_prune_rate=1.0)
    with pytest.raises(ValueError, match="completion_p_min is 0.0"):
        build_pruner("dppo", completion_prune_rate=0.5, keep_policy="proportional", completion_p_min=0.0)
    with pytest.raises(ValueError, match="exceeds the keep fraction"):
        build_pruner("dppo", completion_prune_rate=0.9, keep_policy="proportional", completion_p_min=0.2)
    with pytest.raises(ValueError, match="keep probability of 0"):
        build_pruner("cppo", prune_rate=1.0)


def test_unknown_pruner_and_unknown_options_are_rejected():
    with pytest.raises(ValueError, match="unknown pruner 'grpo'"):
        build_pruner("grpo")
    with pytest.raises(TypeError):
        build_pruner("dppo", prune_rate=0.5)
    with pytest.raises(ValueError, match="mode is 'random'"):
        build_pruner("dppo", mode="random")


# ------------------------------------------------------------------------------------------------------- DPPO


@pytest.mark.parametrize("mode", ["stochastic", "deterministic"])
@pytest.mark.parametrize("keep_policy", ["uniform", "proportional"])
def test_prune_rate_zero_is_bit_identical_to_grpo(mode, keep_policy):
    rewards, advantages, lengths = random_batch()
    history = seen_history(range(6), rewards, advantages, lengths)
    grpo = run_step(build_pruner("none"), rewards, advantages, lengths, history)
    dppo = run_step(build_pruner("dppo", mode=mode, keep_policy=keep_policy, prompt_prune_rate=0.0,
                                 completion_prune_rate=0.0), rewards, advantages, lengths, history)
    for grpo_decision, dppo_decision in zip(grpo, dppo):
        assert torch.equal(grpo_decision.kept, dppo_decision.kept)
        assert torch.equal(grpo_decision.weights, dppo_decision.weights)
    assert grpo[1].normalizer_counts == dppo[1].normalizer_counts
    batch = make_policy_batch(lengths.reshape(-1), advantages.reshape(-1))
    config = LossConfig(**FULL_CONFIG, aggregation="token-mean")
    results = []
    for _, decision in (grpo, dppo):
        weights = torch.zeros(24, dtype=torch.float64).index_put_((decision.kept,), decision.weights)
        loss, _ = batch.loss(config, weights, loss_normalizer(config, decision.normalizer_counts))
        results.append((loss, batch.gradient(loss)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_same_seed_and_step_give_the_same_decision_on_every_rank():
    rewards, advantages, lengths = random_batch()
    history = seen_history(range(6), rewards, advantages, lengths)
    ranks = [build_pruner("dppo", keep_policy="proportional", seed=7, **PRUNER_OPTIONS["dppo"]) for _ in range(2)]
    decisions = [run_step(pruner, rewards, advantages, lengths, history, step=5)[1] for pruner in ranks]
    assert torch.equal(decisions[0].kept, decisions[1].kept)
    assert torch.equal(decisions[0].weights, decisions[1].weights)
    other_steps = [run_step(ranks[0], rewards, advantages, lengths, history, step=s)[1].kept for s in range(6, 12)]
    assert any(not torch.equal(kept, decisions[0].kept) for kept in other_steps)


def test_unseen_prompts_are_never_pruned_before_rollout():
    rewards, advantages, lengths = random_batch(num_prompts=8)
    history = seen_history(range(4), rewards[:4], advantages[:4], lengths[:4])  # prompts 4..7 never seen
    pruner = build_pruner("dppo", prompt_prune_rate=0.8, keep_policy="uniform", candidates="all")
    for step in range(50):
        decision = pruner.select_prompts(range(8), history, step)
        assert {4, 5, 6, 7} <= set(decision.kept.tolist())
        assert torch.equal(decision.keep_probs[4:], torch.ones(4, dtype=torch.float64))


def test_unsolved_rate_scores_only_solved_prompts_as_worthless():
    # all-correct, all-wrong, mixed: mean |A| and reward std score both uniform groups 0; unsolved_rate only the
    # solved one, so DPPO's prompt level never prunes a prompt the policy has not solved yet below a solved one
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    advantages = compute_advantages(rewards, "grpo")
    assert score_prompts(rewards, advantages, "mean_abs_advantage")[:2].tolist() == [0.0, 0.0]
    assert score_prompts(rewards, advantages, "unsolved_rate").tolist() == [0.0, 1.0, 0.75]
    history = PromptHistory()
    history.update(range(3), score_prompts(rewards, advantages, "unsolved_rate"), torch.full((3,), 5.0))
    pruner = build_pruner("dppo", prompt_prune_rate=0.5, prompt_score="unsolved_rate", candidates="below_mean")
    assert pruner.prompt_score == "unsolved_rate"
    for step in range(20):
        decision = pruner.select_prompts(range(3), history, step)
        assert {1, 2} <= set(decision.kept.tolist()) and decision.keep_probs[1:].tolist() == [1.0, 1.0]
        assert decision.keep_probs[0] < 1.0
    expected = r"sample index 1 is 2.0 \(1 rewards outside.*needs rewards in \[0, 1\].*mean_abs_advantage"
    with pytest.raises(ValueError, match=expected):
        score_prompts(torch.tensor([[0.0, 2.0]], dtype=torch.float64), torch.zeros(1, 2), "unsolved_rate")


def test_below_mean_candidates_keep_every_above_mean_item():
    rewards, advantages, lengths = random_batch(num_prompts=10, group_size=8)
    pruner = build_pruner("dppo", completion_prune_rate=0.9, candidates="below_mean")
    magnitude = advantages.abs()
    above = (magnitude > magnitude.mean(dim=1, keepdim=True)).reshape(-1).nonzero().squeeze(1)
    for step in range(20):
        _, decision = run_step(pruner, rewards, advantages, lengths, step=step)
        assert set(above.tolist()) <= set(decision.kept.tolist())
        assert len(decision.kept) < 80 - 0.5 * (80 - len(above)), "about 90% of the candidates are pruned"


def test_deterministic_dppo_drops_the_lowest_abs_advantage_per_group_and_rescales():
    rewards, advantages, lengths = random_batch(num_prompts=3, group_size=5)
    _, decision = run_step(build_pruner("dppo", completion_prune_rate=0.5, mode="deterministic", candidates="all"),
                           rewards, advantages, lengths)
    for group in range(3):
        kept = [i - 5 * group for i in decision.kept.tolist() if i // 5 == group]
        assert sorted(kept) == sorted(advantages[group].abs().topk(3).indices.tolist())  # floor(0.5·5) = 2 dropped
    torch.testing.assert_close(decision.weights, torch.full((9,), 5 / 3, dtype=torch.float64))


def test_dppo_normaliser_is_fixed_before_the_draw_even_when_history_lengths_are_off():
    rewards, advantages, lengths = random_batch()
    history = PromptHistory()
    history.update(range(6), score_prompts(rewards, advantages), lengths.double().mean(dim=1) + 3.0)
    pruner = build_pruner("dppo", keep_policy="uniform", candidates="all", **PRUNER_OPTIONS["dppo"])
    bases = {run_step(pruner, rewards, advantages, lengths, history, step)[1].normalizer_counts for step in range(30)}
    assert bases == {FullBatchInfo(num_sequences=24.0, num_response_tokens=float(lengths.sum()) + 24 * 3.0)}


def test_every_completion_of_a_prompt_pruned_leaves_a_valid_step():
    rewards, advantages, lengths = random_batch()
    pruner = build_pruner("dppo", completion_prune_rate=0.7, keep_policy="uniform", candidates="all")
    batch = make_policy_batch(lengths.reshape(-1), advantages.reshape(-1))
    config = LossConfig(**FULL_CONFIG)
    emptied_groups = 0
    for step in range(40):
        _, decision = run_step(pruner, rewards, advantages, lengths, step=step)
        groups_kept = set((decision.kept // 4).tolist())
        emptied_groups += 6 - len(groups_kept)
        assert decision.normalizer_counts.num_sequences == 24.0  # a fully pruned prompt still counts in the normaliser
        weights = torch.zeros(24, dtype=torch.float64).index_put_((decision.kept,), decision.weights)
        normalizer = loss_normalizer(config, decision.normalizer_counts)
        loss, _ = batch.loss(config, weights, normalizer, samples=decision.kept)
        assert torch.isfinite(loss) and torch.isfinite(batch.gradient(loss)).all()
    assert emptied_groups > 0, "the draws never emptied a group: the edge case was not exercised"


# ------------------------------------------------------------------------------------------------- CPPO, D3S


@pytest.mark.parametrize("scope", ["per_group", "batch"])
def test_cppo_keeps_exactly_the_k_largest_abs_advantages(scope):
    rewards, advantages, lengths = random_batch(num_prompts=5, group_size=8)
    _, decision = run_step(build_pruner("cppo", prune_rate=0.75, scope=scope), rewards, advantages, lengths)
    magnitude = advantages.abs()
    if scope == "per_group":  # k = floor(8 · 0.25) = 2 per group
        expected = (magnitude.topk(2, dim=1).indices + 8 * torch.arange(5)[:, None]).reshape(-1)
    else:  # k = floor(40 · 0.25) = 10 over the batch
        expected = magnitude.reshape(-1).topk(10).indices
    assert torch.equal(decision.kept, expected.sort().values)
    assert torch.equal(decision.weights, torch.ones(len(expected), dtype=torch.float64))
    assert decision.normalizer_counts == FullBatchInfo.from_lengths(lengths.reshape(-1)[expected])


def test_cppo_refill_samples_more_prompts_and_rejects_keeping_nothing():
    assert build_pruner("cppo", prune_rate=0.75, refill=True).prompts_to_sample(8) == 32
    assert build_pruner("cppo", prune_rate=0.75).prompts_to_sample(8) == 8
    rewards, advantages, lengths = random_batch(group_size=2)
    with pytest.raises(ValueError, match="keeps floor"):
        run_step(build_pruner("cppo", prune_rate=0.75), rewards, advantages, lengths)


def variance(values) -> float:
    values = torch.as_tensor(values, dtype=torch.float64)
    return float(values.var(unbiased=False))


@pytest.mark.parametrize("n", range(1, 13))
def test_d3s_max_variance_subset_equals_brute_force(n):
    generator = torch.Generator().manual_seed(n)
    for trial in range(3):
        values = torch.randn(n, generator=generator, dtype=torch.float64)
        if trial == 2:
            values = values.round()  # ties, as binary rewards give
        for size in range(1, n + 1):
            ranked = sorted(itertools.combinations(range(n), size), key=lambda subset: -variance(values[list(subset)]))
            best_variance = variance(values[list(ranked[0])])
            found = max_variance_subset(values, size)
            assert len(found) == size == len(set(found.tolist()))
            assert variance(values[found]) == pytest.approx(best_variance, abs=1e-12)
            unique_optimum = len(ranked) == 1 or variance(values[list(ranked[1])]) < best_variance - 1e-9
            if unique_optimum:
                assert found.tolist() == list(ranked[0])


def test_d3s_schedule_is_linear_in_progress_and_selects_samples_then_tokens():
    pruner = build_pruner("d3s", sample_fraction_init=0.25, sample_fraction_final=0.75, token_fraction_init=0.2,
                          token_fraction_final=0.6)
    assert pruner.fractions(0.0) == (0.25, 0.2)
    assert pruner.fractions(0.5) == pytest.approx((0.5, 0.4))
    assert pruner.fractions(3.0) == pytest.approx((0.75, 0.6))
    rewards, advantages, lengths = random_batch(num_prompts=4, group_size=4)
    _, decision = run_step(pruner, rewards, advantages, lengths, step=0, progress=0.0)
    assert torch.equal(decision.kept, max_variance_subset(advantages.reshape(-1), 4))
    assert decision.normalizer_counts == FullBatchInfo.from_lengths(lengths.reshape(-1)[decision.kept])

    generator = torch.Generator().manual_seed(0)
    token_advantages = torch.randn(50, generator=generator)
    entropy = torch.rand(50, generator=generator)
    loss_mask = torch.ones(50)
    loss_mask[:10] = 0
    sample_ids = torch.arange(50) // 10  # 5 samples of 10 tokens; sample 0 is all masked
    mask, counts = pruner.select_tokens(token_advantages, entropy, loss_mask, sample_ids, progress=0.0)
    key = (token_advantages.abs() * entropy)[10:]
    selected = key.topk(8).indices.sort().values  # round(0.2 · 40) tokens
    assert torch.equal(mask[10:].nonzero().squeeze(1), selected)
    assert mask[:10].sum() == 0
    # the normaliser counts what the token level kept: its tokens and the samples that kept at least one
    assert counts == FullBatchInfo(float(len(torch.unique(selected // 10))), 8.0)


def test_dapo_drops_zero_variance_groups():
    dapo = DAPOFilter(DAPOConfig())
    assert dapo.prompts_to_sample(4) == 4
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    groups = dapo.select_groups(rewards, capacity=6, step=0)
    assert groups.kept.tolist() == [1, 3, 4, 5] and groups.weights.tolist() == [1.0] * 4


def test_dapo_oversampling_keeps_a_random_capacity_of_varied_groups_weighted_by_varied_over_capacity():
    dapo = DAPOFilter(DAPOConfig(oversample_factor=1.5, seed=3))
    assert dapo.prompts_to_sample(4) == 6
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    inclusion = torch.zeros(6, dtype=torch.float64)
    draws = 4000
    for step in range(draws):
        groups = dapo.select_groups(rewards, capacity=3, step=step)
        assert len(groups.kept) == 3 and set(groups.kept.tolist()) <= {1, 3, 4, 5}
        torch.testing.assert_close(groups.weights, torch.full((3,), 4 / 3, dtype=torch.float64))
        inclusion[groups.kept] += 1
    # each of the 4 varied groups is kept with probability 3/4: the weight 4/3 is its inverse (±4 SE)
    assert inclusion[[0, 2]].tolist() == [0.0, 0.0]
    standard_error = (0.75 * 0.25 / draws) ** 0.5
    assert ((inclusion[[1, 3, 4, 5]] / draws - 0.75).abs() < 4 * standard_error).all()
    assert dapo.select_groups(rewards, capacity=3, step=7).kept.tolist() == \
        dapo.select_groups(rewards, capacity=3, step=7).kept.tolist(), "a step's draw is reproducible"


# ------------------------------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("name", sorted(PRUNERS))
def test_all_equal_rewards_in_a_group_give_a_valid_decision(name):
    rewards, _, lengths = random_batch()
    rewards[2] = 0.5
    advantages = compute_advantages(rewards)
    history = seen_history(range(6), rewards, advantages, lengths)
    for step in range(5):
        prompt_decision, decision = run_step(build_pruner(name, **PRUNER_OPTIONS[name]), rewards, advantages, lengths,
                                             history, step)
        assert torch.isfinite(decision.weights).all() and (decision.weights > 0).all()
        assert decision.kept.max().item() < 4 * len(prompt_decision.kept)


@pytest.mark.parametrize("name", ["none", "dppo", "d3s"])
def test_group_of_one_completion_is_handled(name):
    rewards, _, lengths = random_batch(group_size=1)
    advantages = compute_advantages(rewards)
    history = seen_history(range(6), rewards, advantages, lengths)
    _, decision = run_step(build_pruner(name, **PRUNER_OPTIONS[name]), rewards, advantages, lengths, history)
    assert torch.isfinite(decision.weights).all()
    assert len(DAPOFilter(DAPOConfig()).select_groups(rewards, 6, 0).kept) == 0  # no variance in a group of one
    if name == "d3s":
        assert len(decision.kept) == 2  # round(0.25 · 6) samples, at the schedule's start
    else:
        assert decision.normalizer_counts.num_sequences == 6


def test_nan_reward_is_rejected_by_the_pruner_naming_the_sample():
    rewards, advantages, lengths = random_batch()
    rewards[3, 2] = float("nan")
    pruner = build_pruner("dppo", **PRUNER_OPTIONS["dppo"])
    with pytest.raises(ValueError, match="prompt index 3, sample index 2"):
        pruner.select_completions(rewards, advantages, lengths, PromptDecision.keep_all(6),
                                  FullBatchInfo.from_lengths(lengths), 0)


def test_completion_inputs_must_match_the_prompt_decision():
    rewards, advantages, lengths = random_batch()
    with pytest.raises(ValueError, match="kept 5 prompts but rewards has 6 rows"):
        build_pruner("none").select_completions(rewards, advantages, lengths, PromptDecision.keep_all(5),
                                                FullBatchInfo.from_lengths(lengths), 0)


# -------------------------------------------------------------------------------------------------- history


def test_prompt_history_is_an_ema_and_survives_a_checkpoint():
    history = PromptHistory(ema_decay=0.75)
    history.update([3, 9], torch.tensor([1.0, 0.0]), torch.tensor([100.0, 40.0]))
    history.update([3], [0.0])
    scores, lengths, seen = history.lookup([3, 9, 11])
    torch.testing.assert_close(scores[:2], torch.tensor([0.75, 0.0], dtype=torch.float64))
    torch.testing.assert_close(lengths[:2], torch.tensor([100.0, 40.0], dtype=torch.float64))
    assert seen.tolist() == [True, True, False] and history.visits(3) == 2
    buffer = io.BytesIO()
    torch.save(history.state_dict(), buffer)
    buffer.seek(0)
    restored = PromptHistory()
    restored.load_state_dict(torch.load(buffer))
    for restored_value, value in zip(restored.lookup([3, 9, 11]), history.lookup([3, 9, 11])):
        torch.testing.assert_close(restored_value, value, equal_nan=True)
    assert restored.ema_decay == 0.75 and restored.visits(3) == 2
    with pytest.raises(ValueError, match="score of prompt id 5"):
        history.update([5], [float("nan")])
    with pytest.raises(ValueError, match="2 prompt ids, 1 scores"):
        history.update([5, 6], [1.0])


def test_dppo_prompt_score_flag_reaches_the_pruner_and_is_refused_for_other_algorithms(capsys):
    from megatron_dppo.algo import PROMPT_SCORES
    from megatron_dppo.launch.arguments import build_parser, parse_args
    from megatron_dppo.pipeline.experience import pruner_options

    flag = next(a for a in build_parser()._actions if "--dppo-prompt-score" in a.option_strings)
    assert tuple(flag.choices) == PROMPT_SCORES  # the parser's copy of the names stays the pruner's
    name, options = pruner_options(parse_args(["--dppo-prompt-score", "unsolved_rate"]))
    assert build_pruner(name, **options).prompt_score == "unsolved_rate"
    name, options = pruner_options(parse_args([]))
    assert build_pruner(name, **options).prompt_score == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--algorithm", "grpo", "--dppo-prompt-score", "unsolved_rate"])
    assert "--dppo-prompt-score only applies to --algorithm dppo" in capsys.readouterr().err


def test_run_progress_follows_whichever_of_steps_and_time_budget_ends_the_run():
    from megatron_dppo.pipeline.experience import run_progress

    assert run_progress(5, 10.0, train_iters=20, time_budget_s=None) == 0.25
    assert run_progress(5, 10.0, train_iters=None, time_budget_s=40.0) == 0.25  # a time-budgeted run
    assert run_progress(5, 30.0, train_iters=20, time_budget_s=40.0) == 0.75  # the budget ends it first
    assert run_progress(50, 90.0, train_iters=20, time_budget_s=40.0) == 1.0
    assert run_progress(5, 10.0, train_iters=None, time_budget_s=None) == 0.0


def test_a_prompt_without_a_recorded_length_is_never_a_candidate():
    rewards, advantages, lengths = random_batch(num_prompts=4)
    history = PromptHistory()
    history.update([0, 1], score_prompts(rewards[:2], advantages[:2]))  # scores, no lengths
    history.update([2, 3], score_prompts(rewards[2:], advantages[2:]), lengths[2:].double().mean(dim=1))
    pruner = build_pruner("dppo", keep_policy="uniform", candidates="all", **PRUNER_OPTIONS["dppo"])
    for step in range(20):
        decision = pruner.select_prompts(range(4), history, step)
        assert decision.keep_probs[:2].tolist() == [1.0, 1.0] and (decision.keep_probs[2:] < 1).all()
        counts = full_batch_counts(decision, lengths[decision.kept])
        assert counts.num_response_tokens == pytest.approx(
            float(lengths[:2].sum()) + 4 * float(lengths[2:].double().mean(dim=1).sum()))
    decision = pruner.select_prompts(range(4), history, 0)
    decision.expected_response_lengths[2] = float("nan")
    with pytest.raises(ValueError, match="has no history response length"):
        full_batch_counts(decision, lengths[decision.kept])


def test_normalizer_scale_estimate_is_real_over_counted_tokens_and_one_when_lengths_are_current():
    """The step metric that watches the history's staleness: real tokens (kept prompts' over their p) / Z."""
    from megatron_dppo.algo.pruning import PromptDecision, full_batch_counts, normalizer_scale_estimate

    probs = torch.tensor([1.0, 0.5, 0.5, 0.25], dtype=torch.float64)
    history = torch.tensor([math.nan, 10.0, 10.0, 20.0], dtype=torch.float64)  # G = 2: estimates 20, 20, 40
    kept = torch.tensor([0, 2, 3])
    decision = PromptDecision(kept, 1 / probs[kept], probs, history)
    lengths = torch.tensor([[3, 5], [12, 12], [30, 30]])  # prompt 2 grew from 10 to 12, prompt 3 from 20 to 30
    counts = full_batch_counts(decision, lengths)
    assert counts.num_response_tokens == 8 + 20 + 20 + 40
    expected = (8 + 24 / 0.5 + 60 / 0.25) / 88
    assert normalizer_scale_estimate(decision, lengths, counts) == pytest.approx(expected)
    # nothing could be pruned: Z is the real count and the scale 1 exactly
    every = PromptDecision.keep_all(2)
    both = torch.tensor([[4, 6], [7, 1]])
    assert normalizer_scale_estimate(every, both, full_batch_counts(every, both)) == 1.0
    # current lengths: unbiased for 1 over the keep draw (every subset of prompts 1..3 weighted by its probability)
    current = torch.tensor([[4, 4], [10, 10], [10, 10], [20, 20]])
    mean = 0.0
    for coins in itertools.product([0, 1], repeat=3):
        chosen = [0] + [i + 1 for i, coin in enumerate(coins) if coin]
        chance = math.prod(float(probs[i + 1]) if coin else 1 - float(probs[i + 1]) for i, coin in enumerate(coins))
        rows = torch.tensor(chosen)
        draw = PromptDecision(rows, 1 / probs[rows], probs, torch.tensor([math.nan, 10.0, 10.0, 20.0],
                                                                         dtype=torch.float64))
        mean += chance * normalizer_scale_estimate(draw, current[rows], full_batch_counts(draw, current[rows]))
    assert mean == pytest.approx(1.0)

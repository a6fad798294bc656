"""DPPO's prompt level as sampled since the fixed-size design: systematic sampling's inclusion frequencies, exactly the
batch kept every step, the success-rate predictor (a stratum's Beta prior and a prompt's own passes), and the in-step
probe (exactly the batch continued, unbiased for the drawn prompts' expected gradient norm under independent
sampling noise)."""

import math

import pytest
import torch

from megatron_dppo.algo import PromptHistory, build_pruner, full_batch_counts
from megatron_dppo.algo.beta_binomial import all_equal_probability, prior_matching
from megatron_dppo.algo.pruning import proportional_keep_probs, step_generator
from megatron_dppo.algo.sampling_designs import bernoulli, systematic
from megatron_dppo.errors import UserInputError
from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.pipeline.experience import ExperienceMaker
from megatron_dppo.pipeline.tasks import Prompt, Task
from megatron_dppo.rewards import RewardBatch
from megatron_dppo.rollout.client import Completion

G = 4


def inclusion_frequencies(design, inclusion: torch.Tensor, draws: int) -> tuple[torch.Tensor, set[int]]:
    counts, sizes = torch.zeros(inclusion.numel(), dtype=torch.float64), set()
    for step in range(draws):
        kept = design(inclusion, step_generator(7, step, 0))
        assert kept.unique().numel() == kept.numel()  # no item twice
        counts[kept] += 1
        sizes.add(kept.numel())
    return counts / draws, sizes


def worst_z(frequencies: torch.Tensor, inclusion: torch.Tensor, draws: int) -> float:
    """The largest |frequency - π| in standard errors of a binomial proportion; items with π = 1 must be always in."""
    certain = inclusion >= 1.0
    assert (frequencies[certain] == 1.0).all()
    errors = (inclusion[~certain] * (1 - inclusion[~certain]) / draws).sqrt()
    return float(((frequencies[~certain] - inclusion[~certain]).abs() / errors).max())


@pytest.mark.parametrize("total", [12.0, 11.5])
def test_systematic_sampling_keeps_each_item_with_its_inclusion_probability_and_their_sum_items(total):
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(30, generator=generator, dtype=torch.float64)
    scores[:3] = 10.0  # saturated: kept every time
    inclusion = proportional_keep_probs(scores, total / 30, 0.05)
    assert inclusion.sum().item() == pytest.approx(total)
    draws = 20000
    frequencies, sizes = inclusion_frequencies(systematic, inclusion, draws)
    # 27 free items: under a correct design the largest of 27 |z| exceeds 4.5 about once in 5,000 runs
    assert worst_z(frequencies, inclusion, draws) < 4.5
    assert sizes == ({12} if total == 12.0 else {11, 12})  # exactly Σπ, or the two whole numbers around it


def test_bernoulli_sampling_keeps_each_item_with_its_probability_and_a_varying_count():
    inclusion = proportional_keep_probs(torch.linspace(0.1, 1.0, 20, dtype=torch.float64), 0.4, 0.05)
    frequencies, sizes = inclusion_frequencies(bernoulli, inclusion, 10000)
    assert worst_z(frequencies, inclusion, 10000) < 4.5 and len(sizes) > 3


def saturated_history(num_prompts=40) -> tuple[PromptHistory, list[str]]:
    """Half the prompts all-right twice, half mixed (2 of 4): a pool share of one half."""
    history = PromptHistory()
    for _ in range(2):
        for i in range(num_prompts):
            history.update([i], [0.0], [10.0], rewards=[[1.0] * G if i % 2 else [1.0, 0.0, 1.0, 0.0]],
                           difficulties=["cell"])
    return history, ["cell"] * num_prompts


def test_without_the_refill_the_systematic_design_keeps_the_rate_s_share_of_the_batch_not_all_of_it():
    """--no-dppo-refill draws the batch itself (M = B); the trainer still passes B as the target, and the level keeps
    M (1 - r) of it (it had kept all B: no prompt pruned at all)."""
    history, difficulties = saturated_history(16)
    pruner = build_pruner("dppo", group_size=G, refill=False, prompt_prune_rate=0.5)
    assert pruner.prompts_to_sample(16, history) == 16
    for step in range(20):
        decision = pruner.select_prompts(list(range(16)), history, step, difficulties, batch_size=16)
        assert len(decision.kept) == 8, step


@pytest.mark.parametrize("score", ["success_rate", "zero_variance"])
def test_the_default_prompt_level_keeps_exactly_the_batch_every_step_informative_prompts_first(score):
    history, difficulties = saturated_history()
    pruner = build_pruner("dppo", group_size=G, prompt_score=score)
    drawn = pruner.prompts_to_sample(8, history)
    assert drawn > 8
    for step in range(200):
        decision = pruner.select_prompts(list(range(drawn)), history, step, difficulties[:drawn], batch_size=8)
        assert len(decision.kept) == 8
    assert decision.keep_probs.sum().item() == pytest.approx(8.0)
    assert decision.keep_probs.min().item() >= 0.2 - 1e-12  # the floor, --dppo-prompt-p-min
    order = decision.predicted_zero_variance.argsort()
    assert (decision.keep_probs[order].diff() <= 1e-12).all()  # less likely zero-variance, more likely kept


@pytest.mark.parametrize("batch_size", [9, None])  # the refill's B, or M (1 - r) of the drawn (the level's default)
@pytest.mark.parametrize("design", ["systematic", "bernoulli"])
def test_either_design_is_unbiased_for_the_drawn_batch_and_counts_it_whole(design, batch_size):
    history, difficulties = saturated_history(24)
    pruner = build_pruner("dppo", group_size=G, prompt_sampling=design)
    values = torch.arange(1.0, 25.0, dtype=torch.float64)  # any per-prompt term of the loss
    lengths = torch.full((24, G), 10)
    totals, counts = [], set()
    for step in range(4000):
        decision = pruner.select_prompts(list(range(24)), history, step, difficulties, batch_size=batch_size)
        totals.append(float((values[decision.kept] * decision.weights).sum()))
        counts.add(full_batch_counts(decision, lengths[decision.kept]).num_sequences)
    mean, error = torch.tensor(totals).mean().item(), torch.tensor(totals).std().item() / math.sqrt(len(totals))
    assert abs(mean - float(values.sum())) < 4 * error  # Horvitz-Thompson: E[Σ kept w x] = Σ drawn x
    assert counts == {24.0 * G}  # the normaliser counts the drawn batch, whatever the draw kept


def test_success_rate_prior_of_a_stratum_of_all_right_and_all_wrong_prompts_is_u_shaped():
    history = PromptHistory(sample_weight=1.0)  # a sample's full weight: each prompt's one visit speaks clearly
    one_of_eight, four_of_eight = [1.0, 0, 0, 0, 0, 0, 0, 0], [1.0, 1, 1, 1, 0, 0, 0, 0]
    rewards = [[1.0] * 8] * 20 + [[0.0] * 8] * 50 + [one_of_eight] * 10 + [four_of_eight] * 10
    history.update(range(90), torch.zeros(90), torch.full((90,), 10.0), rewards=rewards, difficulties=["s"] * 90)
    a, b = history.success_rate_posterior([1000], ["s"])  # never seen: the stratum's prior alone
    assert a.item() < 1.0 and b.item() < 1.0  # U-shaped: most prompts pass always or never
    z_unseen = all_equal_probability(a, b, 8).item()
    # the stratum's (recency-weighted) share of zero-variance groups, 70 of 90 unweighted
    assert z_unseen == pytest.approx(history.zero_variance_share(), abs=1e-6) and z_unseen > 0.6
    a, b = history.success_rate_posterior([75, 85, 0, 30], ["s"] * 4)  # 1/8, 4/8, 8/8 and 0/8 passed
    z = all_equal_probability(a, b, 8).tolist()
    assert z[1] < z[0] < min(z[2], z[3])  # a prompt's own passes, not only whether its group varied
    lighter = PromptHistory(sample_weight=0.25)
    lighter.load_state_dict({**history.state_dict(), "sample_weight": 0.25})
    lighter.update([75], [0.0], [10.0], rewards=[one_of_eight], difficulties=["s"])  # its second 1-of-8 visit
    history.update([75], [0.0], [10.0], rewards=[one_of_eight], difficulties=["s"])
    a_light, b_light = lighter.success_rate_posterior([75], ["s"])
    a_full, b_full = history.success_rate_posterior([75], ["s"])
    assert b_full.item() - b_light.item() == pytest.approx(7 * 0.75)  # the second visit's 7 fails weigh 0.25 each


def test_the_stratum_prior_matches_its_groups_mean_and_zero_variance_share():
    generator = torch.Generator().manual_seed(1)
    rates = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(1.2)).sample((20000,))
    passes = torch.binomial(torch.full((20000,), 8.0), rates, generator=generator)
    share = float(((passes == 0) | (passes == 8)).double().mean())
    a, b = prior_matching(float((passes / 8).mean()), share, 8)
    assert a == pytest.approx(0.4, rel=0.1) and b == pytest.approx(1.2, rel=0.1)  # a Beta world is recovered
    a, b = torch.tensor([a]), torch.tensor([b])
    assert all_equal_probability(a, b, 8).item() == pytest.approx(share, abs=1e-6)
    assert (a / (a + b)).item() == pytest.approx(float((passes / 8).mean()))


def test_a_graded_reward_turns_auto_to_the_zero_variance_score_and_stops_an_explicit_success_rate_and_the_probe():
    """The default `auto` ranks by the success-rate belief while every reward is 0 or 1, and by the zero-variance
    predictor once a graded reward was recorded (the two differ on the same history); an explicit success_rate and the
    probe, which count passes, stop with one line naming the flag to change."""
    history = PromptHistory()
    history.update([0, 1], [0.0, 1.0], [10.0, 10.0], rewards=[[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]],
                   difficulties=["s", "s"])
    auto = build_pruner("dppo", group_size=4)
    assert auto.prompt_score == "auto" and auto.score_used(history) == "success_rate"
    torch.testing.assert_close(auto.predictions([0, 1], history, ["s", "s"])[0],
                               build_pruner("dppo", group_size=4, prompt_score="success_rate").predictions(
                                   [0, 1], history, ["s", "s"])[0])
    history.update([2], [0.0], [10.0], rewards=[[0.5, 1.0, 0.0, 1.0]], difficulties=["s"])
    assert auto.score_used(history) == "zero_variance"
    torch.testing.assert_close(auto.predictions([0, 1], history, ["s", "s"])[0],
                               build_pruner("dppo", group_size=4, prompt_score="zero_variance").predictions(
                                   [0, 1], history, ["s", "s"])[0])
    decision = auto.select_prompts([0, 1, 2, 3], history, step=1, difficulties=["s"] * 4, batch_size=2)
    assert len(decision.kept) == 2
    with pytest.raises(UserInputError, match="--dppo-prompt-score auto or zero_variance"):
        build_pruner("dppo", group_size=4, prompt_score="success_rate").predictions([0], history, ["s"])
    probe = build_pruner("dppo", group_size=4, probe_samples=2)
    with pytest.raises(UserInputError, match="drop --dppo-probe-samples"):
        probe.select_continuations([0, 1], history, ["s", "s"], torch.tensor([1.0, 2.0]), 1, step=1)


def test_history_state_round_trips_the_success_counts():
    history, difficulties = saturated_history(10)
    history.update_probe([3, 4], [0.0, 2.0], 2)
    restored = PromptHistory()
    restored.load_state_dict(history.state_dict())
    for a, b in zip(restored.success_rate_posterior(range(12), ["cell"] * 12),
                    history.success_rate_posterior(range(12), ["cell"] * 12)):
        torch.testing.assert_close(a, b)


def test_probe_continues_exactly_the_count_those_whose_probe_varied_first():
    history, difficulties = saturated_history(16)
    pruner = build_pruner("dppo", group_size=G, probe_samples=2)
    passes = torch.tensor([1.0, 0, 2, 1] * 4)  # 8 probes varied (1 of 2), 8 agreed
    for step in range(100):
        continued, inclusion, informative = pruner.select_continuations(list(range(16)), history, difficulties,
                                                                        passes, 6, step)
        assert len(continued) == 6 and set(continued.tolist()) <= set(range(16))
    assert (informative[passes == 1] == 1.0).all() and (informative[passes != 1] < 1.0).all()
    assert inclusion.sum().item() == pytest.approx(6.0)
    assert inclusion[passes == 1].min() > inclusion[passes != 1].max()


# --------------------------------------------------------------------------- the probe through the experience maker


class BernoulliWorld:
    """Rollout servers over prompts of known success rates: a sample passes when a hash of its seed falls below the
    prompt's rate, so samples are independent draws (the same seed, the same sample)."""

    def __init__(self, rates: dict[int, float]):
        self.rates = rates

    def completion(self, index: int, prompt_token: int, seed: int) -> Completion:
        uniform = torch.rand(1, generator=torch.Generator().manual_seed(seed % (2**63))).item()
        return Completion(index, 0, [7] if uniform < self.rates[prompt_token] else [8, 8], [-0.1], "stop", None)

    def generate_requests(self, requests, params):
        return [self.completion(i, request.input_ids[0], request.seed) for i, request in enumerate(requests)]

    def generate(self, prompts, params, n=1):
        return [self.completion(index, prompt[0], params.sample_seed(index, sample, n))
                for index, prompt in enumerate(prompts) for sample in range(n)]


class PassTokenizer:
    eos_token_id = 0

    def decode(self, ids):
        return "right" if ids == [7] else "wrong"


def expected_sum_squared_advantages(rate: float, group_size: int) -> float:
    """E[Σ_j A_j²] of a group of `group_size` Bernoulli(rate) samples under grpo's advantages: G - 1 unless equal."""
    return (group_size - 1) * (1.0 - rate ** group_size - (1.0 - rate) ** group_size)


def test_the_probe_keeps_the_step_unbiased_for_every_drawn_prompts_expected_gradient_norm():
    """Σ over the kept samples of w A² estimates Σ over the drawn prompts of E[Σ_j A_j²], which is known in closed form
    from each prompt's success rate: the sampling noise of the samples is independent of the estimator's."""
    group = 4
    rates = {i: [0.0, 1.0, 0.5, 0.1, 0.9, 0.3][i % 6] for i in range(48)}
    prompts = [Prompt(i, [i], "right", difficulty=f"cell{i % 2}") for i in range(48)]
    drawn: list[list[int]] = []
    task = Task(prompts, [], lambda responses, rows: RewardBatch.of([float(r == row.label)
                                                                     for r, row in zip(responses, rows)]), seed=0)
    next_prompts = task.next_prompts
    task.next_prompts = lambda count: drawn.append([p.prompt_id for p in next_prompts(count)]) or [
        prompts[i] for i in drawn[-1]]
    args = parse_args(["--n-samples-per-prompt", str(group), "--rollout-batch-size", "4", "--dppo-probe-samples", "2",
                       "--dppo-completion-prune-rate", "0", "--data-train-size", "48"])
    maker = ExperienceMaker(args, task, PassTokenizer(), BernoulliWorld(rates))
    differences, continued_counts = [], set()
    for step in range(1, 1201):
        rollouts = maker.generate(step)
        experience = maker.make(rollouts, step, 0.0)
        estimate = sum(s.sample_weight * s.advantage ** 2 for s in experience.samples)
        truth = sum(expected_sum_squared_advantages(rates[i], group) for i in drawn[-1])
        differences.append(estimate - truth)
        if step > 1:  # the first step has no history to probe with: one round of the batch
            continued_counts.add(int(rollouts.stats["groups_rolled_out"]))
            assert rollouts.stats["probe_groups"] == 8 and rollouts.stats["rollout_rounds"] == 2
    differences = torch.tensor(differences, dtype=torch.float64)
    mean, error = differences.mean().item(), differences.std().item() / math.sqrt(len(differences))
    assert abs(mean) < 4 * error, (mean, error)
    assert continued_counts == {4}  # exactly the batch continued every step

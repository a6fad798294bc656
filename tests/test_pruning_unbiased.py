"""Monte-Carlo checks of DPPO's claim: stochastic pruning with weights 1/p leaves the expected gradient unchanged.

Setup: a fixed batch of 6 prompts × 4 completions scored by a tiny softmax policy, with the full loss (clip-higher,
dual-clip, k3 KL, entropy bonus, truncated IS). The loss is linear in the per-sample weights, so the gradient of a
draw is J^T w / Z with J the per-sample gradients [samples, params]; that identity is checked against autograd on
the kept samples of a few draws, and then 20,000 draws per keep policy cost one matrix product.
"""

import functools

import pytest
import torch

from megatron_dppo.algo import (
    AGGREGATIONS,
    LossConfig,
    PromptHistory,
    build_pruner,
    compute_advantages,
    loss_normalizer,
    score_prompts,
)
from tests.test_losses import FULL_CONFIG, make_policy_batch

PROMPTS, GROUP, DRAWS = 6, 4, 20_000
PROMPT_IDS = list(range(100, 100 + PROMPTS))
DPPO_OPTIONS = dict(prompt_prune_rate=0.5, completion_prune_rate=0.5, seed=3)


@functools.cache
def fixed_batch():
    generator = torch.Generator().manual_seed(0)
    success = torch.tensor([0.2, 0.5, 0.8, 0.5, 0.3, 1.0], dtype=torch.float64)[:, None].expand(PROMPTS, GROUP)
    rewards = torch.bernoulli(success, generator=generator)  # the last group is all correct: zero advantage
    rewards[0, 0], rewards[1, :2] = 1.0, torch.tensor([0.0, 1.0], dtype=torch.float64)  # no other constant group
    advantages = compute_advantages(rewards)
    lengths = torch.randint(2, 9, (PROMPTS, GROUP), generator=generator)
    history = PromptHistory()
    # the history remembers each prompt's score up to noise, and its mean length exactly, from an earlier visit
    noisy_scores = score_prompts(rewards, advantages) * (1 + 0.3 * torch.rand(PROMPTS, generator=generator))
    history.update(PROMPT_IDS, noisy_scores, lengths.double().mean(dim=1))
    batch = make_policy_batch(lengths.reshape(-1), advantages.reshape(-1), seed=1)
    return rewards, advantages, lengths, history, batch


def loss_config(aggregation: str) -> LossConfig:
    return LossConfig(**FULL_CONFIG, aggregation=aggregation)


@functools.cache
def per_sample_gradients(aggregation: str) -> torch.Tensor:
    return fixed_batch()[4].per_sample_gradients(loss_config(aggregation))  # [samples, params]


def draw(pruner, step: int):
    """One pruning draw on the fixed batch: (weights [samples] with 0 for pruned samples, decision)."""
    rewards, advantages, lengths, history, _ = fixed_batch()
    prompt_decision = pruner.select_prompts(PROMPT_IDS, history, step)
    kept_prompts = prompt_decision.kept
    decision = pruner.select_completions(
        rewards[kept_prompts], advantages[kept_prompts], lengths[kept_prompts], prompt_decision, history, step
    )
    flat_ids = (kept_prompts[:, None] * GROUP + torch.arange(GROUP)).reshape(-1)[decision.kept]
    weights = torch.zeros(PROMPTS * GROUP, dtype=torch.float64)
    weights[flat_ids] = decision.weights
    return weights, decision


@functools.cache
def stochastic_draws(keep_policy: str):
    """[DRAWS, samples] weights of DRAWS stochastic DPPO draws, and the set of normaliser bases they used."""
    pruner = build_pruner("dppo", keep_policy=keep_policy, **DPPO_OPTIONS)
    weights, full_batches = torch.zeros(DRAWS, PROMPTS * GROUP, dtype=torch.float64), set()
    for step in range(DRAWS):
        weights[step], decision = draw(pruner, step)
        full_batches.add(decision.full_batch)
    return weights, full_batches


def full_gradient(aggregation: str) -> torch.Tensor:
    lengths = fixed_batch()[2]
    config = loss_config(aggregation)
    full = {"token-mean": float(lengths.sum()), "seq-mean-token-mean": float(lengths.numel())}
    normalizer = full.get(aggregation, lengths.numel() * config.max_response_length)
    return per_sample_gradients(aggregation).sum(dim=0) / normalizer


def draw_gradients(keep_policy: str, aggregation: str) -> torch.Tensor:
    weights, full_batches = stochastic_draws(keep_policy)
    (full_batch,) = full_batches
    return weights @ per_sample_gradients(aggregation) / loss_normalizer(loss_config(aggregation), full_batch)


def test_draw_gradient_equals_autograd_of_the_weighted_loss_on_kept_samples():
    batch = fixed_batch()[4]
    pruner = build_pruner("dppo", keep_policy="proportional", **DPPO_OPTIONS)
    for aggregation in AGGREGATIONS:
        for step in (0, 1, 2):
            weights, decision = draw(pruner, step)
            normalizer = loss_normalizer(loss_config(aggregation), decision.full_batch)
            kept = weights.nonzero().squeeze(1)
            autograd = batch.gradient(batch.loss(loss_config(aggregation), weights, normalizer, samples=kept)[0])
            linear = weights @ per_sample_gradients(aggregation) / normalizer
            torch.testing.assert_close(autograd, linear, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("keep_policy", ["uniform", "proportional"])
def test_stochastic_pruning_gradient_is_unbiased(keep_policy):
    weights, full_batches = stochastic_draws(keep_policy)
    # the normaliser is fixed before the draw, and equals the true full batch's (the history knows the lengths)
    assert len(full_batches) == 1
    (full_batch,) = full_batches
    assert full_batch.num_sequences == PROMPTS * GROUP
    assert full_batch.num_response_tokens == pytest.approx(float(fixed_batch()[2].sum()), rel=1e-12)
    kept_fraction = (weights > 0).double().mean().item()
    assert kept_fraction == pytest.approx(0.25, abs=0.01), "both levels prune half in expectation"
    for aggregation in AGGREGATIONS:
        gradients = draw_gradients(keep_policy, aggregation)  # [DRAWS, params]
        standard_error = gradients.std(dim=0) / DRAWS**0.5
        deviation = (gradients.mean(dim=0) - full_gradient(aggregation)).abs()
        worst = (deviation / standard_error).max().item()
        print(f"{keep_policy} {aggregation}: max |mean - full| / SE = {worst:.2f} over {len(deviation)} coordinates")
        assert (deviation <= 4 * standard_error + 1e-12).all(), f"{aggregation}: {worst:.2f} standard errors"


@pytest.mark.parametrize("biased_pruner", ["dppo-deterministic", "cppo"])
def test_deterministic_dppo_and_cppo_gradients_are_biased(biased_pruner):
    if biased_pruner == "cppo":
        pruner = build_pruner("cppo", prune_rate=0.75)  # keeps 1 of 4 per group: the same kept fraction, 0.25
    else:
        pruner = build_pruner("dppo", mode="deterministic", **DPPO_OPTIONS)
    weights, decision = draw(pruner, step=0)
    assert 0.2 <= (weights > 0).double().mean().item() <= 0.5
    for aggregation in AGGREGATIONS:
        gradient = weights @ per_sample_gradients(aggregation) / loss_normalizer(
            loss_config(aggregation), decision.full_batch
        )
        noise = draw_gradients("uniform", aggregation).std(dim=0) / DRAWS**0.5  # the unbiased estimate's SE
        bias = (gradient - full_gradient(aggregation)).norm().item()
        print(f"{biased_pruner} {aggregation}: |bias| = {bias:.3e}, |SE| of stochastic DPPO = {noise.norm():.3e}")
        assert bias > 4 * noise.norm().item()


def test_proportional_keep_probabilities_lower_gradient_variance():
    for aggregation in AGGREGATIONS:
        variances = {}
        for keep_policy in ("uniform", "proportional"):
            error = draw_gradients(keep_policy, aggregation) - full_gradient(aggregation)
            variances[keep_policy] = error.square().sum(dim=1).mean().item()
        kept = {policy: (stochastic_draws(policy)[0] > 0).double().mean().item() for policy in variances}
        ratio = variances["proportional"] / variances["uniform"]
        print(f"{aggregation}: kept fraction uniform {kept['uniform']:.3f} proportional {kept['proportional']:.3f}; "
              f"variance ratio proportional / uniform = {ratio:.3f}")
        assert abs(kept["uniform"] - kept["proportional"]) < 0.01
        assert ratio < 1.0

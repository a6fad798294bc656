"""Kept fraction vs gradient error of the pruners, on batches shaped like MATH.

batch: 32 MATH training problems × G=8 completions; a completion's length is its problem's reference-solution length
(characters / 4 ≈ tokens) times log-normal noise, capped at 1024; its reward is Bernoulli with a pass rate set by
the problem's level (synthetic: no model is run). A tiny softmax policy scores the tokens, and the loss is the full
GRPO loss (clip-higher, k3 KL, entropy bonus, seq-mean-token-mean). The history a DPPO prompt pruner reads is one
earlier visit of the same prompts (fresh rewards, same pass rate).

For each pruner and target kept fraction: relative error |g_pruned - g_full| / |g_full| of the gradient, averaged
over 200 draws for the stochastic ones (the deterministic ones give one value), then the median over 5 batches;
"vs uniform" divides by dppo-uniform at the same kept fraction. DPPO prunes both levels at rate 1 - sqrt(f).
A second table prunes prompts only (rate 0.5) and compares the gradient MSE of proportional keep probabilities at
several prompt floors with uniform: how much a one-visit history score can be trusted.
Last line: gradient variance E|g_pruned - g_full|² of dppo-proportional over dppo-uniform at kept fraction 0.5.
"""

import argparse
import json
import math
import statistics

import torch

from megatron_dppo.algo import (
    DPPOConfig,
    FullBatchInfo,
    LossConfig,
    PromptHistory,
    build_pruner,
    compute_advantages,
    full_batch_counts,
    loss_normalizer,
    policy_loss,
    score_prompts,
)
from megatron_dppo.data.paths import shared_data_dir

PROMPTS, GROUP, MAX_LENGTH, VOCAB, FEATURES = 32, 8, 1024, 16, 8
MEAN_PASS_RATE = {"Level 1": 0.8, "Level 2": 0.65, "Level 3": 0.5, "Level 4": 0.35, "Level 5": 0.2}
LOSS = LossConfig(eps_low=0.2, eps_high=0.28, kl_coef=0.01, kl_type="k3", entropy_coef=0.001)
KEPT_FRACTIONS = (0.75, 0.5, 0.25)
PROMPT_FLOORS = (0.05, 0.1, 0.2, 0.3)


def load_math_problems() -> list[tuple[float, float]]:
    """(reference length in tokens, pass rate) per MATH training problem."""
    with open(shared_data_dir() / "math" / "train.jsonl") as file:
        rows = [json.loads(line) for line in file]
    mean = torch.tensor([MEAN_PASS_RATE.get(row["level"], 0.5) for row in rows], dtype=torch.float64)
    with torch.random.fork_rng():  # Beta sampling takes no generator
        torch.manual_seed(1234)
        # Beta(mean, 1 - mean) is U-shaped: most problems are almost always or almost never solved, as in RL runs
        pass_rate = torch.distributions.Beta(mean, 1 - mean).sample()
    return [(min(len(row["solution"]) / 4, MAX_LENGTH), float(rate)) for row, rate in zip(rows, pass_rate)]


def sample_batch(problems, generator):
    """rewards, advantages, lengths [PROMPTS, GROUP] of one batch, and a history of an earlier visit."""
    chosen = torch.randperm(len(problems), generator=generator)[:PROMPTS].tolist()
    reference_length = torch.tensor([problems[i][0] for i in chosen], dtype=torch.float64)[:, None]
    pass_rate = torch.tensor([problems[i][1] for i in chosen], dtype=torch.float64)[:, None].expand(PROMPTS, GROUP)

    def visit():
        noise = torch.exp(0.3 * torch.randn(PROMPTS, GROUP, generator=generator, dtype=torch.float64))
        lengths = (reference_length * noise).round().clamp(4, MAX_LENGTH).long()
        rewards = torch.bernoulli(pass_rate, generator=generator)
        return rewards, compute_advantages(rewards), lengths

    earlier_rewards, earlier_advantages, earlier_lengths = visit()
    history = PromptHistory()
    history.update(range(PROMPTS), score_prompts(earlier_rewards, earlier_advantages),
                   earlier_lengths.double().mean(dim=1))
    return (*visit(), history)


def per_sample_gradients(advantages, lengths, generator) -> torch.Tensor:
    """[samples, params]: each sample's loss gradient (weight 1, normaliser 1) under a random tiny policy."""
    weight = torch.randn(FEATURES, VOCAB, generator=generator, dtype=torch.float64).requires_grad_()
    gradients = []
    for advantage, length in zip(advantages.reshape(-1).tolist(), lengths.reshape(-1).tolist()):
        features = torch.randn(length, FEATURES, generator=generator, dtype=torch.float64)
        tokens = torch.randint(0, VOCAB, (length,), generator=generator)
        log_probs = torch.log_softmax(features @ weight, dim=-1)
        logprobs = log_probs.gather(1, tokens[:, None]).squeeze(1)
        noise = 0.2 * torch.randn(2, length, generator=generator, dtype=torch.float64)
        loss, _ = policy_loss(
            LOSS, logprobs=logprobs, old_logprobs=logprobs.detach() + noise[0],
            advantages=torch.full((length,), advantage, dtype=torch.float64), loss_mask=torch.ones(length),
            sample_weights=torch.ones(length), sample_ids=torch.zeros(length, dtype=torch.long), normalizer=1.0,
            ref_logprobs=logprobs.detach() + noise[1], entropy=-(log_probs.exp() * log_probs).sum(-1),
        )
        gradients.append(torch.autograd.grad(loss, weight)[0].reshape(-1))
    return torch.stack(gradients)


def draw_gradient(pruner, batch, gradients, step) -> tuple[torch.Tensor, float]:
    """(pruned gradient, kept fraction) of one draw."""
    rewards, advantages, lengths, history = batch
    prompt_decision = pruner.select_prompts(list(range(PROMPTS)), history, step)
    kept = prompt_decision.kept
    full_batch = full_batch_counts(prompt_decision, lengths[kept])
    decision = pruner.select_completions(rewards[kept], advantages[kept], lengths[kept], prompt_decision, full_batch,
                                         step)
    flat_ids = (kept[:, None] * GROUP + torch.arange(GROUP)).reshape(-1)[decision.kept]
    weights = torch.zeros(PROMPTS * GROUP, dtype=torch.float64).index_put_((flat_ids,), decision.weights)
    return weights @ gradients / loss_normalizer(LOSS, decision.normalizer_counts), len(flat_ids) / (PROMPTS * GROUP)


def pruners(seed: int) -> dict:
    """{(pruner name, kept fraction): pruner}: the main table, then prompt-level-only DPPO at several floors.
    Every item is a candidate here (candidates="all"), so a level's rate is its expected pruned fraction."""
    table = {}
    for kept_fraction in KEPT_FRACTIONS:
        rate = 1 - math.sqrt(kept_fraction)  # both DPPO levels at this rate keep kept_fraction in expectation
        table[("dppo-uniform", kept_fraction)] = build_pruner(
            "dppo", prompt_prune_rate=rate, completion_prune_rate=rate, keep_policy="uniform", candidates="all",
            seed=seed)
        table[("dppo-proportional", kept_fraction)] = build_pruner(
            "dppo", prompt_prune_rate=rate, completion_prune_rate=rate, keep_policy="proportional", candidates="all",
            seed=seed)
        table[("cppo", kept_fraction)] = build_pruner("cppo", prune_rate=1 - kept_fraction)
        table[("d3s", kept_fraction)] = build_pruner(
            "d3s", sample_fraction_init=kept_fraction, sample_fraction_final=kept_fraction,
            token_fraction_init=1.0, token_fraction_final=1.0)
    prompt_level = dict(prompt_prune_rate=0.5, completion_prune_rate=0.0, candidates="all", seed=seed)
    table[("prompt-level uniform", 0.5)] = build_pruner("dppo", keep_policy="uniform", **prompt_level)
    for floor in PROMPT_FLOORS:
        table[(f"prompt-level proportional, prompt_p_min {floor}", 0.5)] = build_pruner(
            "dppo", keep_policy="proportional", prompt_p_min=floor, **prompt_level)
    return table


def measure(batches: int, draws: int, seed: int):
    """{(pruner, kept fraction): per batch (mean relative error, mean squared error, mean kept fraction)}."""
    problems = load_math_problems()
    generator = torch.Generator().manual_seed(seed)
    results = {}
    for batch_index in range(batches):
        batch = sample_batch(problems, generator)
        gradients = per_sample_gradients(batch[1], batch[2], generator)
        full = gradients.sum(dim=0) / loss_normalizer(LOSS, FullBatchInfo.from_lengths(batch[2]))
        for key, pruner in pruners(seed + batch_index).items():
            stochastic = isinstance(pruner.config, DPPOConfig) and pruner.config.mode == "stochastic"
            samples = [draw_gradient(pruner, batch, gradients, step) for step in range(draws if stochastic else 1)]
            errors = [(gradient - full).norm().item() for gradient, _ in samples]
            results.setdefault(key, []).append((
                statistics.fmean(errors) / full.norm().item(),
                statistics.fmean(error**2 for error in errors),
                statistics.fmean(kept for _, kept in samples),
            ))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = measure(args.batches, args.draws, args.seed)

    def median(key, column):
        return statistics.median(row[column] for row in results[key])

    print(f"{'pruner':<20}{'target kept':>12}{'kept':>8}{'rel. grad error':>17}{'vs uniform':>12}")
    for name, kept_fraction in results:
        if kept_fraction in KEPT_FRACTIONS and not name.startswith("prompt-level"):
            key, baseline = (name, kept_fraction), median(("dppo-uniform", kept_fraction), 0)
            print(f"{name:<20}{kept_fraction:>12.2f}{median(key, 2):>8.3f}{median(key, 0):>17.4f}"
                  f"{median(key, 0) / baseline:>12.3f}")
    print(f"\n{'prompt level only, kept 0.5':<48}{'grad MSE':>12}{'vs uniform':>12}")
    baseline = median(("prompt-level uniform", 0.5), 1)
    for name, _ in results:
        if name.startswith("prompt-level"):
            print(f"{name:<48}{median((name, 0.5), 1):>12.3e}{median((name, 0.5), 1) / baseline:>12.3f}")
    ratio = median(("dppo-proportional", 0.5), 1) / median(("dppo-uniform", 0.5), 1)
    print(f"dppo_proportional_vs_uniform_variance_ratio: {ratio:.4f}")


if __name__ == "__main__":
    main()

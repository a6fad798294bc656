"""Keep policies compared at equal kept fractions, on the items that carry gradient, on batches shaped like MATH.

    batch: 32 MATH training problems whose group of G=8 has reward variance ─► their per-sample loss gradients
    ─► each pruner at each target kept fraction, many draws ─► kept fraction, gradient error against the full batch

Only groups with reward variance make a batch: a group whose rewards are all equal has A = 0 and no policy gradient,
so pruning it is free under any keep policy, and a batch full of them lets a policy look perfect by pruning nothing
of value (this bench's earlier tables did: every policy's error was 0). Here every completion has A != 0 and every
group has variance, so every pruned item costs variance and the policies are compared at the same expected kept
fraction of items that teach. A completion's length is its problem's reference-solution length (characters / 4 ≈
tokens) times log-normal noise, capped at 1024; its reward is Bernoulli with a pass rate set by the problem's level
(synthetic: no model is run). A tiny softmax policy scores the tokens, and the loss is the full GRPO loss
(clip-higher, k3 KL, entropy bonus, seq-mean-token-mean). The history a DPPO prompt pruner reads is one earlier visit
of the same prompts (fresh rewards, which may then have been all equal: that is what the prompt level predicts from).

Main table: DPPO both levels at rate 1 - sqrt(f) (every item a candidate), uniform and proportional keep
probabilities; CPPO and D3S keep the fraction f deterministically. Per row: the kept fraction (mean over draws and
batches, with its standard error), the relative gradient error E|g - g_full| / |g_full| and the relative mean
squared error E|g - g_full|² / |g_full|² (medians over batches), and the MSE over dppo-uniform's at the same f.
Second table: the prompt level alone at rate 0.5, uniform against proportional with the default score (sqrt(1 - z),
z the predicted zero-variance probability, floor 0.2) and with the mean |A| EMA score at several floors: how much a
one-visit history says about which of the varied groups matter (the earlier visit's zero-variance groups score
|A| = 0 and sit at the floor, with weight 1 / p_min, though they vary now).
Last line: `dppo_proportional_vs_uniform_variance_ratio`, the relative MSE of dppo-proportional over dppo-uniform at
kept fraction 0.5.

    python bench/pruning_variance.py [--batches 5] [--draws 200] [--json rows.json]
"""

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dppo.algo import (  # noqa: E402
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
from megatron_dppo.data.paths import shared_data_dir  # noqa: E402

PROMPTS, GROUP, MAX_LENGTH, VOCAB, FEATURES = 32, 8, 1024, 16, 8
MEAN_PASS_RATE = {"Level 1": 0.8, "Level 2": 0.65, "Level 3": 0.5, "Level 4": 0.35, "Level 5": 0.2}
LOSS = LossConfig(eps_low=0.2, eps_high=0.28, kl_coef=0.01, kl_type="k3", entropy_coef=0.001)
KEPT_FRACTIONS = (0.75, 0.5, 0.25)
PROMPT_LEVEL_KEPT = 0.5
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
    """rewards, advantages, lengths [PROMPTS, GROUP] of PROMPTS groups with reward variance (problems drawn at
    random, a group kept only if its rewards differ: the groups a DAPO filter passes), and the history of an earlier
    visit of the same problems (rewards and lengths, whatever they were)."""
    chosen, rewards = [], []
    while len(chosen) < PROMPTS:
        problem = int(torch.randint(len(problems), (1,), generator=generator))
        group = torch.bernoulli(torch.full((GROUP,), problems[problem][1], dtype=torch.float64), generator=generator)
        if group.min() < group.max():
            chosen.append(problem)
            rewards.append(group)
    reference_length = torch.tensor([problems[i][0] for i in chosen], dtype=torch.float64)[:, None]
    pass_rate = torch.tensor([problems[i][1] for i in chosen], dtype=torch.float64)[:, None].expand(PROMPTS, GROUP)

    def lengths():
        noise = torch.exp(0.3 * torch.randn(PROMPTS, GROUP, generator=generator, dtype=torch.float64))
        return (reference_length * noise).round().clamp(4, MAX_LENGTH).long()

    earlier_rewards, earlier_lengths = torch.bernoulli(pass_rate, generator=generator), lengths()
    history = PromptHistory()
    history.update(range(PROMPTS), score_prompts(earlier_rewards, compute_advantages(earlier_rewards)),
                   earlier_lengths.double().mean(dim=1), rewards=earlier_rewards)
    rewards = torch.stack(rewards)
    return rewards, compute_advantages(rewards), lengths(), history


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
    """(pruned gradient, kept fraction of the batch's samples) of one draw."""
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
    """{(table, pruner name, target kept fraction): pruner}. Every item is a candidate (candidates="all"), so a
    level's rate is its expected pruned fraction, and both DPPO levels at 1 - sqrt(f) keep f in expectation."""
    table = {}
    for kept_fraction in KEPT_FRACTIONS:
        rate = 1 - math.sqrt(kept_fraction)
        for policy in ("uniform", "proportional"):
            table[("main", f"dppo-{policy}", kept_fraction)] = build_pruner(
                "dppo", prompt_prune_rate=rate, completion_prune_rate=rate, keep_policy=policy, candidates="all",
                seed=seed)
        table[("main", "cppo", kept_fraction)] = build_pruner("cppo", prune_rate=1 - kept_fraction)
        table[("main", "d3s", kept_fraction)] = build_pruner(
            "d3s", sample_fraction_init=kept_fraction, sample_fraction_final=kept_fraction,
            token_fraction_init=1.0, token_fraction_final=1.0)
    prompt_level = dict(prompt_prune_rate=1 - PROMPT_LEVEL_KEPT, completion_prune_rate=0.0, candidates="all",
                        seed=seed)
    table[("prompt", "uniform", PROMPT_LEVEL_KEPT)] = build_pruner("dppo", keep_policy="uniform", **prompt_level)
    table[("prompt", "proportional, predicted zero-variance", PROMPT_LEVEL_KEPT)] = build_pruner(
        "dppo", keep_policy="proportional", **prompt_level)
    for floor in PROMPT_FLOORS:
        table[("prompt", f"proportional, mean |A| EMA, p_min {floor}", PROMPT_LEVEL_KEPT)] = build_pruner(
            "dppo", keep_policy="proportional", prompt_score="mean_abs_advantage", prompt_p_min=floor,
            **prompt_level)
    return table


@dataclass
class Row:
    table: str  # "main" (both levels) or "prompt" (the prompt level alone)
    pruner: str
    target: float  # the target kept fraction of the samples
    stochastic: bool
    kept: float  # mean kept fraction over every draw of every batch
    kept_se: float  # its standard error (0 for a deterministic pruner)
    relative_error: float  # median over batches of E|g - g_full| / |g_full|
    relative_mse: float  # median over batches of E|g - g_full|² / |g_full|²
    mse_vs_uniform: float = math.nan  # relative_mse over that of the table's uniform row at the same target


def measure(batches: int, draws: int, seed: int) -> list[Row]:
    problems = load_math_problems()
    generator = torch.Generator().manual_seed(seed)
    per_batch, kept_fractions = {}, {}
    for batch_index in range(batches):
        batch = sample_batch(problems, generator)
        gradients = per_sample_gradients(batch[1], batch[2], generator)
        full = gradients.sum(dim=0) / loss_normalizer(LOSS, FullBatchInfo.from_lengths(batch[2]))
        for key, pruner in pruners(seed + batch_index).items():
            stochastic = isinstance(pruner.config, DPPOConfig) and pruner.config.mode == "stochastic"
            samples = [draw_gradient(pruner, batch, gradients, step) for step in range(draws if stochastic else 1)]
            errors = torch.tensor([float((gradient - full).norm() / full.norm()) for gradient, _ in samples])
            per_batch.setdefault(key, []).append((float(errors.mean()), float(errors.square().mean())))
            kept_fractions.setdefault(key, []).extend(kept for _, kept in samples)
    rows = []
    for (table, name, target), values in per_batch.items():
        kept = torch.tensor(kept_fractions[(table, name, target)], dtype=torch.float64)
        rows.append(Row(table, name, target, len(kept) > batches, float(kept.mean()),
                        float(kept.std() / math.sqrt(len(kept))) if len(kept) > 1 else 0.0,
                        statistics.median(error for error, _ in values),
                        statistics.median(mse for _, mse in values)))
    uniform = {(row.table, row.target): row.relative_mse for row in rows if row.pruner.endswith("uniform")}
    for row in rows:
        row.mse_vs_uniform = row.relative_mse / uniform[(row.table, row.target)]
    return rows


def headline(rows: list[Row]) -> float:
    """The relative MSE of dppo-proportional over dppo-uniform, both levels, kept fraction 0.5."""
    return next(row.mse_vs_uniform for row in rows if row.table == "main" and row.pruner == "dppo-proportional"
                and row.target == 0.5)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.batches, args.draws, args.seed)
    for table, title in (("main", "both levels"), ("prompt", f"prompt level only, kept {PROMPT_LEVEL_KEPT}")):
        print(f"\n{title:<38}{'target':>7}{'kept':>8}{'± SE':>8}{'rel. error':>12}{'rel. MSE':>10}{'MSE/unif.':>10}")
        for row in (row for row in rows if row.table == table):
            print(f"{row.pruner:<38}{row.target:>7.2f}{row.kept:>8.4f}{row.kept_se:>8.4f}{row.relative_error:>12.4f}"
                  f"{row.relative_mse:>10.4f}{row.mse_vs_uniform:>10.3f}")
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    print(f"dppo_proportional_vs_uniform_variance_ratio: {headline(rows):.4f}")


if __name__ == "__main__":
    main()

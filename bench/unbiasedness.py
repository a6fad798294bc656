"""End-to-end Monte-Carlo check that the trainer's own step is unbiased, in every shipped configuration.

    a fixed world (16 synthetic prompts x 8 fixed completions: half the groups all-correct or all-wrong, every fifth
    prompt never seen, history lengths stale by up to ±50%) served by FixedWorldClient in place of the rollout servers
    ─► the trainer's ExperienceMaker, configured by parse_args(flags): prompt draw, prompt level, rewards, advantages,
       history, full-batch counts, DAPO filter, completion level ─► Experience (kept samples, weights, counts)
    ─► gradient of the draw = Σ_i w_i ∇f_i / Z, from per-sample gradients ∇f_i of a tiny policy (the loss is linear
       in the sample weights); on the first draws of each configuration the same gradient by autograd through Dense
       Prompt Packing into per-rank micro-batches at DP=2 and the trainer's packed_policy_loss, which must agree
    ─► over many draws, per loss aggregation: max |mean - full| / SE over the gradient's coordinates, and the
       projection ratio <mean, full> / <full, full>, where `full` is the same configuration's full-batch gradient
       (every drawn sample, the DAPO filter's varied groups only, weight 1, the same normaliser); beside it the ratio
       to GRPO's full-batch gradient: 1 where the normaliser counts sequences, and true tokens / the rule's tokens
       for token-mean (the prompt level counts a prompt it may prune by its history length, stale here)

The history is restored before every draw, so each draw is one step from the same state. Biased configurations
(deterministic DPPO, CPPO, D3S) run fewer draws (their estimate is a fixed function of the world) and show their bias.
Last lines, over the unbiased configurations: `dppo_e2e_max_projection_bias_se` (the bias along the full gradient's
direction, in standard errors of that one projection), `dppo_e2e_max_ratio_error` (|projection ratio - 1|), and
`dppo_e2e_max_bias_se` (the largest |mean - full| / SE over the 16 coordinates and 3 aggregations of a
configuration: a maximum over 48 correlated z-scores, which exceeds 3 about one time in ten without any bias).

    python bench/unbiasedness.py [--draws 20000]
"""

import argparse
import copy
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)  # tiny tensors: threads only add overhead

from megatron_dppo.algo.losses import AGGREGATIONS, FullBatchInfo, loss_normalizer, packed_policy_loss  # noqa: E402
from megatron_dppo.algo.pruning import build_pruner  # noqa: E402
from megatron_dppo.data.synthetic import (  # noqa: E402
    END_MARKER,
    TASK_CELLS,
    SyntheticArithmetic,
    format_target,
    rl_pool_seed,
)
from megatron_dppo.data.tokenizer import CharTokenizer  # noqa: E402
from megatron_dppo.launch.arguments import parse_args  # noqa: E402
from megatron_dppo.pipeline.experience import ExperienceMaker, loss_config, pruner_options  # noqa: E402
from megatron_dppo.pipeline.packing import TrainingSample, build_thd_batch, pack_micro_batches  # noqa: E402
from megatron_dppo.pipeline.tasks import synthetic_task  # noqa: E402
from megatron_dppo.rollout.client import Completion  # noqa: E402

NUM_PROMPTS, GROUP = 16, 8
FEATURES = 4  # the tiny policy's width: FEATURES² parameters, the coordinates of the gradient
MICRO_BATCH_TOKENS = 640  # small, so that each rank gets several micro-batches

# name: (flags, unbiased). The world's own flags (batch, group size, lengths) are added to each. A refill draws
# M = B / (1 - rate) prompts, more than the world's 16 at B = 8 with the world's recorded zero-variance share (7 of
# 12): the draw is then capped at the pool, the whole world, so that the full batch is the same on every draw.
REFILL = ["--rollout-batch-size", "8"]
CONFIGURATIONS = {
    "embedded default (dppo: predicted zero-variance, auto rate, refill, DAPO)": (REFILL, True),
    "cli default (dppo: predicted zero-variance, auto rate, refill, no DAPO)": ([*REFILL, "--no-dapo-filter"], True),
    "dppo uniform keep, refill, DAPO": ([*REFILL, "--dppo-keep-policy", "uniform"], True),
    "dppo, no refill, rate 0.5, no DAPO": (["--no-dppo-refill", "--dppo-prompt-prune-rate", "0.5", "--no-dapo-filter"],
                                           True),
    "dppo mean |A| EMA score, below_mean, no refill, no DAPO": (
        ["--dppo-prompt-score", "mean_abs_advantage", "--no-dppo-refill", "--dppo-prompt-prune-rate", "0.5",
         "--no-dapo-filter"], True),
    "dppo, no refill, DAPO over-sampling x2": (["--no-dppo-refill", "--dapo-oversample", "2", "--rollout-batch-size",
                                                "8"], True),
    "embedded default with partial rollouts (staleness 1, chunks of 8 tokens)": (
        [*REFILL, "--partial-rollout", "--partial-rollout-chunk-tokens", "8"], True),
    "grpo, DAPO": (["--algorithm", "grpo"], True),
    "grpo, DAPO over-sampling x2": (["--algorithm", "grpo", "--dapo-oversample", "2", "--rollout-batch-size", "8"],
                                    True),
    "dppo deterministic (the paper's Algorithm 1), refill": ([*REFILL, "--dppo-mode", "deterministic"], False),
    "dppo without importance weights (kept prompts as the batch)": ([*REFILL, "--no-dppo-importance-weights"], False),
    "grpo, DAPO dynamic sampling (rounds until B varied groups)": (
        ["--algorithm", "grpo", "--dapo-dynamic-sampling", "--rollout-batch-size", "8"], False),
    "cppo": (["--algorithm", "cppo"], False),
    "d3s": (["--algorithm", "d3s"], False),
}
# Over-sampling needs more varied groups than the batch holds: that world has only 4 uniform groups.
OVERSAMPLING_UNIFORM_GROUPS = 4


def world_args(flags: list[str]):
    """The configuration's arguments as the trainer parses them (the embedded default's task), with the world's
    batch shape."""
    return parse_args(["--rollout-batch-size", str(NUM_PROMPTS), "--n-samples-per-prompt", str(GROUP),
                       "--data-train-size", str(NUM_PROMPTS), *flags])


def aggregation_config(args, aggregation: str):
    """The configuration's loss with another aggregation (the draws do not depend on it)."""
    return dataclasses.replace(loss_config(args), aggregation=aggregation)


# ---------------------------------------------------------------------------------------------------- the world


@dataclass
class World:
    """16 prompts x 8 fixed completions and the history a step starts from."""

    task: object
    tokenizer: CharTokenizer
    completions: dict  # prompt input ids (tuple) → [Completion] x GROUP
    history_state: dict
    uniform_groups: set  # prompt ids whose rewards are all equal


def build_world(seed: int = 0, uniform_groups: int = NUM_PROMPTS // 2, mispredicted: bool = True) -> World:
    """Completions: a uniform group is all correct or all wrong; a mixed one has 1..7 correct. A correct one is the
    task's own solution; a wrong one has the same work and a wrong final answer of 1..6 digits, so response lengths
    differ within a group and between cells. Identical responses carry identical rollout log-probs."""
    args = world_args([])
    tokenizer = CharTokenizer.for_synthetic_task()
    task = synthetic_task(tokenizer, seed, NUM_PROMPTS, 1, task=args.synthetic_task)
    problems = SyntheticArithmetic(rl_pool_seed(seed), TASK_CELLS[args.synthetic_task]).sample(NUM_PROMPTS)  # its pool
    rng = random.Random(seed)
    uniform = set(rng.sample(range(NUM_PROMPTS), uniform_groups))
    completions, logprob_cache = {}, {}
    for prompt, problem in zip(task.prompts, problems):
        if prompt.text != problem.prompt:
            raise RuntimeError("the synthetic task's pool is no longer SyntheticArithmetic(rl_pool_seed(seed), "
                               "cells).sample(n)")
        if prompt.prompt_id in uniform:
            correct = GROUP if prompt.prompt_id % 2 else 0
        else:
            correct = rng.randint(1, GROUP - 1)
        solution = format_target(problem, args.synthetic_task)
        work = solution[:-len(f"{problem.answer}{END_MARKER}")]  # everything before the final answer
        responses = [solution] * correct
        while len(responses) < GROUP:
            wrong = rng.randrange(10 ** rng.randint(1, 6))
            if wrong != int(prompt.reference):
                responses.append(f"{work}{wrong}{END_MARKER}")
        rng.shuffle(responses)
        group = []
        for sample, response in enumerate(responses):
            ids = tokenizer.encode(response)
            logprobs = logprob_cache.setdefault((prompt.prompt_id, response),
                                                [-rng.uniform(0.05, 2.0) for _ in ids])
            group.append(Completion(0, sample, ids, logprobs, "stop", None))
        completions[tuple(prompt.input_ids)] = group
    # The history: every fifth prompt never seen (the prompt level gives it its stratum's prior); the others with
    # their true score (mean |A|) up to ±30%, a mean response length off by a factor in [0.5, 1.5] (stale, from an
    # earlier visit), and their rewards of that earlier visit: the true ones, except that three prompts with varied
    # rewards now had all-equal ones then, and one the reverse (the prediction is then wrong, and the importance
    # weight of a kept informative prompt is large). mispredicted=False records the true ones throughout: a history
    # that predicts, for the variance comparison of keep policies.
    maker = ExperienceMaker(args, task, tokenizer, FixedWorldClient(completions))
    seen = [p for p in task.prompts if p.prompt_id % 5]
    rollouts = maker.generate(0)  # the history is empty: every prompt is rolled out
    rewards = rollouts.rewards
    from megatron_dppo.algo import compute_advantages, score_prompts

    scores = score_prompts(rewards, compute_advantages(rewards))
    lengths = torch.tensor([len(ids) for ids in rollouts.output_ids], dtype=torch.float64).view(-1, GROUP)
    by_id = {p.prompt_id: i for i, p in enumerate(rollouts.prompts)}
    rows = [by_id[p.prompt_id] for p in seen]
    noise = torch.tensor([rng.uniform(0.7, 1.3) for _ in seen], dtype=torch.float64)
    stale = torch.tensor([rng.uniform(0.5, 1.5) for _ in seen], dtype=torch.float64)
    earlier = rewards[rows].clone()
    uniform_now = (earlier == earlier[:, :1]).all(dim=1).tolist()
    mixed_positions = [i for i, uniform in enumerate(uniform_now) if not uniform]
    uniform_positions = [i for i, uniform in enumerate(uniform_now) if uniform]
    for position in mixed_positions[:3 if mispredicted else 0]:
        earlier[position] = 1.0
    for position in uniform_positions[:1 if mispredicted else 0]:
        earlier[position] = torch.arange(GROUP, dtype=torch.float64) % 2
    maker.history.update([p.prompt_id for p in seen], scores[rows] * noise, lengths.mean(dim=1)[rows] * stale,
                         rewards=earlier, difficulties=[p.difficulty for p in seen])
    refill = world_args(REFILL)
    name, options = pruner_options(refill)
    drawn = build_pruner(name, **options).prompts_to_sample(refill.rollout_batch_size, maker.history)
    if uniform_groups == NUM_PROMPTS // 2 and drawn < NUM_PROMPTS:
        raise RuntimeError(f"the refill configurations would draw {drawn} of the world's {NUM_PROMPTS} prompts (the "
                           "recorded zero-variance share is too low): the full batch would change between draws")
    return World(task, tokenizer, completions, maker.history.state_dict(), uniform)


class FixedWorldClient:
    """The rollout-server boundary: the world's fixed completions of each requested prompt. Partial rollouts ask for
    one sample at a time, continued from its prefix: sample j of a prompt has seed base + j, so seed % G picks its
    completion, and a request reveals the next max_new_tokens of it."""

    def __init__(self, completions: dict):
        self.completions = completions
        self.prompt_lengths = sorted({len(prompt) for prompt in completions})

    def generate_requests(self, requests, params):
        answers = []
        for index, request in enumerate(requests):
            prompt = next(tuple(request.input_ids[:length]) for length in self.prompt_lengths
                          if tuple(request.input_ids[:length]) in self.completions)
            whole = self.completions[prompt][request.seed % GROUP]
            done = len(request.input_ids) - len(prompt)
            if list(request.input_ids[len(prompt):]) != whole.output_ids[:done]:
                raise RuntimeError("a continued sample must resume its own completion")
            end = done + request.max_new_tokens
            answers.append(Completion(index, 0, whole.output_ids[done:end], whole.output_logprobs[done:end],
                                      "stop" if end >= len(whole.output_ids) else "length", None))
        return answers

    def generate(self, prompts, params, n=1):
        if n != GROUP:
            raise ValueError(f"the fixed world has {GROUP} completions per prompt, not n={n}")
        return [Completion(index, c.sample_index, c.output_ids, c.output_logprobs, "stop", None)
                for index, prompt in enumerate(prompts) for c in self.completions[tuple(prompt)]]


# ---------------------------------------------------------------------------------------------- the tiny policy


class TinyPolicy:
    """logits_t = U · tanh(E[x_t] + P[t]) @ W: the FEATURES² entries of W are the parameters (float64)."""

    def __init__(self, vocab: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.embedding = torch.randn(vocab, FEATURES, generator=generator, dtype=torch.float64)
        self.positions = torch.randn(512, FEATURES, generator=generator, dtype=torch.float64)
        self.unembedding = torch.randn(vocab, FEATURES, generator=generator, dtype=torch.float64)
        self.weight = (0.5 * torch.randn(FEATURES, FEATURES, generator=generator, dtype=torch.float64))

    def logprobs(self, batch, weight: torch.Tensor) -> torch.Tensor:
        """[T] log-probs of each position's label in a THD batch."""
        hidden = torch.tanh(self.embedding[batch.tokens[0]] + self.positions[batch.position_ids[0]]) @ weight
        logits = hidden @ self.unembedding.T  # [T, vocab]
        return torch.log_softmax(logits, dim=-1).gather(1, batch.labels[0][:, None]).squeeze(1)

    def loss_gradient(self, config, batches, normalizer: float) -> torch.Tensor:
        """∇ of Σ over `batches` of the trainer's packed_policy_loss, by autograd: [FEATURES²]."""
        weight = self.weight.clone().requires_grad_()
        total = sum(packed_policy_loss(config, batch, self.logprobs(batch, weight), normalizer)[0] for batch in batches)
        (gradient,) = torch.autograd.grad(total, weight)
        return gradient.reshape(-1)


# ------------------------------------------------------------------------------------------------- the check


@dataclass
class Draws:
    """One configuration's draws: weights per canonical sample, normaliser counts, and packed-path gradients."""

    weights: torch.Tensor  # [draws, canonical samples]
    counts: list  # [draws] FullBatchInfo
    packed: list  # [(draw, aggregation, autograd gradient through packing at DP=2)]


def canonical_samples(world: World):
    """Identical (prompt, response) pairs train identically: one canonical index each, with its multiplicity."""
    index, samples, multiplicity, uniform = {}, [], [], []
    prompt_ids = {tuple(p.input_ids): p.prompt_id for p in world.task.prompts}
    for prompt, group in world.completions.items():
        for completion in group:
            key = (prompt, tuple(completion.output_ids))
            if key not in index:
                index[key] = len(samples)
                samples.append((prompt, completion))
                multiplicity.append(0)
                uniform.append(prompt_ids[prompt] in world.uniform_groups)
            multiplicity[index[key]] += 1
    return index, samples, torch.tensor(multiplicity, dtype=torch.float64), torch.tensor(uniform)


def per_sample_gradients(world: World, policy: TinyPolicy, args, aggregation: str, advantages: dict) -> torch.Tensor:
    """[canonical samples, FEATURES²]: ∇f_i, the gradient of sample i's loss term at weight 1 and normaliser 1."""
    config = aggregation_config(args, aggregation)
    _, samples, _, _ = canonical_samples(world)
    rows = []
    for prompt, completion in samples:
        sample = TrainingSample(list(prompt), completion.output_ids, advantages[(prompt, tuple(completion.output_ids))],
                                1.0, rollout_logprobs=completion.output_logprobs)
        rows.append(policy.loss_gradient(config, [build_thd_batch([sample], [0])], 1.0))
    return torch.stack(rows)


def run_draws(world: World, args, draws: int, packed_draws: int, policy: TinyPolicy) -> Draws:
    """`draws` steps of the trainer's ExperienceMaker, each from the same history."""
    index, _, _, _ = canonical_samples(world)
    maker = ExperienceMaker(args, copy.deepcopy(world.task), world.tokenizer, FixedWorldClient(world.completions))
    weights = torch.zeros(draws, len(index), dtype=torch.float64)
    counts, packed = [], []
    for step in range(draws):
        maker.history.load_state_dict(world.history_state)
        experience = maker.make(maker.generate(step), step, progress=0.0)
        counts.append(experience.normalizer_counts)
        for sample in experience.samples:
            key = (tuple(sample.prompt_ids), tuple(sample.response_ids))
            weights[step, index[key]] += sample.sample_weight
        if step < packed_draws and experience.samples:
            for aggregation in AGGREGATIONS:
                config = aggregation_config(args, aggregation)
                batches = [batch for rank in range(2) for batch in pack_micro_batches(
                    experience.samples, MICRO_BATCH_TOKENS, 256, 2, rank)[0]]
                normalizer = loss_normalizer(config, experience.normalizer_counts)
                packed.append((step, aggregation, policy.loss_gradient(config, batches, normalizer)))
    return Draws(weights, counts, packed)


def grpo_step(world: World, args):
    """One GRPO step with nothing pruned or filtered: every sample's full-group advantage, and GRPO's counts."""
    grpo = copy.copy(args)
    grpo.algorithm, grpo.dapo_filter, grpo.rollout_batch_size = "grpo", False, NUM_PROMPTS
    grpo.dapo_dynamic_sampling = False
    maker = ExperienceMaker(grpo, copy.deepcopy(world.task), world.tokenizer, FixedWorldClient(world.completions))
    maker.history.load_state_dict(world.history_state)
    experience = maker.make(maker.generate(0), 0, 0.0)
    advantages = {(tuple(s.prompt_ids), tuple(s.response_ids)): s.advantage for s in experience.samples}
    return advantages, experience.normalizer_counts


@dataclass
class Result:
    configuration: str
    aggregation: str
    unbiased: bool
    draws: int
    max_bias_se: float  # max over coordinates of |mean - full| / SE (inf when the draws do not vary)
    projection_bias_se: float  # |mean - full| along full's direction, in standard errors of that projection
    ratio: float  # <mean, full> / <full, full>
    relative_error: float  # |mean - full| / |full|
    ratio_to_grpo: float  # <mean, g> / <g, g> with g GRPO's full-batch gradient (true token counts)
    cosine_to_grpo: float  # the direction: <mean, g> / (|mean| |g|)
    mean_squared_error: float  # E|draw - full|² / |full|²: the estimate's variance (plus bias²), relative
    packed_max_error: float  # max |autograd through packing at DP=2 - linear form| / |linear form|
    normaliser_fixed: bool  # the normaliser counts were the same on every draw


def same_counts(first: FullBatchInfo, second: FullBatchInfo) -> bool:
    """Equal up to the rounding of summing the same lengths in another prompt order."""
    return all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(dataclasses.astuple(first),
                                                                  dataclasses.astuple(second)))


def check_configuration(name: str, flags: list[str], unbiased: bool, draws: int, packed_draws: int = 20,
                        seed: int = 0, mispredicted: bool = True) -> list[Result]:
    """Run one configuration's draws and compare them with its full-batch gradient, per loss aggregation."""
    oversampling = "--dapo-oversample" in flags
    world = build_world(seed, OVERSAMPLING_UNIFORM_GROUPS if oversampling else NUM_PROMPTS // 2, mispredicted)
    args = world_args(flags)
    if oversampling:  # the drawn batch (capacity x 2) must be the whole world, so the full batch is fixed
        assert args.rollout_batch_size * args.dapo_oversample == NUM_PROMPTS
    policy = TinyPolicy(world.tokenizer.vocab_size, seed)
    result = run_draws(world, args, draws, packed_draws, policy)
    advantages, grpo_counts = grpo_step(world, args)
    _, _, multiplicity, uniform = canonical_samples(world)
    eligible = multiplicity * (~uniform if args.dapo_filter else torch.ones_like(uniform)).double()
    full_counts = result.counts[0]
    results = []
    for aggregation in AGGREGATIONS:
        config = aggregation_config(args, aggregation)
        gradients_per_sample = per_sample_gradients(world, policy, args, aggregation, advantages)
        normalizers = torch.tensor([loss_normalizer(config, counts) for counts in result.counts], dtype=torch.float64)
        draws_gradient = (result.weights @ gradients_per_sample) / normalizers[:, None]  # [draws, params]
        full = eligible @ gradients_per_sample / loss_normalizer(config, full_counts)
        grpo = eligible @ gradients_per_sample / loss_normalizer(config, grpo_counts)
        mean = draws_gradient.mean(dim=0)
        # an estimate that does not vary (GRPO, deterministic pruners) has SE 0: floor it at float64 rounding
        standard_error = (draws_gradient.std(dim=0) / math.sqrt(draws)).clamp(min=1e-12 * float(full.norm()))
        max_bias_se = float(((mean - full).abs() / standard_error).max())
        direction = full / full.norm()
        projected = draws_gradient @ direction  # [draws]
        projection_se = max(float(projected.std()) / math.sqrt(draws), 1e-12 * float(full.norm()))
        projection_bias_se = abs(float(projected.mean() - full @ direction)) / projection_se
        packed_errors = [float((gradient - draws_gradient[step]).norm() / draws_gradient[step].norm())
                         for step, agg, gradient in result.packed if agg == aggregation]
        results.append(Result(name, aggregation, unbiased, draws, max_bias_se, projection_bias_se,
                              float(mean @ full / (full @ full)), float((mean - full).norm() / full.norm()),
                              float(mean @ grpo / (grpo @ grpo)), float(mean @ grpo / (mean.norm() * grpo.norm())),
                              float((draws_gradient - full).square().sum(dim=1).mean() / (full @ full)),
                              max(packed_errors, default=0.0),
                              all(same_counts(counts, full_counts) for counts in result.counts)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=20_000, help="draws per unbiased configuration")
    parser.add_argument("--biased-draws", type=int, default=500, help="draws per biased configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", type=int, metavar="INDEX",
                        help="run only these configurations (0-based positions in CONFIGURATIONS)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    options = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for position, (name, (flags, unbiased)) in enumerate(CONFIGURATIONS.items()):
        if options.only is None or position in options.only:
            rows += check_configuration(name, flags, unbiased, options.draws if unbiased else options.biased_draws,
                                        seed=options.seed)
    print(f"{'configuration':<58} {'aggregation':<24} {'draws':>6} {'max|bias|/SE':>12} {'proj/SE':>7} "
          f"{'ratio':>7} {'rel.err':>7} {'vs GRPO':>7} {'cos GRPO':>8} {'packed':>8} {'Z fixed':>7}")
    for row in rows:
        print(f"{row.configuration:<58} {row.aggregation:<24} {row.draws:>6} {row.max_bias_se:>12.2f} "
              f"{row.projection_bias_se:>7.2f} {row.ratio:>7.4f} {row.relative_error:>7.4f} {row.ratio_to_grpo:>7.4f} "
              f"{row.cosine_to_grpo:>8.5f} {row.packed_max_error:>8.1e} {str(row.normaliser_fixed):>7}")
    if options.json:
        options.json.write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
    print(f"seconds: {time.perf_counter() - start:.0f}")
    unbiased = [row for row in rows if row.unbiased]
    print(f"dppo_e2e_max_projection_bias_se: {max((r.projection_bias_se for r in unbiased), default=math.nan):.2f}")
    print(f"dppo_e2e_max_ratio_error: {max((abs(r.ratio - 1) for r in unbiased), default=math.nan):.4f}")
    print(f"dppo_e2e_max_bias_se: {max((row.max_bias_se for row in unbiased), default=math.nan):.2f}")


if __name__ == "__main__":
    main()

"""End-to-end Monte-Carlo check that the trainer's own step is unbiased, in every shipped configuration.

    a fixed world (a pool of 64 synthetic prompts x 8 fixed completions, four steps' worth: half the groups
    all-correct or all-wrong, every fifth prompt never seen, history lengths stale: recorded when the answers were up
    to 40% shorter) served by FixedWorldClient in place of the rollout servers
    ─► the trainer's ExperienceMaker, configured by parse_args(flags): prompt draw from the pool (the trainer's
       sampler: a fresh permutation per epoch), prompt level, rewards, advantages, history, full-batch counts, DAPO
       filter, completion level ─► Experience (kept samples, weights, counts); the drawn prompts are recorded
    ─► gradient of the draw = Σ_i w_i ∇f_i / Z, from per-sample gradients ∇f_i of a tiny policy (the loss is linear
       in the sample weights); on the first draws of each configuration the same gradient by autograd through Dense
       Prompt Packing into per-rank micro-batches at DP=2 and the trainer's packed_policy_loss, which must agree
    ─► per draw two references, both over the drawn prompts' samples (the DAPO filter's varied groups only, weight 1):
       `own`, normalised by the rule's count (what the configuration estimates), and `full`, normalised by the drawn
       candidates' real counts (the full batch's loss)
    ─► over many draws, per loss aggregation: against `own`, max |mean(g - own)| / SE over the gradient's
       coordinates, the bias along own's direction in SE, and the ratio of projections; against `full`, the scale
       Σ <g, u> / Σ <full, u> (u the mean full gradient's direction) with its standard error, the scale the
       normaliser predicts (Σ (real count / rule's count) <full, u> / Σ <full, u>: 1 where the normaliser counts
       sequences or the history lengths are exact), and the worst coordinate in SE

Rollout corrections: one configuration's engine disagrees with the trainer (disagreeing_engine), and its draws are
checked under every correction of CORRECTION_FLAGS against the full batch under the same correction.

The history is restored before every draw, so each draw is one step from the same state; the sampler goes on, so
draws differ. Biased configurations (deterministic DPPO, CPPO, D3S, ...) run fewer draws and show their bias.
Last lines, over the unbiased configurations: `dppo_e2e_max_projection_bias_se` (the bias along own's direction, in
standard errors of that one projection), `dppo_e2e_max_ratio_error` (|projection ratio - 1|),
`dppo_e2e_max_bias_se` (the largest |mean - own| / SE over the 16 coordinates and 3 aggregations of a configuration:
a maximum over 48 correlated z-scores, which exceeds 3 about one time in ten without any bias),
`dppo_e2e_max_scale_vs_predicted_se` and the token-mean scales with stale and with exact history lengths.

    python bench/unbiasedness.py [--draws 20000] [--stale-lengths 0.6 1.0]
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

POOL, BATCH, GROUP = 64, 16, 8  # a step draws BATCH prompts (the refill 27) from the recurring pool
STALE_LENGTHS = (0.6, 1.0)  # a seen prompt's history length over its real one: answers grew since its last visit
FEATURES = 4  # the tiny policy's width: FEATURES² parameters, the coordinates of the gradient
MICRO_BATCH_TOKENS = 640  # small, so that each rank gets several micro-batches



@dataclass(frozen=True)
class Configuration:
    flags: list  # the trainer's flags; the world's own (batch, group size, pool) are added
    unbiased: bool
    history_lengths: str = "stale"  # "stale" (STALE_LENGTHS, every fifth prompt never seen) or "exact" (all seen)
    engine_gap: float = 0.0  # > 0: the engine disagrees (disagreeing_engine), checked under each CORRECTION_FLAGS
    draw_factor: float = 1.0  # x the draws (the probe's 1 / (π π') weights vary more: 1.5x for the same scale SE)


# The disagreeing engine's log ratios trainer / engine ~ N(0, ENGINE_GAP²) per token; each threshold below acts on
# 18% to 38% of this world's tokens (responses of 15 to 140 tokens), and `shift` shows what it does to the gradient.
ENGINE_GAP = 0.3
CORRECTION_FLAGS = {
    "none": ["--rollout-correction", "none"],
    "token-tis": ["--rollout-correction", "token-tis", "--rollout-correction-cap", "1.3"],
    "seq-tis": ["--rollout-correction", "seq-tis", "--rollout-correction-cap", "2"],
    "seq-mis": ["--rollout-correction", "seq-mis", "--rollout-correction-cap", "2"],
    "geo-rs": ["--rollout-correction", "geo-rs", "--rollout-correction-band", "0.95", "1.05"],
    "icepop": ["--rollout-correction", "icepop", "--rollout-correction-band", "0.7", "1.4"],
}


REFILL, HALF = ["--rollout-batch-size", "8"], "0.5"  # a refill draws M = B / (1 - rate): 27 of the 64 at B = 8
NO_DAPO_RATE_HALF = ["--no-dppo-refill", "--dppo-prompt-prune-rate", HALF, "--dppo-completion-prune-rate", HALF,
                     "--no-dapo-filter"]
CONFIGURATIONS = {
    "embedded default (dppo: success-rate score, systematic sampler, auto rate, refill, DAPO)": Configuration(
        REFILL, True),
    "cli default (dppo: success-rate score, systematic sampler, auto rate, refill, no DAPO)": Configuration(
        [*REFILL, "--no-dapo-filter"], True),
    "dppo uniform keep, refill, DAPO": Configuration([*REFILL, "--dppo-keep-policy", "uniform"], True),
    "dppo previous default (bernoulli sampler, zero-variance score, completion level 0.5), refill, DAPO": Configuration(
        [*REFILL, "--dppo-prompt-sampling", "bernoulli", "--dppo-prompt-score", "zero_variance",
         "--dppo-completion-prune-rate", HALF], True),
    "dppo with the in-step probe (2 of 8 samples, 12 prompts probed), refill, DAPO": Configuration(
        [*REFILL, "--dppo-probe-samples", "2", "--dppo-probe-prompts", "12"], True, draw_factor=1.5),
    "dppo, no refill, rates 0.5, no DAPO": Configuration(NO_DAPO_RATE_HALF, True),
    "dppo mean |A| EMA score, below_mean, no refill, no DAPO": Configuration(
        ["--dppo-prompt-score", "mean_abs_advantage", *NO_DAPO_RATE_HALF], True),
    "dppo, no refill, DAPO over-sampling x2": Configuration(
        ["--no-dppo-refill", "--dapo-oversample", "2", "--rollout-batch-size", "8"], True),
    "embedded default with partial rollouts (staleness 1, chunks of 8 tokens)": Configuration(
        [*REFILL, "--partial-rollout", "--partial-rollout-chunk-tokens", "8"], True),
    "grpo, DAPO": Configuration(["--algorithm", "grpo"], True),
    "grpo, DAPO over-sampling x2": Configuration(
        ["--algorithm", "grpo", "--dapo-oversample", "2", "--rollout-batch-size", "8"], True),
    "embedded default, exact history lengths": Configuration(REFILL, True, "exact"),
    "dppo, no refill, rates 0.5, no DAPO, exact history lengths": Configuration(NO_DAPO_RATE_HALF, True, "exact"),
    "embedded default, engine disagrees, every correction": Configuration(REFILL, True, engine_gap=ENGINE_GAP),
    "dppo deterministic (the paper's Algorithm 1), refill": Configuration([*REFILL, "--dppo-mode", "deterministic"],
                                                                          False),
    "dppo without importance weights (kept prompts as the batch)": Configuration(
        [*REFILL, "--no-dppo-importance-weights"], False),
    "grpo, DAPO dynamic sampling (rounds until B varied groups)": Configuration(
        ["--algorithm", "grpo", "--dapo-dynamic-sampling", "--rollout-batch-size", "8"], False),
    "cppo": Configuration(["--algorithm", "cppo"], False),
    "d3s": Configuration(["--algorithm", "d3s"], False),
}
# Over-sampling x2 at B = 8 draws 16 prompts: with a quarter of the pool uniform, more than 8 of them usually vary,
# so the DAPO filter's cap (a uniform 8 of the varied, weight V / 8) is exercised.
OVERSAMPLING_UNIFORM_GROUPS = POOL // 4


def world_args(flags: list[str]):
    """The configuration's arguments as the trainer parses them (the embedded default's task), with the world's
    batch shape."""
    return parse_args(["--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(GROUP),
                       "--data-train-size", str(POOL), *flags])


def aggregation_config(args, aggregation: str):
    """The configuration's loss with another aggregation (the draws do not depend on it)."""
    return dataclasses.replace(loss_config(args), aggregation=aggregation)


def loss_variants(configuration: Configuration) -> dict:
    """By rollout correction, the arguments of the losses its draws (which do not depend on them) are checked under."""
    if configuration.engine_gap:
        return {name: world_args([*configuration.flags, *flags]) for name, flags in CORRECTION_FLAGS.items()}
    args = world_args(configuration.flags)
    return {args.rollout_correction: args}


# ---------------------------------------------------------------------------------------------------- the world


@dataclass
class World:
    """A pool of POOL prompts x 8 fixed completions and the history a step starts from."""

    task: object
    tokenizer: CharTokenizer
    completions: dict  # prompt input ids (tuple) → [Completion] x GROUP
    history_state: dict
    uniform_groups: set  # prompt ids whose rewards are all equal
    response_tokens: dict  # prompt id → the real response tokens of its G completions


def build_world(seed: int = 0, uniform_groups: int = POOL // 2, mispredicted: bool = True,
                history_lengths: str = "stale", stale_lengths: tuple = STALE_LENGTHS) -> World:
    """Completions: a uniform group is all correct or all wrong; a mixed one has 1..7 correct. A correct one is the
    task's own solution; a wrong one has the same work and a wrong final answer of 1..6 digits, so response lengths
    differ within a group and between cells. Identical responses carry identical rollout log-probs."""
    args = world_args([])
    tokenizer = CharTokenizer.for_synthetic_task()
    task = synthetic_task(tokenizer, seed, POOL, 1, task=args.synthetic_task)
    problems = SyntheticArithmetic(rl_pool_seed(seed), TASK_CELLS[args.synthetic_task]).sample(POOL)  # its pool
    rng = random.Random(seed)
    uniform = set(rng.sample(range(POOL), uniform_groups))
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
    # The history: with stale lengths every fifth prompt never seen (the prompt level gives it its stratum's prior),
    # the others with a mean response length times a factor in `stale_lengths` (from an earlier visit, when the
    # answers were shorter); with exact lengths every prompt seen with its real mean length (the full batch's count
    # is then exact). Each with its true score (mean |A|) up to ±30% and its rewards of that earlier visit: the true
    # ones, except that 3 in 16 prompts with varied rewards now had all-equal ones then, and 1 in 16 the reverse (the
    # prediction is then wrong, and the importance weight of a kept informative prompt is large). mispredicted=False
    # records the true ones throughout: a history that predicts, for the variance comparison of keep policies.
    if history_lengths not in ("stale", "exact"):
        raise ValueError(f"history_lengths is {history_lengths!r}: choose 'stale' or 'exact'")
    maker = ExperienceMaker(world_args(["--rollout-batch-size", str(POOL)]), task, tokenizer,
                            FixedWorldClient(completions))
    seen = [p for p in task.prompts if p.prompt_id % 5 or history_lengths == "exact"]
    rollouts = maker.generate(0)  # the history is empty: every prompt of the pool is rolled out
    rewards = rollouts.rewards
    from megatron_dppo.algo import compute_advantages, score_prompts

    scores = score_prompts(rewards, compute_advantages(rewards))
    lengths = torch.tensor([len(ids) for ids in rollouts.output_ids], dtype=torch.float64).view(-1, GROUP)
    by_id = {p.prompt_id: i for i, p in enumerate(rollouts.prompts)}
    rows = [by_id[p.prompt_id] for p in seen]
    noise = torch.tensor([rng.uniform(0.7, 1.3) for _ in seen], dtype=torch.float64)
    stale = torch.tensor([rng.uniform(*stale_lengths) if history_lengths == "stale" else 1.0 for _ in seen],
                         dtype=torch.float64)
    earlier = rewards[rows].clone()
    uniform_now = (earlier == earlier[:, :1]).all(dim=1).tolist()
    mixed_positions = [i for i, uniform in enumerate(uniform_now) if not uniform]
    uniform_positions = [i for i, uniform in enumerate(uniform_now) if uniform]
    for position in mixed_positions[:3 * POOL // 16 if mispredicted else 0]:
        earlier[position] = 1.0
    for position in uniform_positions[:POOL // 16 if mispredicted else 0]:
        earlier[position] = torch.arange(GROUP, dtype=torch.float64) % 2
    maker.history.update([p.prompt_id for p in seen], scores[rows] * noise, lengths.mean(dim=1)[rows] * stale,
                         rewards=earlier, difficulties=[p.difficulty for p in seen])
    refill = world_args(REFILL)
    name, options = pruner_options(refill)
    drawn = build_pruner(name, **options).prompts_to_sample(refill.rollout_batch_size, maker.history)
    if 2 * drawn > POOL:
        raise RuntimeError(f"the refill configurations would draw {drawn} of the pool's {POOL} prompts: the pool must "
                           "hold several steps' worth, so that the draw is a sample of it")
    tokens = {p.prompt_id: float(sum(len(c.output_ids) for c in completions[tuple(p.input_ids)]))
              for p in task.prompts}
    return World(task, tokenizer, completions, maker.history.state_dict(), uniform, tokens)


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


def disagreeing_engine(world: World, policy: "TinyPolicy", gap: float, seed: int = 0) -> World:
    """The world with an engine that disagrees with the trainer: each response token's engine log-prob is the tiny
    policy's own (the trainer's, at its weights) minus noise ~ N(0, gap²), fixed per (prompt, response), so the log
    ratio trainer / engine of a token is that noise. The world's other parts (and its random draws) are unchanged."""
    generator = torch.Generator().manual_seed(seed)
    engine_logprobs, completions = {}, {}
    for prompt, group in world.completions.items():
        for completion in group:
            key = (prompt, tuple(completion.output_ids))
            if key not in engine_logprobs:
                batch = build_thd_batch([TrainingSample(list(prompt), completion.output_ids)], [0])
                trainer = policy.logprobs(batch, policy.weight)[batch.loss_mask.bool()]  # [response tokens]
                noise = gap * torch.randn(len(trainer), generator=generator, dtype=torch.float64)
                engine_logprobs[key] = (trainer - noise).tolist()
        completions[prompt] = [dataclasses.replace(c, output_logprobs=engine_logprobs[(prompt, tuple(c.output_ids))])
                               for c in group]
    return dataclasses.replace(world, completions=completions)


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


class DrawRecorder:
    """The world's task, recording every draw from its prompt sampler (the trainer's), so that each trained step's
    full batch is known: a step trains the oldest draws not yet trained (partial rollouts draw a cohort ahead)."""

    def __init__(self, task):
        self.task, self.pending = task, []

    def __getattr__(self, name):
        return getattr(self.task, name)

    def next_prompts(self, count: int) -> list:
        drawn = self.task.next_prompts(count)
        self.pending.append(drawn)
        return drawn

    def take(self, num_drawn: int) -> list:
        """The prompts of the oldest draws, `num_drawn` of them in all (the trained rollouts' num_drawn)."""
        taken = []
        while len(taken) < num_drawn:
            taken += self.pending.pop(0)
        if len(taken) != num_drawn:
            raise RuntimeError(f"the step trained {num_drawn} drawn prompts, not a whole number of draws")
        return taken


@dataclass
class Draws:
    """One configuration's draws: weights per canonical sample, normaliser counts, what was drawn, packed gradients."""

    weights: torch.Tensor  # [draws, canonical samples]
    counts: list  # [draws] FullBatchInfo: what the trainer's normaliser counted
    drawn: torch.Tensor  # [draws, POOL] how many times each prompt of the pool was drawn
    real_counts: list  # [draws] FullBatchInfo: the drawn prompts' real sequences and response tokens
    normaliser_from_draw: bool  # every draw's counts are the rule's, computed from the draw alone
    packed: list  # [(draw, loss variant, aggregation, autograd gradient through packing at DP=2)]


def canonical_samples(world: World):
    """Identical (prompt, response) pairs train identically: one canonical index each. Returns the index, the
    samples, [POOL, canonical] how many of each prompt's G completions each one is, and [canonical] uniform group."""
    index, samples, uniform = {}, [], []
    prompt_ids = {tuple(p.input_ids): p.prompt_id for p in world.task.prompts}
    members = []
    for prompt, group in world.completions.items():
        for completion in group:
            key = (prompt, tuple(completion.output_ids))
            if key not in index:
                index[key] = len(samples)
                samples.append((prompt, completion))
                uniform.append(prompt_ids[prompt] in world.uniform_groups)
            members.append((prompt_ids[prompt], index[key]))
    membership = torch.zeros(POOL, len(samples), dtype=torch.float64)
    for prompt_id, sample in members:
        membership[prompt_id, sample] += 1
    return index, samples, membership, torch.tensor(uniform)


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


def rule_counts(world: World, decision, drawn: list) -> FullBatchInfo | None:
    """The full-batch rule (docs/algorithms.md) recomputed from the draw alone, whichever prompts the coins kept: a
    drawn prompt kept with probability 1 counts its real tokens, one that could have been pruned G x its history
    length. None where the decision is not over the drawn prompts (DAPO's dynamic sampling)."""
    if decision.num_prompts != len(drawn):
        return None
    tokens = sum(world.response_tokens[prompt.prompt_id] if keep_prob >= 1.0 else GROUP * expected
                 for prompt, keep_prob, expected in zip(drawn, decision.keep_probs.tolist(),
                                                        decision.expected_response_lengths.tolist()))
    return FullBatchInfo(float(len(drawn) * GROUP), tokens)


def run_draws(world: World, args, draws: int, packed_draws: int, policy: TinyPolicy, variants: dict | None = None
              ) -> Draws:
    """`draws` steps of the trainer's ExperienceMaker, each from the same history, each drawing from the pool; the
    first `packed_draws` also through packing under every loss variant's arguments (default: `args` alone)."""
    variants = variants or {args.rollout_correction: args}
    index, _, _, _ = canonical_samples(world)
    task = DrawRecorder(copy.deepcopy(world.task))
    maker = ExperienceMaker(args, task, world.tokenizer, FixedWorldClient(world.completions))
    weights = torch.zeros(draws, len(index), dtype=torch.float64)
    drawn_counts = torch.zeros(draws, POOL, dtype=torch.float64)
    counts, real_counts, packed, from_draw = [], [], [], True
    for step in range(draws):
        maker.history.load_state_dict(world.history_state)
        rollouts = maker.generate(step)
        experience = maker.make(rollouts, step, progress=0.0)
        drawn = task.take(rollouts.num_drawn)
        for prompt in drawn:
            drawn_counts[step, prompt.prompt_id] += 1
        counts.append(experience.normalizer_counts)
        real_counts.append(FullBatchInfo(float(len(drawn) * GROUP),
                                         sum(world.response_tokens[prompt.prompt_id] for prompt in drawn)))
        rule = rule_counts(world, rollouts.prompt_decision, drawn)
        from_draw = from_draw and rule is not None and same_counts(rule, experience.normalizer_counts)
        for sample in experience.samples:
            key = (tuple(sample.prompt_ids), tuple(sample.response_ids))
            weights[step, index[key]] += sample.sample_weight
        if step < packed_draws and experience.samples:
            batches = [batch for rank in range(2) for batch in pack_micro_batches(
                experience.samples, MICRO_BATCH_TOKENS, 256, 2, rank)[0]]
            for variant, variant_args in variants.items():
                for aggregation in AGGREGATIONS:
                    config = aggregation_config(variant_args, aggregation)
                    normalizer = loss_normalizer(config, experience.normalizer_counts)
                    packed.append((step, variant, aggregation, policy.loss_gradient(config, batches, normalizer)))
    return Draws(weights, counts, drawn_counts, real_counts, from_draw, packed)


def full_group_advantages(world: World, args) -> dict:
    """Every sample's advantage, from one GRPO step that rolls out the whole pool with nothing pruned or filtered
    (advantages are computed on the full group, so they do not depend on the draw)."""
    grpo = copy.copy(args)
    grpo.algorithm, grpo.dapo_filter, grpo.rollout_batch_size = "grpo", False, POOL
    grpo.dapo_dynamic_sampling = grpo.partial_rollout = False
    maker = ExperienceMaker(grpo, copy.deepcopy(world.task), world.tokenizer, FixedWorldClient(world.completions))
    maker.history.load_state_dict(world.history_state)
    experience = maker.make(maker.generate(0), 0, 0.0)
    return {(tuple(s.prompt_ids), tuple(s.response_ids)): s.advantage for s in experience.samples}


@dataclass
class Result:
    configuration: str
    correction: str  # the rollout correction of the loss
    aggregation: str
    unbiased: bool
    history_lengths: str  # "stale" or "exact"
    draws: int
    # against `own`: the drawn samples normalised by the rule's count (what the configuration estimates)
    max_bias_se: float  # max over coordinates of |mean(g - own)| / SE (inf when the draws do not vary)
    projection_bias_se: float  # |mean(g - own)| along own's direction, in standard errors of that projection
    ratio: float  # Σ <g, u> / Σ <own, u>, u the mean own gradient's direction
    relative_error: float  # |mean(g - own)| / |mean own|
    # against `full`: the drawn samples normalised by their real counts (the full batch's loss)
    scale: float  # Σ <g, v> / Σ <full, v>, v the mean full gradient's direction
    scale_se: float  # its standard error over the draws (the ratio estimator's, by the delta method)
    predicted_scale: float  # Σ (real count / rule's count) <full, v> / Σ <full, v>
    max_bias_se_full: float  # max over coordinates of |mean(g - full)| / SE
    cosine_to_full: float  # <mean g, mean full> / (|mean g| |mean full|)
    mean_squared_error: float  # E|g - own|² / E|own|²: the estimate's variance (plus bias²), relative
    packed_max_error: float  # max |autograd through packing at DP=2 - linear form| / |linear form|
    normaliser_from_draw: bool  # every draw's counts were the rule's, computed from the draw alone
    correction_shift: float  # |mean own − that without correction| / the latter (NaN: the configuration's loss only)


def same_counts(first: FullBatchInfo, second: FullBatchInfo) -> bool:
    """Equal up to the rounding of summing the same lengths in another prompt order."""
    return all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(dataclasses.astuple(first),
                                                                  dataclasses.astuple(second)))


def bias_in_se(estimates: torch.Tensor, references: torch.Tensor, floor: float) -> torch.Tensor:
    """|mean(estimate - reference)| / its standard error, per column of [draws, ...] (SE floored at `floor`)."""
    differences = estimates - references
    standard_error = (differences.std(dim=0) / math.sqrt(len(differences))).clamp(min=floor)
    return differences.mean(dim=0).abs() / standard_error


def ratio_with_se(numerators: torch.Tensor, denominators: torch.Tensor, floor: float) -> tuple[float, float]:
    """Σ numerators / Σ denominators over the draws, and its standard error (delta method), floored at `floor`."""
    ratio = float(numerators.sum() / denominators.sum())
    residuals = numerators - ratio * denominators
    return ratio, max(float(residuals.std()) / math.sqrt(len(numerators)) / abs(float(denominators.mean())), floor)


def check_configuration(name: str, configuration: Configuration, draws: int, packed_draws: int = 20, seed: int = 0,
                        mispredicted: bool = True, stale_lengths: tuple = STALE_LENGTHS) -> list[Result]:
    """Run one configuration's draws and compare them with the draws' full-batch gradients, per loss variant (rollout
    correction) and aggregation."""
    variants = loss_variants(configuration)
    args = next(iter(variants.values()))
    uniform_groups = OVERSAMPLING_UNIFORM_GROUPS if args.dapo_oversample > 1 else POOL // 2
    world = build_world(seed, uniform_groups, mispredicted, configuration.history_lengths, stale_lengths)
    policy = TinyPolicy(world.tokenizer.vocab_size, seed)
    if configuration.engine_gap:
        world = disagreeing_engine(world, policy, configuration.engine_gap, seed)
    result = run_draws(world, args, draws, packed_draws, policy, variants)
    advantages = full_group_advantages(world, args)
    _, _, membership, uniform = canonical_samples(world)
    if args.dapo_filter:  # the configuration's full batch: the DAPO filter's varied groups only
        membership = membership * (~uniform).double()
    results, uncorrected = [], {}
    for variant, variant_args in variants.items():
        for aggregation in AGGREGATIONS:
            config = aggregation_config(variant_args, aggregation)
            gradients_per_sample = per_sample_gradients(world, policy, variant_args, aggregation, advantages)
            rule = torch.tensor([loss_normalizer(config, counts) for counts in result.counts], dtype=torch.float64)
            real = torch.tensor([loss_normalizer(config, counts) for counts in result.real_counts],
                                dtype=torch.float64)
            gradients = (result.weights @ gradients_per_sample) / rule[:, None]  # [draws, params]
            drawn_sums = result.drawn @ (membership @ gradients_per_sample)  # [draws, params]: Σ over drawn samples
            own, full = drawn_sums / rule[:, None], drawn_sums / real[:, None]
            floor = 1e-12 * float(full.norm(dim=1).mean())  # an estimate that does not vary has SE 0: rounding
            mean, mean_own, mean_full = gradients.mean(dim=0), own.mean(dim=0), full.mean(dim=0)
            own_direction, full_direction = mean_own / mean_own.norm(), mean_full / mean_full.norm()
            ratio, _ = ratio_with_se(gradients @ own_direction, own @ own_direction, floor)
            scale, scale_se = ratio_with_se(gradients @ full_direction, full @ full_direction, floor)
            predicted, _ = ratio_with_se((real / rule) * (full @ full_direction), full @ full_direction, floor)
            packed_errors = [float((gradient - gradients[step]).norm() / gradients[step].norm())
                             for step, packed_variant, packed_aggregation, gradient in result.packed
                             if (packed_variant, packed_aggregation) == (variant, aggregation)]
            if variant == "none":
                uncorrected[aggregation] = mean_own
            shift = (float((mean_own - uncorrected[aggregation]).norm() / uncorrected[aggregation].norm())
                     if len(variants) > 1 else math.nan)
            results.append(Result(
                name, variant, aggregation, configuration.unbiased, configuration.history_lengths, draws,
                float(bias_in_se(gradients, own, floor).max()),
                float(bias_in_se(gradients @ own_direction, own @ own_direction, floor)), ratio,
                float((mean - mean_own).norm() / mean_own.norm()), scale, scale_se, predicted,
                float(bias_in_se(gradients, full, floor).max()),
                float(mean @ mean_full / (mean.norm() * mean_full.norm())),
                float((gradients - own).square().sum(dim=1).mean() / own.square().sum(dim=1).mean()),
                max(packed_errors, default=0.0), result.normaliser_from_draw, shift))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=20_000, help="draws per unbiased configuration (x draw_factor)")
    parser.add_argument("--biased-draws", type=int, default=500, help="draws per biased configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stale-lengths", type=float, nargs=2, default=STALE_LENGTHS, metavar=("LOW", "HIGH"),
                        help="a seen prompt's history length over its real one is uniform in [LOW, HIGH]")
    parser.add_argument("--only", nargs="+", type=int, metavar="INDEX",
                        help="run only these configurations (0-based positions in CONFIGURATIONS)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    options = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for position, (name, configuration) in enumerate(CONFIGURATIONS.items()):
        if options.only is None or position in options.only:
            draws = round(options.draws * configuration.draw_factor) if configuration.unbiased else options.biased_draws
            rows += check_configuration(name, configuration, draws, seed=options.seed,
                                        stale_lengths=tuple(options.stale_lengths))
    print(f"{'configuration':<58} {'correction':<10} {'aggregation':<24} {'draws':>6} {'max|bias|/SE':>12} "
          f"{'proj/SE':>7} {'ratio':>7} {'rel.err':>7} {'scale':>7} {'± SE':>6} {'predicted':>9} {'worst/SE':>8} "
          f"{'packed':>8} {'Z rule':>6} {'shift':>6}")
    for row in rows:
        print(f"{row.configuration:<58} {row.correction:<10} {row.aggregation:<24} {row.draws:>6} "
              f"{row.max_bias_se:>12.2f} {row.projection_bias_se:>7.2f} {row.ratio:>7.4f} {row.relative_error:>7.4f} "
              f"{row.scale:>7.4f} {row.scale_se:>6.4f} {row.predicted_scale:>9.4f} {row.max_bias_se_full:>8.2f} "
              f"{row.packed_max_error:>8.1e} {str(row.normaliser_from_draw):>6} {row.correction_shift:>6.3f}")
    if options.json:
        options.json.write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
    print(f"seconds: {time.perf_counter() - start:.0f}")
    unbiased = [row for row in rows if row.unbiased]
    print(f"dppo_e2e_max_projection_bias_se: {max((r.projection_bias_se for r in unbiased), default=math.nan):.2f}")
    print(f"dppo_e2e_max_ratio_error: {max((abs(r.ratio - 1) for r in unbiased), default=math.nan):.4f}")
    print(f"dppo_e2e_max_bias_se: {max((row.max_bias_se for row in unbiased), default=math.nan):.2f}")
    print("dppo_e2e_max_scale_vs_predicted_se: "
          f"{max((abs(r.scale - r.predicted_scale) / r.scale_se for r in unbiased), default=math.nan):.2f}")
    for lengths in ("stale", "exact"):  # DPPO's: GRPO's normaliser counts only what it rolled out
        scales = [row.scale for row in unbiased if row.aggregation == "token-mean" and row.history_lengths == lengths
                  and not row.configuration.startswith("grpo")]
        if scales:
            print(f"dppo_e2e_token_mean_scale_{lengths}_lengths: {min(scales):.4f} to {max(scales):.4f}")


if __name__ == "__main__":
    main()

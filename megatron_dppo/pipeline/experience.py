"""One step's experience on rank 0: everything between the prompt source and the packer.

    draw M prompts (M = B, or the refill's B / (1 - rate), fixed before any coin) ─► prompt level (history's
    prediction, BEFORE rollout) ─► rollout, G samples each ─► rewards                           generate()
    (--dapo-dynamic-sampling: rounds of drawn prompts, rolled out and rewarded, until B varied groups;
     --partial-rollout: each draw opens a cohort, continued chunk by chunk over steps, that trains once whole)
    ─► advantages on the FULL groups ─► prompt history (every rolled-out group, weighted 1/p)       make()
    ─► full-batch counts (one rule, fixed before any filter or draw) ─► DAPO filter ─► completion level
    ─► Experience: the kept samples with their weights, and what the loss normaliser counts
    step_statistics() summarises a step for the metrics and prompt_outcomes() each group, apart from the logic.

Pure torch, no Megatron: the trainer calls it on rank 0 and broadcasts the Experience; the end-to-end
unbiasedness test and bench/unbiasedness.py drive this very code with a fixed world in place of the rollout
servers. docs/algorithms.md says which objective each configuration estimates.
"""

import math
import time
from dataclasses import dataclass, field

import torch

from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.dapo_filter import DAPOConfig, DAPOFilter, GroupDecision
from megatron_dppo.algo.history import PromptHistory, score_prompts, zero_variance_groups
from megatron_dppo.algo.losses import FullBatchInfo, LossConfig
from megatron_dppo.algo.pruning import (
    PromptDecision,
    Pruner,
    build_pruner,
    full_batch_counts,
    normalizer_scale_estimate,
)
from megatron_dppo.algo.rollout_correction import RolloutCorrection
from megatron_dppo.pipeline.packing import TrainingSample
from megatron_dppo.pipeline.partial_rollouts import PartialConfig, PartialRollouts
from megatron_dppo.rollout.client import SamplingParams, SequenceRequest
from megatron_dppo.servers.embedded.scheduler import MAX_BATCH_SIZE


def pruner_options(args) -> tuple[str, dict]:
    """The registry name and config fields of --algorithm's pruner."""
    if args.algorithm == "dppo":
        return "dppo", dict(
            prompt_prune_rate=args.dppo_prompt_prune_rate, completion_prune_rate=args.dppo_completion_prune_rate,
            mode=args.dppo_mode, keep_policy=args.dppo_keep_policy, prompt_p_min=args.dppo_prompt_p_min,
            completion_p_min=args.dppo_completion_p_min, candidates=args.dppo_candidates,
            prompt_score=args.dppo_prompt_score, prompt_sampling=args.dppo_prompt_sampling,
            group_size=args.n_samples_per_prompt, advantage_estimator=args.advantage_estimator,
            probe_samples=args.dppo_probe_samples, probe_prompts=args.dppo_probe_prompts,
            probe_p_min=args.dppo_probe_p_min, refill=args.dppo_refill, refill_max=args.dppo_refill_max,
            importance_weights=args.dppo_importance_weights, seed=args.rl_seed)
    if args.algorithm == "cppo":
        return "cppo", dict(prune_rate=args.cppo_prune_rate, scope=args.cppo_scope, refill=args.cppo_refill)
    if args.algorithm == "d3s":
        return "d3s", dict(sample_fraction_init=args.d3s_sample_fraction[0],
                           sample_fraction_final=args.d3s_sample_fraction[1],
                           token_fraction_init=args.d3s_token_fraction[0],
                           token_fraction_final=args.d3s_token_fraction[1])
    return "none", {}


def loss_config(args) -> LossConfig:
    return LossConfig(
        eps_low=args.eps_clip, eps_high=args.eps_clip_high, dual_clip_c=args.eps_clip_c, kl_coef=args.kl_coef,
        kl_type=args.kl_type, entropy_coef=args.entropy_coef, aggregation=args.loss_agg_mode,
        importance_level=args.importance_level, max_response_length=args.rollout_max_response_len,
        rollout_correction=RolloutCorrection(args.rollout_correction, args.rollout_correction_cap,
                                             args.rollout_correction_band))


def run_progress(step: int, elapsed_s: float, train_iters: int | None, time_budget_s: float | None) -> float:
    """How far the run is, in [0, 1]: by steps (--train-iters) or by RL wall time (--time-budget-s), whichever ends
    it first; 0 when neither bounds it. D3S's schedule follows it."""
    by_steps = step / train_iters if train_iters else 0.0
    by_time = elapsed_s / time_budget_s if time_budget_s else 0.0
    return min(max(by_steps, by_time), 1.0)


@dataclass(kw_only=True)
class Rollouts:
    """rank 0: one step's generation result. Built by keyword only: a field added later cannot shift the others."""

    prompts: list  # [Prompt] kept by the prompt level, in order
    prompt_decision: PromptDecision
    output_ids: list[list[int]]  # [num_prompts * G]
    output_logprobs: list[list[float]]
    rewards: torch.Tensor  # [num_prompts, G] float64
    seconds: float
    reward_seconds: float
    num_drawn: int
    capacity: int  # the groups one step trains at most (the DAPO filter's cap under over-sampling)
    tokens_generated: int  # every token generated in this step, of the groups here and of any discarded or carried
    stats: dict = field(default_factory=dict)
    # [num_prompts * G] per token: the weight version that sampled it (partial rollouts carry tokens across versions)
    output_versions: list[list[int]] = field(default_factory=list)
    # the in-step probe: (prompt id, passes) of each probed group that was not continued (the history counts them)
    stopped_probes: list[tuple[int, float]] = field(default_factory=list)

    def subset(self, rows: list[int]) -> "Rollouts":
        """The groups `rows`, each with all its samples; every one stands for the batch (DAPO's dynamic sampling)."""
        group = self.rewards.shape[1]
        flat = [row * group + column for row in rows for column in range(group)]
        return Rollouts(
            prompts=[self.prompts[row] for row in rows], prompt_decision=PromptDecision.keep_all(len(rows)),
            output_ids=[self.output_ids[i] for i in flat], output_logprobs=[self.output_logprobs[i] for i in flat],
            rewards=self.rewards[rows], seconds=self.seconds, reward_seconds=self.reward_seconds,
            num_drawn=self.num_drawn, capacity=self.capacity, tokens_generated=self.tokens_generated,
            stats=dict(self.stats), output_versions=[self.output_versions[i] for i in flat])


def concatenate(parts: list[Rollouts]) -> Rollouts:
    """Rounds of DAPO's dynamic sampling as one Rollouts (each group standing for the batch); times and draws add."""
    first = parts[0]
    return Rollouts(
        prompts=[p for part in parts for p in part.prompts],
        prompt_decision=PromptDecision.keep_all(sum(len(part.prompts) for part in parts)),
        output_ids=[ids for part in parts for ids in part.output_ids],
        output_logprobs=[lps for part in parts for lps in part.output_logprobs],
        rewards=torch.cat([part.rewards for part in parts]), seconds=sum(part.seconds for part in parts),
        reward_seconds=sum(part.reward_seconds for part in parts), num_drawn=sum(part.num_drawn for part in parts),
        capacity=first.capacity, tokens_generated=sum(part.tokens_generated for part in parts),
        stats={key: sum(part.stats.get(key, 0.0) for part in parts) for key in first.stats},
        output_versions=[versions for part in parts for versions in part.output_versions])


@dataclass
class Selection:
    """Which rolled-out samples train, with what weight, and what the normaliser counts."""

    rows: torch.Tensor  # [kept] int64, the rolled-out prompt of each kept sample
    columns: torch.Tensor  # [kept] int64, its index in the group
    weights: torch.Tensor  # [kept] float64, the product over levels (prompt, DAPO cap, completion)
    advantages: torch.Tensor  # [P, G], on the full groups
    full_batch: FullBatchInfo  # the step's full batch (full_batch_counts)
    normalizer_counts: FullBatchInfo  # the full batch, or the survivors for CPPO / D3S
    stats: dict = field(default_factory=dict)  # the pruners' own


@dataclass
class Experience:
    """The kept samples of one step, as every rank receives them."""

    samples: list[TrainingSample]
    normalizer_counts: FullBatchInfo  # what the loss normaliser counts (D3S's token level updates it)
    progress: float  # the run's progress in [0, 1] when the step was made (D3S's schedule)
    stats: dict = field(default_factory=dict)


def select_samples(rewards, lengths, prompt_decision: PromptDecision, pruner: Pruner, dapo: DAPOFilter | None,
                   capacity: int, estimator: str, step: int, progress: float) -> Selection:
    """advantages (full groups) → full-batch counts → DAPO filter → completion level; rewards, lengths [P, G]."""
    advantages = compute_advantages(rewards, estimator)
    full_batch = full_batch_counts(prompt_decision, lengths)
    groups = GroupDecision(torch.arange(len(rewards)), torch.ones(len(rewards), dtype=torch.float64))
    if dapo is not None:
        groups = dapo.select_groups(rewards, capacity, step)
    rows = groups.kept
    decision = pruner.select_completions(rewards[rows], advantages[rows], lengths[rows],
                                         prompt_decision.restricted_to(rows, groups.weights), full_batch, step,
                                         progress)
    group_size = rewards.shape[1]
    scale = {"normalizer_scale_estimate": normalizer_scale_estimate(prompt_decision, lengths, full_batch)}
    return Selection(rows[decision.kept // group_size], decision.kept % group_size, decision.weights, advantages,
                     full_batch, decision.normalizer_counts, {**groups.stats, **decision.stats, **scale})


def step_statistics(rollouts: Rollouts, rewards, lengths, selection: Selection, samples_trained: int,
                    reward_seconds: float) -> dict:
    """The metrics of one step's experience (the pruners' own stats first: ours take precedence)."""
    group = lengths.shape[1] if lengths.dim() == 2 else 1
    num_rollouts = max(rewards.numel(), 1)
    drawn = max(rollouts.num_drawn, 1)
    return {
        **{name: float(value) for name, value in selection.stats.items()},
        **rollouts.stats,
        "reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
        "accuracy": float((rewards == 1).double().mean()) if rewards.numel() else 0.0,
        "zero_variance_group_fraction": float((rewards.std(dim=1) == 0).double().mean()) if len(rewards) else 0.0,
        "kept_fraction_prompts": len(rollouts.prompts) / drawn,
        "prompts_drawn": float(rollouts.num_drawn),
        "prompts_pruned": float(rollouts.prompt_decision.num_prompts - len(rollouts.prompts)),
        "kept_fraction_completions": samples_trained / num_rollouts,
        "kept_fraction": samples_trained / (drawn * group),
        "full_batch_sequences": selection.full_batch.num_sequences,
        "full_batch_response_tokens": selection.full_batch.num_response_tokens,
        "tokens_generated": rollouts.tokens_generated,
        "tokens_per_second_rollout": rollouts.tokens_generated / max(rollouts.seconds, 1e-9),
        "seconds_rollout": rollouts.seconds,
        "seconds_reward": reward_seconds,
        "response_length_mean": float(lengths.double().mean()) if lengths.numel() else 0.0,
        "sequences_trained": samples_trained,
        **weight_statistics(selection, lengths),
    }


def weight_statistics(selection: Selection, lengths: torch.Tensor) -> dict:
    """How much the step's importance weights cost in noise. weight_ess_fraction: Kish's effective sample size of
    the kept samples' weights over their count, (Σw)² / (n Σw²), 1 when all weigh alike. gradient_noise_proxy:
    Σ w² A² L / N² over the kept samples (L the response length, N the full batch's response tokens), the variance
    of the token-mean gradient estimate if every token's gradient were an independent unit vector: it grows with the
    weights the pruning puts on informative samples and shrinks with the full batch."""
    weights = selection.weights.to(torch.float64)
    if not len(weights):
        return {"weight_ess_fraction": 0.0, "gradient_noise_proxy": 0.0}
    advantages = selection.advantages[selection.rows, selection.columns].to(torch.float64)
    tokens = lengths[selection.rows, selection.columns].to(torch.float64)
    full_tokens = max(selection.full_batch.num_response_tokens, 1.0)
    return {"weight_ess_fraction": float(weights.sum() ** 2 / (len(weights) * (weights ** 2).sum())),
            "gradient_noise_proxy": float((weights ** 2 * advantages ** 2 * tokens).sum()) / full_tokens ** 2}


def decode_work(output_ids: list[list[int]], backend: str) -> dict:
    """The decode loops one rollout request cost. The embedded engine decodes the request's rows in order, at most
    MAX_BATCH_SIZE at once: a batch's loop runs one iteration per position of its longest response, and the next
    batch waits for it (one batch at a time holds the model lock). Other engines batch continuously: one loop, as
    long as the longest response."""
    rows = MAX_BATCH_SIZE if backend == "embedded" else max(len(output_ids), 1)
    batches = [output_ids[first:first + rows] for first in range(0, len(output_ids), rows)]
    return {"decode_iterations": float(sum(max(len(ids) for ids in batch) for batch in batches)),
            "engine_batches": float(len(batches))}


def sample_requests(prompts: list, prompt_indices, sample_indices, params: SamplingParams,
                    group_size: int) -> list[SequenceRequest]:
    """Samples `sample_indices` of each prompt, each with the seed it has in a round of all `group_size` samples of
    the prompt at its index in that round (SamplingParams.sample_seed): a group rolled out in two parts draws its
    samples with the seeds of one round."""
    return [SequenceRequest(list(prompt.input_ids), params.sample_seed(index, sample, group_size),
                            params.max_new_tokens)
            for prompt, index in zip(prompts, prompt_indices) for sample in sample_indices]


def staleness(output_versions: list[list[int]], version: int) -> dict:
    """How many weight versions the rolled-out tokens are older than the weights that train on them (`version`): 0
    on-policy, 1 under --async, up to --partial-rollout-max-staleness more for tokens carried over."""
    ages = torch.tensor([version - v for versions in output_versions for v in versions], dtype=torch.float64)
    if not len(ages):
        return {}
    return {"staleness_mean": float(ages.mean()), "staleness_max": float(ages.max()),
            "off_policy_token_fraction": float((ages > 0).double().mean())}


def prompt_outcomes(rollouts: Rollouts, rewards, lengths) -> list[dict]:
    """One record per rolled-out group: what the prompt level knew before rollout (keep probability, predicted
    zero-variance probability) and what came of it (rewards, mean response length); metrics.OUTCOMES_FILE."""
    decision = rollouts.prompt_decision
    keep_probs = decision.keep_probs[decision.kept].tolist()
    predicted = decision.predicted_zero_variance[decision.kept].tolist()
    return [{"prompt_id": prompt.prompt_id, "difficulty": prompt.difficulty, "rewards": row,
             "zero_variance": len(set(row)) == 1, "keep_prob": keep_prob,
             "predicted_zero_variance": None if math.isnan(z) else z, "response_length_mean": length}
            for prompt, row, keep_prob, z, length in zip(rollouts.prompts, rewards.tolist(), keep_probs, predicted,
                                                         lengths.double().mean(dim=1).tolist())]


class ExperienceMaker:
    """rank 0: draws, generates, scores and selects one step's samples (see the module docstring)."""

    def __init__(self, args, task, tokenizer, client, history: PromptHistory | None = None):
        self.args, self.task, self.tokenizer, self.client = args, task, tokenizer, client
        self.history = history if history is not None else PromptHistory(
            args.history_ema_decay, args.history_prior_strength, args.history_sample_weight)
        name, options = pruner_options(args)
        self.pruner = build_pruner(name, **options)
        self.dapo = DAPOFilter(DAPOConfig(args.dapo_oversample, args.rl_seed)) if args.dapo_filter else None
        self.loss_config = loss_config(args)
        self.sampling = SamplingParams(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop_token_ids=[tokenizer.eos_token_id])
        self.weight_version = 0  # the version the rollout servers hold: the trainer sets it at every weight sync
        self.partial = PartialRollouts(PartialConfig(args.partial_rollout_chunk_tokens,
                                                     args.partial_rollout_max_staleness,
                                                     args.rollout_max_response_len),
                                       client) if args.partial_rollout else None

    def generate(self, step: int) -> Rollouts:
        """Draw prompts (the refill's M), prune at the prompt level from history, generate G samples per kept
        prompt, and score them (partial rollouts: continue the open cohorts, and score the oldest once whole)."""
        if self.args.dapo_dynamic_sampling:
            return self.generate_until_varied(step)
        if self.partial is not None:
            return self.generate_partial(step)
        prompts, decision, num_drawn, capacity = self.draw(step)
        if self.pruner.probing(self.history):
            return self.probe_and_continue(prompts, decision, step, num_drawn, capacity)
        return self.roll_out(prompts, decision, step, num_drawn, capacity)

    def draw(self, step: int) -> tuple[list, PromptDecision, int, int]:
        """(the prompts the prompt level kept, its decision, prompts drawn, the step's capacity)."""
        target = self.pruner.prompt_target(self.args.rollout_batch_size, self.history)  # or the probe's prompts
        # the refill never draws a prompt twice in one step: at most the pool
        capacity = min(self.pruner.prompts_to_sample(target, self.history), max(len(self.task.prompts), target))
        drawn = self.task.next_prompts(self.dapo.prompts_to_sample(capacity) if self.dapo else capacity)
        decision = self.pruner.select_prompts([p.prompt_id for p in drawn], self.history, step,
                                              [p.difficulty for p in drawn], batch_size=target)
        return [drawn[i] for i in decision.kept.tolist()], decision, len(drawn), capacity

    def generate_partial(self, step: int) -> Rollouts:
        """Partial rollouts (partial_rollouts.py): restart what is past the staleness bound, admit new draws until
        S + 1 cohorts are open, continue every unfinished sample chunk by chunk until the oldest cohort is whole,
        and score that cohort as this step's rollouts."""
        version = self.weight_version
        stats = self.partial.enforce_staleness(version)
        while (cohort_id := self.partial.cohort_to_admit(step)) is not None:
            prompts, decision, num_drawn, capacity = self.draw(cohort_id)
            self.partial.admit(cohort_id, version, prompts, decision, num_drawn, capacity,
                               self.sampling_for_step(cohort_id), self.args.n_samples_per_prompt)
        cohort, generation = self.partial.run_until_oldest_whole(self.sampling, version)
        samples = cohort.samples
        return self.scored(cohort.prompts, cohort.decision, [s.output_ids for s in samples],
                           [s.output_logprobs for s in samples], [s.output_versions for s in samples],
                           generation.pop("seconds"), cohort.num_drawn, cohort.capacity, generation.pop("tokens"),
                           {**stats, **generation})

    def generate_until_varied(self, step: int) -> Rollouts:
        """DAPO's dynamic sampling: rounds of ceil(B x --dapo-oversample) drawn prompts until B groups with varied
        rewards are in hand (at most --dapo-max-rounds rounds); the first B train as if they were the batch. Biased
        by design: the batch follows the distribution of the varied groups and the stopping rule is random
        (docs/algorithms.md); it is the baseline many users run."""
        batch = self.args.rollout_batch_size
        round_size = math.ceil(batch * self.args.dapo_oversample - 1e-9)
        parts, varied = [], 0
        for round_index in range(self.args.dapo_max_rounds):
            drawn = self.task.next_prompts(round_size)
            part = self.roll_out(drawn, PromptDecision.keep_all(len(drawn)), step, len(drawn), batch, round_index)
            rows = (~zero_variance_groups(part.rewards)).nonzero().squeeze(1).tolist()[:batch - varied]
            parts.append(part.subset(rows))
            varied += len(rows)
            if varied == batch:
                break
        rollouts = concatenate(parts)
        rollouts.stats.update({"dapo_rounds": float(len(parts)), "dapo_batch_shortfall": float(batch - varied)})
        return rollouts

    def roll_out(self, prompts: list, decision: PromptDecision, step: int, num_drawn: int, capacity: int,
                 round_index: int = 0) -> Rollouts:
        """G samples per prompt from the rollout servers, and their rewards."""
        start = time.perf_counter()
        group = self.args.n_samples_per_prompt
        completions = self.client.generate([p.input_ids for p in prompts], self.sampling_for_step(step, round_index),
                                           n=group) if prompts else []
        if len(completions) != len(prompts) * group:
            raise RuntimeError(f"the rollout servers returned {len(completions)} samples for {len(prompts)} prompts "
                               f"x {group}: a server dropped requests")
        output_ids = [c.output_ids for c in completions]
        return self.scored(prompts, decision, output_ids, [c.output_logprobs for c in completions],
                           [[self.weight_version] * len(ids) for ids in output_ids], time.perf_counter() - start,
                           num_drawn, capacity, sum(len(ids) for ids in output_ids),
                           decode_work(output_ids, self.args.rollout_backend))

    def probe_and_continue(self, prompts: list, decision: PromptDecision, step: int, num_drawn: int,
                           capacity: int) -> Rollouts:
        """DPPO's in-step probe: k samples of each of the P prompts the prompt level kept, their rewards, then exactly
        B groups continued (the pruner's select_continuations) with their other G - k samples. Each sample keeps the
        seed it has in a one-round step (sample_requests). A continued group weighs 1 / (π · π'), a stopped one
        leaves only its probe's passes to the history."""
        start = time.perf_counter()
        group, probe = self.args.n_samples_per_prompt, self.pruner.probe_samples
        params = self.sampling_for_step(step)
        probed = self.client.generate_requests(sample_requests(prompts, range(len(prompts)), range(probe), params,
                                                               group), params)
        reward_start = time.perf_counter()
        probe_rewards = self.rewards_of(prompts, [c.output_ids for c in probed], probe)  # [P, k]
        reward_seconds = time.perf_counter() - reward_start
        ids, difficulties = [p.prompt_id for p in prompts], [p.difficulty for p in prompts]
        continued, inclusion, informative = self.pruner.select_continuations(
            ids, self.history, difficulties, probe_rewards.sum(dim=1), self.args.rollout_batch_size, step)
        rest = self.client.generate_requests(sample_requests([prompts[i] for i in continued.tolist()],
                                                             continued.tolist(), range(probe, group), params, group),
                                             params)
        samples = []
        for position, row in enumerate(continued.tolist()):
            samples += probed[row * probe:(row + 1) * probe] + rest[position * (group - probe):
                                                                    (position + 1) * (group - probe)]
        seconds = time.perf_counter() - start - reward_seconds
        reward_start = time.perf_counter()
        rest_rewards = self.rewards_of([prompts[i] for i in continued.tolist()],
                                       [c.output_ids for c in rest], group - probe)
        rewards = torch.cat([probe_rewards[continued], rest_rewards], dim=1)  # [B, G]: probe first, as samples
        reward_seconds += time.perf_counter() - reward_start
        continued_decision = decision.continued(continued, inclusion)
        stopped = sorted(set(range(len(prompts))) - set(continued.tolist()))
        stats = {"probe_groups": float(len(prompts)),
                 "probe_varied_fraction": float(((probe_rewards.sum(dim=1) > 0) &
                                                 (probe_rewards.sum(dim=1) < probe)).double().mean())
                 if len(prompts) else 0.0,
                 "probe_continue_prob_mean": float(inclusion.mean()) if len(prompts) else 0.0,
                 "probe_informative_predicted_mean": float(informative.mean()) if len(prompts) else 0.0,
                 **decode_work([c.output_ids for c in probed], self.args.rollout_backend),
                 "rollout_rounds": 2.0}
        continuation = decode_work([c.output_ids for c in rest], self.args.rollout_backend)
        stats = {**stats, **{key: stats[key] + value for key, value in continuation.items()}}
        rollouts = self.scored([prompts[i] for i in continued.tolist()], continued_decision,
                               [c.output_ids for c in samples], [c.output_logprobs for c in samples],
                               [[self.weight_version] * len(c.output_ids) for c in samples], seconds, num_drawn,
                               capacity, sum(len(c.output_ids) for c in probed + rest), stats, rewards=rewards)
        rollouts.reward_seconds += reward_seconds
        rollouts.stopped_probes = [(ids[i], float(probe_rewards[i].sum())) for i in stopped]
        return rollouts

    def rewards_of(self, prompts: list, output_ids: list[list[int]], per_prompt: int) -> torch.Tensor:
        """[len(prompts), per_prompt] float64: the task's rewards of `per_prompt` samples of each prompt, in order."""
        responses = [self.tokenizer.decode(ids) for ids in output_ids]
        references = [p.reference for p in prompts for _ in range(per_prompt)]
        fields = [p.fields for p in prompts for _ in range(per_prompt)]
        return torch.tensor(self.task.score(responses, references, fields), dtype=torch.float64).view(-1, per_prompt)

    def scored(self, prompts: list, decision: PromptDecision, output_ids, output_logprobs, output_versions,
               seconds: float, num_drawn: int, capacity: int, tokens_generated: int,
               stats: dict | None = None, rewards: torch.Tensor | None = None) -> Rollouts:
        """The rollouts of `prompts` (G samples each, in (prompt, sample) order) with their rewards (scored here
        unless given)."""
        start = time.perf_counter()
        group = self.args.n_samples_per_prompt
        if rewards is None:
            rewards = self.rewards_of(prompts, output_ids, group)
        stats = {"groups_rolled_out": float(len(prompts)),
                 "zero_variance_groups_rolled_out": float(zero_variance_groups(rewards).sum()), **(stats or {})}
        return Rollouts(prompts=prompts, prompt_decision=decision, output_ids=output_ids,
                        output_logprobs=output_logprobs, rewards=rewards, seconds=seconds,
                        reward_seconds=time.perf_counter() - start, num_drawn=num_drawn, capacity=capacity,
                        tokens_generated=tokens_generated, stats=stats, output_versions=output_versions)

    def sampling_for_step(self, step: int, round_index: int = 0) -> SamplingParams:
        """Sampling parameters with a seed fixed by (seed, step, round of dynamic sampling), so a resumed run draws
        the same samples."""
        seed = self.args.rl_seed * 1_000_003 + step + round_index * 1_000_000_007
        return SamplingParams(**{**self.sampling.__dict__, "seed": seed})

    def make(self, rollouts: Rollouts, step: int, progress: float) -> Experience:
        """advantages → history → selection → the kept samples and the normaliser (rewards come with the rollouts)."""
        group = self.args.n_samples_per_prompt
        rewards = rollouts.rewards
        lengths = torch.tensor([len(ids) for ids in rollouts.output_ids], dtype=torch.int64).view(-1, group)
        decision = rollouts.prompt_decision
        selection = select_samples(rewards, lengths, decision, self.pruner, self.dapo, rollouts.capacity,
                                   self.args.advantage_estimator, step, progress)
        if rollouts.prompts:
            self.history.update([p.prompt_id for p in rollouts.prompts],
                                score_prompts(rewards, selection.advantages, self.pruner.prompt_score),
                                lengths.double().mean(dim=1), rewards=rewards,
                                difficulties=[p.difficulty for p in rollouts.prompts],
                                weights=1.0 / decision.keep_probs[decision.kept])
        if rollouts.stopped_probes:
            ids, passes = zip(*rollouts.stopped_probes)
            self.history.update_probe(ids, passes, self.pruner.probe_samples)
        samples = self.training_samples(rollouts, selection)
        stats = step_statistics(rollouts, rewards, lengths, selection, len(samples), rollouts.reward_seconds)
        stats.update(staleness(rollouts.output_versions, self.weight_version))
        stats["prompt_outcomes"] = prompt_outcomes(rollouts, rewards, lengths)
        return Experience(samples, selection.normalizer_counts, progress, stats)

    @staticmethod
    def training_samples(rollouts: Rollouts, selection: Selection) -> list[TrainingSample]:
        """The kept samples with a response (an empty response has no token to train on)."""
        group = len(rollouts.output_ids) // max(len(rollouts.prompts), 1)
        samples = []
        for row, column, weight in zip(selection.rows.tolist(), selection.columns.tolist(),
                                       selection.weights.tolist()):
            index = row * group + column
            if rollouts.output_ids[index]:
                samples.append(TrainingSample(
                    prompt_ids=rollouts.prompts[row].input_ids, response_ids=rollouts.output_ids[index],
                    advantage=float(selection.advantages[row, column]), sample_weight=weight,
                    rollout_logprobs=rollouts.output_logprobs[index]))
        return samples

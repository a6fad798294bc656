"""One step's experience on rank 0: everything between the prompt source and the packer.

    draw prompts ─► prompt level (history, BEFORE rollout) ─► rollout, G samples each          generate()
    ─► reward ─► advantages on the FULL groups ─► prompt history                                 make()
    ─► full-batch counts (one rule, fixed before any filter or draw) ─► DAPO filter ─► completion level
    ─► Experience: the kept samples with their weights, and what the loss normaliser counts
    step_statistics() summarises a step for the metrics, apart from the logic.

Pure torch, no Megatron: the trainer calls it on rank 0 and broadcasts the Experience; the end-to-end
unbiasedness test and bench/unbiasedness.py drive this very code with a fixed world in place of the rollout
servers. docs/algorithms.md says which objective each configuration estimates.
"""

import time
from dataclasses import dataclass, field

import torch

from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.history import PromptHistory, score_prompts
from megatron_dppo.algo.losses import FullBatchInfo, LossConfig
from megatron_dppo.algo.pruning import (
    DAPOConfig,
    DAPOFilter,
    GroupDecision,
    PromptDecision,
    Pruner,
    build_pruner,
    full_batch_counts,
)
from megatron_dppo.packing import TrainingSample
from megatron_dppo.rollout.client import SamplingParams


def pruner_options(args) -> tuple[str, dict]:
    """The registry name and config fields of --algorithm's pruner."""
    if args.algorithm == "dppo":
        return "dppo", dict(
            prompt_prune_rate=args.dppo_prompt_prune_rate, completion_prune_rate=args.dppo_completion_prune_rate,
            mode=args.dppo_mode, keep_policy=args.dppo_keep_policy, prompt_p_min=args.dppo_prompt_p_min,
            completion_p_min=args.dppo_completion_p_min, candidates=args.dppo_candidates,
            prompt_score=args.dppo_prompt_score, seed=args.rl_seed)
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
        importance_level=args.importance_level, tis_cap=args.tis_cap, max_response_length=args.rollout_max_response_len)


def run_progress(step: int, elapsed_s: float, train_iters: int | None, time_budget_s: float | None) -> float:
    """How far the run is, in [0, 1]: by steps (--train-iters) or by RL wall time (--time-budget-s), whichever ends
    it first; 0 when neither bounds it. D3S's schedule follows it."""
    by_steps = step / train_iters if train_iters else 0.0
    by_time = elapsed_s / time_budget_s if time_budget_s else 0.0
    return min(max(by_steps, by_time), 1.0)


@dataclass
class Rollouts:
    """rank 0: one step's generation result."""

    prompts: list  # [Prompt] kept by the prompt level, in order
    prompt_decision: PromptDecision
    output_ids: list[list[int]]  # [num_prompts * G]
    output_logprobs: list[list[float]]
    seconds: float
    num_drawn: int
    capacity: int  # the groups one step trains at most (the DAPO filter's cap under over-sampling)


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
    return Selection(rows[decision.kept // group_size], decision.kept % group_size, decision.weights, advantages,
                     full_batch, decision.normalizer_counts, {**groups.stats, **decision.stats})


def step_statistics(rollouts: Rollouts, rewards, lengths, selection: Selection, samples_trained: int,
                    reward_seconds: float) -> dict:
    """The metrics of one step's experience (the pruners' own stats first: ours take precedence)."""
    group = lengths.shape[1] if lengths.dim() == 2 else 1
    num_rollouts = max(rewards.numel(), 1)
    drawn = max(rollouts.num_drawn, 1)
    return {
        **{name: float(value) for name, value in selection.stats.items()},
        "reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
        "accuracy": float((rewards == 1).double().mean()) if rewards.numel() else 0.0,
        "zero_variance_group_fraction": float((rewards.std(dim=1) == 0).double().mean()) if len(rewards) else 0.0,
        "kept_fraction_prompts": len(rollouts.prompts) / drawn,
        "kept_fraction_completions": samples_trained / num_rollouts,
        "kept_fraction": samples_trained / (drawn * group),
        "full_batch_sequences": selection.full_batch.num_sequences,
        "full_batch_response_tokens": selection.full_batch.num_response_tokens,
        "tokens_generated": int(lengths.sum()),
        "tokens_per_second_rollout": float(lengths.sum()) / max(rollouts.seconds, 1e-9),
        "seconds_rollout": rollouts.seconds,
        "seconds_reward": reward_seconds,
        "response_length_mean": float(lengths.double().mean()) if lengths.numel() else 0.0,
        "sequences_trained": samples_trained,
    }


class ExperienceMaker:
    """rank 0: draws, generates, scores and selects one step's samples (see the module docstring)."""

    def __init__(self, args, task, tokenizer, client, history: PromptHistory | None = None):
        self.args, self.task, self.tokenizer, self.client = args, task, tokenizer, client
        self.history = history if history is not None else PromptHistory(args.history_ema_decay)
        name, options = pruner_options(args)
        self.pruner = build_pruner(name, **options)
        self.dapo = DAPOFilter(DAPOConfig(args.dapo_oversample, args.rl_seed)) if args.dapo_filter else None
        self.loss_config = loss_config(args)
        self.sampling = SamplingParams(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop_token_ids=[tokenizer.eos_token_id])

    def generate(self, step: int) -> Rollouts:
        """Draw prompts, prune at the prompt level from history, and generate G samples per kept prompt."""
        capacity = self.pruner.prompts_to_sample(self.args.rollout_batch_size)  # CPPO's refill draws more
        drawn = self.task.next_prompts(self.dapo.prompts_to_sample(capacity) if self.dapo else capacity)
        decision = self.pruner.select_prompts(torch.tensor([p.prompt_id for p in drawn]), self.history, step)
        kept = [drawn[i] for i in decision.kept.tolist()]
        start = time.perf_counter()
        group = self.args.n_samples_per_prompt
        completions = self.client.generate([p.input_ids for p in kept], self.sampling_for_step(step), n=group) \
            if kept else []
        if len(completions) != len(kept) * group:
            raise RuntimeError(f"the rollout servers returned {len(completions)} samples for {len(kept)} prompts x "
                               f"{group}: a server dropped requests")
        return Rollouts(kept, decision, [c.output_ids for c in completions], [c.output_logprobs for c in completions],
                        time.perf_counter() - start, len(drawn), capacity)

    def sampling_for_step(self, step: int) -> SamplingParams:
        """Sampling parameters with a seed fixed by (seed, step), so a resumed run draws the same samples."""
        return SamplingParams(**{**self.sampling.__dict__, "seed": self.args.rl_seed * 1_000_003 + step})

    def make(self, rollouts: Rollouts, step: int, progress: float) -> Experience:
        """rewards → advantages → history → selection → the kept samples and the normaliser."""
        group = self.args.n_samples_per_prompt
        start = time.perf_counter()
        responses = [self.tokenizer.decode(ids) for ids in rollouts.output_ids]
        references = [p.reference for p in rollouts.prompts for _ in range(group)]
        rewards = torch.tensor(self.task.score(responses, references), dtype=torch.float64).view(-1, group)
        reward_seconds = time.perf_counter() - start
        lengths = torch.tensor([len(ids) for ids in rollouts.output_ids], dtype=torch.int64).view(-1, group)
        selection = select_samples(rewards, lengths, rollouts.prompt_decision, self.pruner, self.dapo,
                                   rollouts.capacity, self.args.advantage_estimator, step, progress)
        if rollouts.prompts:
            self.history.update([p.prompt_id for p in rollouts.prompts],
                                score_prompts(rewards, selection.advantages, self.pruner.prompt_score),
                                lengths.double().mean(dim=1))
        samples = self.training_samples(rollouts, selection)
        stats = step_statistics(rollouts, rewards, lengths, selection, len(samples), reward_seconds)
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

"""Pruners: one registry, one interface. Which prompts to roll out, which completions (and tokens) to train on.

per step, in the trainer (megatron_dppo/pipeline/experience.py):
  prompts_to_sample(batch_size, history)                 how many prompts to draw (DPPO and CPPO refill)
  select_prompts(prompt_ids, history, step, difficulties) → PromptDecision     BEFORE rollout (DPPO level 1)
  rollout, rewards, advantages on the FULL groups of the kept prompts
  full_batch_counts(prompt_decision, lengths) → FullBatchInfo   the step's full batch: ONE rule, fixed before any
                                                                 filter or pruning draw
  DAPOFilter.select_groups(rewards, capacity, step)             zero-variance groups out (optional; dapo_filter.py)
  select_completions(rewards, advantages, lengths, prompt_decision, full_batch, step, progress) → CompletionDecision
  loss_normalizer(loss_config, decision.normalizer_counts)      once, before micro-batching
  select_tokens(token_advantages, token_entropy, loss_mask, sample_ids, progress)   (D3S token level only)

Registry (PRUNERS, build_pruner):
  none  GRPO: keep everything; normalise by the full batch.
  dppo  two levels, stochastic (unbiased: keep with probability p, weight 1/p, product over levels, the full batch's
        normaliser) or deterministic (the paper's Algorithm 1: drop the floor(r·n) lowest, rescale the rest). The
        prompt level scores each drawn prompt by its history's predicted probability z that its group is
        zero-variance (history.py), keeps it with p ∝ sqrt(1 - z) floored at p_min, and with refill draws a fixed
        M ≈ B / (1 - prune rate) candidates per step so that about B are rolled out (DPPOPruner).
  cppo  keep the k = floor(G(1-P)) largest |A| per group or over the batch; renormalise over the survivors (biased
        by design, as its paper).
  d3s   keep the subset of maximal Var(A), then the top-K% tokens by |A|·H; both relaxed by a linear schedule over
        the run's progress; renormalise over the survivors (biased by design).
The DAPO filter (dapo_filter.py) is not a pruner but a level every pruner can run behind: it drops groups whose
rewards are all equal (their policy-gradient term is exactly 0) and, when over-sampling brings more varied groups
than the batch holds, keeps a uniform random `capacity` of them with weight V / capacity, so the dropped ones carry
their weight.

Randomness: a draw uses a generator seeded by (seed, step, level) only (levels: prompt, completion, the DAPO
filter's cap), so every data-parallel rank makes the same decision without communication, and a resumed run repeats
it without saving RNG state.
"""

import math
from dataclasses import dataclass, field

import torch

from megatron_dppo.algo.advantages import check_rewards
from megatron_dppo.algo.history import PROMPT_SCORES, PromptHistory
from megatron_dppo.algo.losses import FullBatchInfo

PROMPT_LEVEL, COMPLETION_LEVEL, DAPO_LEVEL = 0, 1, 2
NUM_LEVELS = 3


@dataclass
class PromptDecision:
    kept: torch.Tensor  # [num_kept] int64 positions into the prompt_ids given to select_prompts, ascending
    weights: torch.Tensor  # [num_kept] float64, 1 / keep probability of each kept prompt
    keep_probs: torch.Tensor  # [num_prompts] float64
    expected_response_lengths: torch.Tensor  # [num_prompts] float64 history mean response length, NaN if unknown
    stats: dict[str, float] = field(default_factory=dict)
    # [num_prompts] float64: the history's probability that the prompt's group will be zero-variance, NaN if none
    predicted_zero_variance: torch.Tensor | None = None
    # False: the kept prompts stand for the whole batch (weight 1, the kept batch's normaliser), the biased shortcut
    # of history-skipping methods; True: the drawn batch is the full batch and kept prompts carry 1 / keep_prob
    corrected: bool = True

    def __post_init__(self):
        if self.predicted_zero_variance is None:
            self.predicted_zero_variance = torch.full((self.num_prompts,), math.nan, dtype=torch.float64)

    @property
    def num_prompts(self) -> int:
        return self.keep_probs.numel()

    def restricted_to(self, rows: torch.Tensor, row_weights: torch.Tensor) -> "PromptDecision":
        """The decision for a subset `rows` of the kept prompts (a filter behind the prompt level), their weights
        multiplied by the filter's own `row_weights`; keep probabilities of all drawn prompts unchanged."""
        return PromptDecision(self.kept[rows], self.weights[rows] * row_weights, self.keep_probs,
                              self.expected_response_lengths, self.stats, self.predicted_zero_variance,
                              self.corrected)

    @classmethod
    def keep_all(cls, num_prompts: int) -> "PromptDecision":
        return cls(
            kept=torch.arange(num_prompts),
            weights=torch.ones(num_prompts, dtype=torch.float64),
            keep_probs=torch.ones(num_prompts, dtype=torch.float64),
            expected_response_lengths=torch.full((num_prompts,), math.nan, dtype=torch.float64),
            stats={"kept_fraction_prompts": 1.0},
        )


@dataclass
class CompletionDecision:
    kept: torch.Tensor  # [num_kept] int64 flat indices prompt * G + completion into the [num_kept_prompts, G] batch
    weights: torch.Tensor  # [num_kept] float64 sample weights, the product over levels
    normalizer_counts: FullBatchInfo  # what the loss normaliser counts: the full batch, or the survivors (CPPO, D3S)
    stats: dict[str, float] = field(default_factory=dict)


class Pruner:
    """Keeps everything (GRPO). The other pruners override the levels they prune at."""

    prompt_score = "mean_abs_advantage"  # the score the trainer records in the PromptHistory
    selects_tokens = False  # True: the trainer runs select_tokens on the old policy's entropy (D3S)

    def prompts_to_sample(self, batch_size: int, history: PromptHistory | None = None) -> int:
        return batch_size

    def select_prompts(self, prompt_ids, history: PromptHistory | None, step: int,
                       difficulties=None) -> PromptDecision:
        return PromptDecision.keep_all(len(prompt_ids))

    def select_completions(self, rewards, advantages, lengths, prompt_decision, full_batch: FullBatchInfo, step: int,
                           progress: float = 0.0) -> CompletionDecision:
        """Which of the rolled-out completions train, with their weights; `full_batch` is the step's full batch
        (full_batch_counts), `progress` the run's progress in [0, 1] (D3S's schedule)."""
        check_completion_inputs(rewards, advantages, lengths, prompt_decision)
        keep = torch.ones_like(advantages, dtype=torch.bool)
        weights = prompt_decision.weights[:, None].expand_as(keep)
        return completion_decision(keep, weights, full_batch, prompt_decision)


# ---------------------------------------------------------------------------------------------------- helpers


def check_completion_inputs(rewards, advantages, lengths, prompt_decision: PromptDecision) -> None:
    check_rewards(rewards)
    if advantages.shape != rewards.shape or lengths.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, advantages {tuple(advantages.shape)} and lengths "
            f"{tuple(lengths.shape)} must all be [num_rolled_out_prompts, group_size]"
        )
    if len(prompt_decision.kept) != rewards.shape[0]:
        raise ValueError(
            f"the prompt decision kept {len(prompt_decision.kept)} prompts but rewards has {rewards.shape[0]} rows: "
            "pass the rewards of exactly the prompts select_prompts kept, in its order"
        )
    if (lengths < 0).any():
        raise ValueError("response lengths must be >= 0")


def full_batch_counts(prompt_decision: PromptDecision, lengths: torch.Tensor) -> FullBatchInfo:
    """The step's full batch: every drawn prompt x G, fixed before any filter or pruning draw (the one rule).

    `lengths` [num_kept_prompts, G] are the response lengths of the prompts the prompt level kept. A prompt kept
    with probability 1 counts its real tokens. A prompt that could have been pruned (p < 1) counts G x its history
    mean response length, known before rollout, whether or not the draw kept it, so that the count does not depend
    on the draw (a random normaliser would make the loss a ratio of random sums, and biased); where that length is
    stale, a token-mean step's gradient is the full batch's times real tokens / this count (docs/algorithms.md,
    measured by bench/unbiasedness.py). The DAPO filter and the completion level come later, so the groups and
    samples they drop are counted too. An uncorrected decision (PromptDecision.corrected False) counts only the kept
    prompts' real tokens: the kept batch stands for the batch.
    """
    group_size = lengths.shape[1]
    if not prompt_decision.corrected:
        return FullBatchInfo.from_lengths(lengths)
    kept_probs = prompt_decision.keep_probs[prompt_decision.kept]
    tokens = float(lengths.to(torch.float64).sum(dim=1)[kept_probs >= 1.0].sum())
    uncertain = prompt_decision.keep_probs < 1.0
    expected = prompt_decision.expected_response_lengths[uncertain]
    if torch.isnan(expected).any():
        raise ValueError("a prompt with keep probability < 1 has no history response length: the prompt level may "
                         "only prune prompts whose length it knows (PromptHistory.update with mean_response_lengths)")
    tokens += group_size * float(expected.sum())
    return FullBatchInfo(num_sequences=float(prompt_decision.num_prompts * group_size), num_response_tokens=tokens)


def normalizer_scale_estimate(prompt_decision: PromptDecision, lengths: torch.Tensor,
                              counts: FullBatchInfo) -> float:
    """An estimate of this step's token-mean scale s = real tokens of the full batch / the normaliser's count, which
    is 1 when the history lengths of the prompts that could be pruned are current (docs/algorithms.md): the real
    tokens of the prompts kept with certainty plus, for those kept with p < 1, their real tokens over p (each stands
    for the 1/p prompts it could have been). A metric for watching the history's staleness in a run, never a
    normaliser: it depends on the draw. 1.0 where nothing could be pruned or the decision is uncorrected."""
    if not prompt_decision.corrected or counts.num_response_tokens <= 0:
        return 1.0
    kept_probs = prompt_decision.keep_probs[prompt_decision.kept]
    real = lengths.to(torch.float64).sum(dim=1)
    estimated_real = float((real / kept_probs.clamp(min=1e-12)).sum()) if len(real) else 0.0
    return estimated_real / counts.num_response_tokens


def completion_decision(keep, weights, normalizer_counts, prompt_decision, extra_stats=None) -> CompletionDecision:
    """Flatten a [P, G] keep mask and weights into a CompletionDecision with the common stats."""
    kept = keep.reshape(-1).nonzero().squeeze(1)
    kept_weights = weights.reshape(-1)[kept].to(torch.float64)
    rolled_out = keep.numel()
    full_count = prompt_decision.num_prompts * keep.shape[1]
    stats = {
        **prompt_decision.stats,
        "kept_fraction_completions": len(kept) / rolled_out if rolled_out else 0.0,
        "kept_fraction_of_full_batch": len(kept) / full_count if full_count else 0.0,
        "weight_mean": float(kept_weights.mean()) if len(kept) else 0.0,
        "weight_max": float(kept_weights.max()) if len(kept) else 0.0,
        **(extra_stats or {}),
    }
    return CompletionDecision(kept=kept, weights=kept_weights, normalizer_counts=normalizer_counts, stats=stats)


def step_generator(seed: int, step: int, level: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + step * NUM_LEVELS + level) % (2**63))
    return generator


def check_keep_fraction(name: str, prune_rate: float) -> None:
    if not 0.0 <= prune_rate < 1.0:
        raise ValueError(
            f"{name} is {prune_rate}: it must be in [0, 1). A rate of 1 gives items a keep probability of 0, "
            "which no importance weight can correct; use a rate below 1"
        )


def proportional_keep_probs(scores: torch.Tensor, keep_fraction: float, p_min: float) -> torch.Tensor:
    """p_i = clip(c · score_i, p_min, 1) with c chosen so that mean(p) = keep_fraction exactly.

    f(c) = Σ clip(c s_i, p_min, 1) is continuous, nondecreasing and linear between the breakpoints p_min/s_i and
    1/s_i, so it is evaluated at the sorted breakpoints with prefix sums and c is interpolated: O(n log n).
    When even c → ∞ falls short (many zero scores), the zero-score items share the remainder equally.
    """
    n = scores.numel()
    target = keep_fraction * n
    if keep_fraction >= 1.0 or n == 0:
        return torch.ones(n, dtype=torch.float64)
    scores = scores.to(torch.float64)
    positive = scores[scores > 0].sort().values  # ascending
    num_zero = n - positive.numel()
    if positive.numel() + p_min * num_zero < target:
        return torch.where(scores > 0, 1.0, (target - positive.numel()) / num_zero).to(torch.float64)
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), positive.cumsum(0)])
    breaks = torch.cat([torch.zeros(1, dtype=torch.float64), p_min / positive, 1.0 / positive]).sort().values
    num_floor = torch.searchsorted(positive, p_min / breaks, right=True)  # c·s_i <= p_min (c = 0 → all)
    num_saturated = positive.numel() - torch.searchsorted(positive, 1.0 / breaks)  # c·s_i >= 1
    middle = prefix[positive.numel() - num_saturated] - prefix[num_floor]
    counts_at_floor = (num_floor + num_zero).to(torch.float64)
    totals = num_saturated.to(torch.float64) + p_min * counts_at_floor + breaks * middle  # f at each breakpoint
    upper = int(torch.searchsorted(totals, torch.tensor([target], dtype=torch.float64)).clamp(max=len(breaks) - 1))
    if upper == 0:
        scale = 0.0
    else:
        lower = upper - 1
        rise = float(totals[upper] - totals[lower])
        scale = float(breaks[lower]) + (
            0.0 if rise <= 0 else (target - float(totals[lower])) * float(breaks[upper] - breaks[lower]) / rise
        )
    return (scale * scores).clamp(min=p_min, max=1.0)


# ----------------------------------------------------------------------------------------------------- DPPO


@dataclass
class DPPOConfig:
    # r_q: expected fraction of the drawn prompts pruned before rollout; "auto": the pool's recent zero-variance share
    # (PromptHistory.zero_variance_share), so that about as many prompts are rolled out as are expected to teach
    prompt_prune_rate: float | str = "auto"
    completion_prune_rate: float = 0.5  # r_o: expected fraction of completion candidates pruned after rewards
    mode: str = "stochastic"  # "stochastic" (unbiased) | "deterministic" (the paper's Algorithm 1)
    keep_policy: str = "proportional"  # "uniform" (p = 1 - r) | "proportional" (p ∝ score, floored at a p_min)
    # The prompt floor is higher: a history's prediction is a stale guess (a prompt all-correct last time may be
    # informative now, and would then carry weight 1/p_min), while a completion's |A| is exact.
    prompt_p_min: float = 0.2
    completion_p_min: float = 0.05
    # "all" | "below_mean" (only items scoring <= the mean may be pruned: batch for prompts, group for completions;
    # InfoBatch-style, our reading of "low |A|")
    candidates: str = "below_mean"
    # what the prompt level scores: "zero_variance" ranks by sqrt(1 - z), z the predicted probability that the group
    # is zero-variance (every prompt has one once anything was rolled out: its stratum's prior); the others rank by an
    # EMA of a per-visit score, and only prompts seen before may be pruned
    prompt_score: str = "zero_variance"
    refill: bool = True  # draw M = B / (1 - r_q) candidates (at most refill_max x B), so about B are rolled out
    refill_max: float = 4.0
    importance_weights: bool = True  # False: the biased shortcut (kept prompts weight 1, the kept batch normalises)
    seed: int = 0

    def __post_init__(self):
        if self.prompt_prune_rate != "auto":
            check_keep_fraction("dppo prompt_prune_rate", self.prompt_prune_rate)
        check_keep_fraction("dppo completion_prune_rate", self.completion_prune_rate)
        choices = {"mode": ("stochastic", "deterministic"), "keep_policy": ("uniform", "proportional"),
                   "candidates": ("all", "below_mean"), "prompt_score": PROMPT_SCORES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"dppo {name} is {getattr(self, name)!r}: choose one of {allowed}")
        if not self.refill_max >= 1.0:
            raise ValueError(f"dppo refill_max is {self.refill_max}: it must be >= 1 (at most refill_max x the "
                             "batch is drawn)")
        for level in ("prompt", "completion"):
            p_min, prune_rate = getattr(self, f"{level}_p_min"), getattr(self, f"{level}_prune_rate")
            if not 0.0 < p_min <= 1.0:
                raise ValueError(
                    f"dppo {level}_p_min is {p_min}: it must be in (0, 1]; a keep probability of 0 makes the "
                    "importance weight infinite and the estimate biased"
                )
            if self.keep_policy == "proportional" and prune_rate != "auto" and prune_rate > 0 \
                    and p_min > 1.0 - prune_rate:
                raise ValueError(
                    f"dppo {level}_p_min {p_min} exceeds the keep fraction 1 - {prune_rate}: the floor alone would "
                    f"keep more than asked; lower {level}_p_min or {level}_prune_rate"
                )


class DPPOPruner(Pruner):
    """DPPO's two levels. The prompt level, per step:

        rate r = --dppo-prompt-prune-rate, or the pool's recent zero-variance share ("auto", clipped to the refill)
        ─► draw M = B / (1 - r) candidates (refill; M = B without it), fixed before any keep coin is flipped
        ─► score each: sqrt(1 - z) from the history's zero-variance prediction z (or a score EMA)
        ─► keep probabilities p_i = clip(c · score_i, p_min, 1), c such that Σ p = B (mean 1 - r), over candidates
        ─► keep each with its own coin (stochastic; weight 1 / p) or the top ones (deterministic; weight M / kept)

    Unbiased (stochastic, importance weights on): every drawn prompt has p > 0 and the loss normaliser is that of
    the M drawn prompts x G (full_batch_counts), so E[loss] is the GRPO loss of the drawn batch whatever M is; a
    rule "draw until B are kept" would not be (its random stopping makes the estimate a biased ratio). Why sqrt:
    a zero-variance group adds nothing to the gradient, so pruning prompt i costs variance ∝ (1/p_i - 1)(1 - z_i),
    and minimising Σ (1 - z_i)/p_i for a fixed Σ p_i gives p_i ∝ sqrt(1 - z_i).
    """

    def __init__(self, config: DPPOConfig):
        self.config = config
        self.prompt_score = config.prompt_score

    def prune_rate(self, history: PromptHistory | None) -> float:
        """The prompt level's expected prune fraction of the drawn prompts, known before the draw."""
        limit = 1.0 - 1.0 / self.config.refill_max if self.config.refill else 1.0 - self.config.prompt_p_min
        if self.config.prompt_prune_rate != "auto":
            return self.config.prompt_prune_rate
        share = math.nan if history is None else history.zero_variance_share()
        return 0.0 if math.isnan(share) else min(max(share, 0.0), limit)

    def prompts_to_sample(self, batch_size: int, history: PromptHistory | None = None) -> int:
        if not self.config.refill:
            return batch_size
        return math.ceil(batch_size / (1.0 - self.prune_rate(history)) - 1e-9)

    def select_prompts(self, prompt_ids, history, step, difficulties=None) -> PromptDecision:
        num_prompts = len(prompt_ids)
        if history is None:
            history = PromptHistory()
        lengths = history.expected_lengths(prompt_ids, difficulties)
        predicted = history.zero_variance_probability(prompt_ids, difficulties)
        if self.config.prompt_score == "zero_variance":
            # every prompt ranks by its own prediction (the sqrt rule above); no "below the mean" cut
            scores = (1.0 - predicted).clamp(min=0.0).sqrt()
            known = ~torch.isnan(predicted) & ~torch.isnan(lengths)
            candidates = known
        else:
            scores, _, known = history.lookup(prompt_ids)
            known = known & ~torch.isnan(lengths)
            candidates = known & self._below_mean(scores, known)
        # a prompt without a score, or whose length could not be counted in the full batch before the draw
        # (full_batch_counts), is never a pruning candidate
        rate = self.prune_rate(history)
        if self.config.refill and candidates.any():  # about B of the M drawn are rolled out
            batch_size = num_prompts * (1.0 - rate)
            rate = min(max(1.0 - (batch_size - float((~candidates).sum())) / float(candidates.sum()), 0.0),
                       1.0 - self.config.prompt_p_min)
        keep, keep_probs, weights = self._prune(
            scores.nan_to_num(0.0), candidates, rate, self.config.prompt_p_min, step, PROMPT_LEVEL, groups=None,
        )
        kept = keep.nonzero().squeeze(1)
        stats = {
            "kept_fraction_prompts": len(kept) / num_prompts if num_prompts else 0.0,
            "prompt_candidates_fraction": float(candidates.double().mean()) if num_prompts else 0.0,
            "prompt_prune_rate": rate,
        }
        if not self.config.importance_weights:
            weights = torch.ones_like(weights)
        return PromptDecision(kept, weights[kept], keep_probs, lengths, stats, predicted,
                              self.config.importance_weights)

    def select_completions(self, rewards, advantages, lengths, prompt_decision, full_batch, step,
                           progress=0.0) -> CompletionDecision:
        check_completion_inputs(rewards, advantages, lengths, prompt_decision)
        scores = advantages.abs().to(torch.float64)  # [P, G], from the FULL group
        group_means = scores.mean(dim=1, keepdim=True).expand_as(scores)
        # "below_mean" uses <=, so a group of equal |A| (e.g. all-correct, A = 0) is all candidates
        candidates = torch.ones_like(scores, dtype=torch.bool) if self.config.candidates == "all" else (
            scores <= group_means
        )
        keep, keep_probs, weights = self._prune(
            scores.reshape(-1), candidates.reshape(-1), self.config.completion_prune_rate,
            self.config.completion_p_min, step, COMPLETION_LEVEL, groups=scores.shape,
        )
        weights = weights.reshape(scores.shape) * prompt_decision.weights[:, None]
        stats = {"completion_candidates_fraction": float(candidates.double().mean()) if candidates.numel() else 0.0}
        return completion_decision(keep.reshape(scores.shape), weights, full_batch, prompt_decision, stats)

    def _below_mean(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if self.config.candidates == "all" or not valid.any():
            return torch.ones_like(valid)
        return scores.nan_to_num(math.inf) <= scores[valid].mean()

    def _prune(self, scores, candidates, prune_rate, p_min, step, level, groups):
        """(keep, keep_probs, weights) [n] for one level. `groups` = (P, G) ranks the deterministic mode per group."""
        n = scores.numel()
        if prune_rate == 0.0 or not candidates.any():
            ones = torch.ones(n, dtype=torch.float64)
            return torch.ones(n, dtype=torch.bool), ones, ones
        if self.config.mode == "deterministic":
            return self._prune_lowest(scores, candidates, prune_rate, groups)
        keep_probs = torch.ones(n, dtype=torch.float64)
        if self.config.keep_policy == "uniform":
            keep_probs[candidates] = 1.0 - prune_rate
        else:
            keep_probs[candidates] = proportional_keep_probs(scores[candidates], 1.0 - prune_rate, p_min)
        keep = torch.rand(n, generator=step_generator(self.config.seed, step, level), dtype=torch.float64) < keep_probs
        return keep, keep_probs, 1.0 / keep_probs

    @staticmethod
    def _prune_lowest(scores, candidates, prune_rate, groups):
        """The paper's Algorithm 1: in each group (or over all), drop the floor(r·n) lowest-scoring candidates."""
        num_groups, group_size = groups if groups is not None else (1, scores.numel())
        scores = scores.reshape(num_groups, group_size)
        candidates = candidates.reshape(num_groups, group_size)
        keep = torch.ones_like(candidates)
        keep_probs = torch.ones(num_groups, group_size, dtype=torch.float64)
        ranked = scores.masked_fill(~candidates, math.inf).argsort(dim=1, stable=True)
        for group in range(num_groups):
            num_candidates = int(candidates[group].sum())
            num_dropped = math.floor(prune_rate * num_candidates)
            if num_dropped == 0:
                continue
            keep[group, ranked[group, :num_dropped]] = False
            keep_probs[group, candidates[group]] = (num_candidates - num_dropped) / num_candidates
        return keep.reshape(-1), keep_probs.reshape(-1), 1.0 / keep_probs.reshape(-1)


# ----------------------------------------------------------------------------------------------------- CPPO


@dataclass
class CPPOConfig:
    prune_rate: float = 0.5  # P
    scope: str = "per_group"  # "per_group" (the paper) | "batch" (the authors' code)
    refill: bool = False  # sample batch_size / (1 - P) prompts (the paper's dynamic completion allocation)

    def __post_init__(self):
        check_keep_fraction("cppo prune_rate", self.prune_rate)
        if self.scope not in ("per_group", "batch"):
            raise ValueError(f"cppo scope is {self.scope!r}: choose 'per_group' or 'batch'")


class CPPOPruner(Pruner):
    def __init__(self, config: CPPOConfig):
        self.config = config

    def prompts_to_sample(self, batch_size: int, history: PromptHistory | None = None) -> int:
        return int(batch_size / (1.0 - self.config.prune_rate)) if self.config.refill else batch_size

    def select_completions(self, rewards, advantages, lengths, prompt_decision, full_batch, step,
                           progress=0.0) -> CompletionDecision:
        check_completion_inputs(rewards, advantages, lengths, prompt_decision)
        num_prompts, group_size = advantages.shape
        keep_rate = 1.0 - self.config.prune_rate
        pool = group_size if self.config.scope == "per_group" else num_prompts * group_size
        k = math.floor(pool * keep_rate + 1e-9)
        if k == 0 and pool > 0:
            raise ValueError(
                f"cppo prune_rate {self.config.prune_rate} keeps floor({pool}·{keep_rate:g}) = 0 completions "
                f"per {self.config.scope.replace('_', ' ')}: lower the prune rate or raise the group size"
            )
        magnitude = advantages.abs()
        keep = torch.zeros_like(magnitude, dtype=torch.bool)
        if self.config.scope == "per_group":
            keep.scatter_(1, magnitude.topk(k, dim=1).indices, True)
        else:
            keep.view(-1)[magnitude.reshape(-1).topk(k).indices] = True
        weights = prompt_decision.weights[:, None].expand_as(magnitude)
        # the paper's 1/k: the loss averages over the survivors, not the full batch
        return completion_decision(keep, weights, FullBatchInfo.from_lengths(lengths[keep]), prompt_decision)


# ------------------------------------------------------------------------------------------------------ D3S


@dataclass
class D3SConfig:
    sample_fraction_init: float = 0.25  # N_init / N: fraction of samples kept at the run's start
    sample_fraction_final: float = 0.75  # ... and at its end (progress 1)
    token_fraction_init: float = 0.5  # K_init: fraction of the kept samples' tokens kept at the start
    token_fraction_final: float = 1.0
    scope: str = "batch"  # "batch" (cross-group D3S) | "per_group" (intra-group, D1S / D3S-I)

    def __post_init__(self):
        for name in ("sample_fraction_init", "sample_fraction_final", "token_fraction_init", "token_fraction_final"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"d3s {name} is {getattr(self, name)}: it must be in (0, 1]")
        if self.scope not in ("batch", "per_group"):
            raise ValueError(f"d3s scope is {self.scope!r}: choose 'batch' or 'per_group'")


def max_variance_subset(values: torch.Tensor, size: int) -> torch.Tensor:
    """Indices of the `size`-subset of `values` with the largest (population) variance.

    The optimum is always the a smallest plus the (size - a) largest values for some a, so one sort and a scan of
    a = 0..size with prefix sums of x and x² find it in O(n log n).
    """
    n = values.numel()
    if not 0 <= size <= n:
        raise ValueError(f"subset size {size} must be in [0, {n}]")
    if size in (0, n):
        return torch.arange(size)
    order = values.to(torch.float64).argsort(stable=True)
    x = values.to(torch.float64)[order]
    zero = torch.zeros(1, dtype=torch.float64)
    prefix, prefix_sq = torch.cat([zero, x.cumsum(0)]), torch.cat([zero, (x * x).cumsum(0)])
    low = torch.arange(size + 1)  # a: how many of the smallest
    high_start = n - (size - low)
    total = prefix[low] + prefix[n] - prefix[high_start]
    total_sq = prefix_sq[low] + prefix_sq[n] - prefix_sq[high_start]
    variance = total_sq / size - (total / size) ** 2
    best = int(variance.argmax())
    return torch.cat([order[:best], order[n - (size - best):]]).sort().values


class D3SPruner(Pruner):
    selects_tokens = True

    def __init__(self, config: D3SConfig):
        self.config = config

    def fractions(self, progress: float) -> tuple[float, float]:
        """(sample fraction, token fraction) at the run's `progress` in [0, 1] on the linear schedule."""
        progress = min(max(progress, 0.0), 1.0)
        c = self.config
        return (
            (1 - progress) * c.sample_fraction_init + progress * c.sample_fraction_final,
            (1 - progress) * c.token_fraction_init + progress * c.token_fraction_final,
        )

    def select_completions(self, rewards, advantages, lengths, prompt_decision, full_batch, step,
                           progress=0.0) -> CompletionDecision:
        check_completion_inputs(rewards, advantages, lengths, prompt_decision)
        sample_fraction, _ = self.fractions(progress)
        keep = torch.zeros_like(advantages, dtype=torch.bool)
        if self.config.scope == "batch":
            size = max(1, round(sample_fraction * advantages.numel())) if advantages.numel() else 0
            keep.view(-1)[max_variance_subset(advantages.reshape(-1), size)] = True
        else:
            size = max(1, round(sample_fraction * advantages.shape[1]))
            for group in range(advantages.shape[0]):
                keep[group, max_variance_subset(advantages[group], size)] = True
        kept_advantages = advantages[keep].to(torch.float64)
        stats = {
            "d3s_sample_fraction": sample_fraction,
            "d3s_kept_advantage_variance": float(kept_advantages.var(unbiased=False)) if keep.any() else 0.0,
        }
        weights = prompt_decision.weights[:, None].expand_as(advantages)
        return completion_decision(keep, weights, FullBatchInfo.from_lengths(lengths[keep]), prompt_decision, stats)

    def select_tokens(self, token_advantages, token_entropy, loss_mask, sample_ids, progress: float):
        """Keep the top-K% of the step's loss-masked tokens by |A|·H (H from the old policy, detached).

        Every argument is flat [tokens] over the WHOLE step (all data-parallel ranks). Returns the new loss mask
        and the counts the normaliser must read after it: the selected tokens, and the sequences that kept at least
        one token (a sequence with none left leaves every term of the loss).
        """
        _, token_fraction = self.fractions(progress)
        mask = loss_mask.bool()
        num_tokens = int(mask.sum())
        num_kept = min(num_tokens, max(1, round(token_fraction * num_tokens))) if num_tokens else 0
        key = (token_advantages.abs() * token_entropy).detach().to(torch.float64).masked_fill(~mask, -math.inf)
        selected = torch.zeros_like(mask)
        selected[key.topk(num_kept).indices] = True
        num_sequences = torch.unique(sample_ids[selected]).numel()
        return selected.to(loss_mask.dtype), FullBatchInfo(float(num_sequences), float(num_kept))


PRUNERS = {
    "none": (Pruner, None),
    "dppo": (DPPOPruner, DPPOConfig),
    "cppo": (CPPOPruner, CPPOConfig),
    "d3s": (D3SPruner, D3SConfig),
}


def build_pruner(name: str, **options) -> Pruner:
    """The pruner `name` from PRUNERS, configured by the fields of its config dataclass."""
    if name not in PRUNERS:
        raise ValueError(f"unknown pruner {name!r}: choose one of {sorted(PRUNERS)}")
    pruner_class, config_class = PRUNERS[name]
    if config_class is None:
        if options:
            raise ValueError(f"pruner 'none' takes no options, got {sorted(options)}")
        return pruner_class()
    return pruner_class(config_class(**options))

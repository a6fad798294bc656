"""The pruners' interface: what a level decides (PromptDecision, CompletionDecision), the pruner that keeps everything
(GRPO, the base every pruner overrides), and what the levels share: the step's full-batch counts, the keep
probabilities' water-filling, the per-(seed, step, level) generators. algo/pruning.py says how a step calls them and
holds the registry; algo/dppo.py, and pruning.py's CPPO and D3S, are the pruners.
"""

import math
from dataclasses import dataclass, field

import torch

from megatron_dppo.algo.advantages import check_rewards
from megatron_dppo.algo.history import PromptHistory
from megatron_dppo.algo.losses import FullBatchInfo

PROMPT_LEVEL, COMPLETION_LEVEL, DAPO_LEVEL = 0, 1, 2
NUM_LEVELS = 3
PROBE_SEED_OFFSET = 0x5EED_9803  # the probe's continuation draws: a seed of their own beside the levels'


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

    def continued(self, positions: torch.Tensor, continue_probs: torch.Tensor) -> "PromptDecision":
        """The decision after an in-step probe of the kept prompts: `positions` (into the kept prompts) continued,
        each kept prompt having had probability `continue_probs` [num_kept] of it. A continued prompt weighs
        1 / (π · π') where the decision is corrected; every kept prompt's inclusion probability becomes π · π'."""
        keep_probs = self.keep_probs.clone()
        keep_probs[self.kept] = keep_probs[self.kept] * continue_probs
        weights = self.weights[positions] / (continue_probs[positions] if self.corrected else 1.0)
        return PromptDecision(self.kept[positions], weights, keep_probs, self.expected_response_lengths,
                              dict(self.stats), self.predicted_zero_variance, self.corrected)

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
    probe_samples = 0  # > 0: DPPO's in-step probe rolls out this many samples of a group before continuing it

    def prompts_to_sample(self, batch_size: int, history: PromptHistory | None = None) -> int:
        return batch_size

    def prompt_target(self, batch_size: int, history: PromptHistory | None = None) -> int:
        """How many prompts the prompt level keeps per step (DPPO's probe keeps more, then continues the batch)."""
        return batch_size

    def probing(self, history: PromptHistory | None) -> bool:
        """Whether this step probes before it continues (DPPO's in-step probe, once the history can predict)."""
        return False

    def select_prompts(self, prompt_ids, history: PromptHistory | None, step: int,
                       difficulties=None, batch_size: int | None = None) -> PromptDecision:
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

"""DPPO's pruner: the prompt level (the history's prediction, a fixed-size draw of the refill, the in-step probe) and
the completion level (|A| of the full group), stochastic (unbiased: keep with probability p, weight 1/p, the full
batch's normaliser) or deterministic (the paper's Algorithm 1). DPPOPruner's docstring draws the step; the
derivations and what is the paper's are in docs/algorithms.md.
"""

import math
from dataclasses import dataclass

import torch

from megatron_dppo.algo.beta_binomial import (
    all_equal_probability,
    continuation_informative_probability,
    expected_sum_squared_advantages,
)
from megatron_dppo.algo.history import PREDICTIVE_SCORES, PROMPT_SCORES, PromptHistory
from megatron_dppo.algo.pruner_interface import (
    COMPLETION_LEVEL,
    PROBE_SEED_OFFSET,
    PROMPT_LEVEL,
    CompletionDecision,
    PromptDecision,
    Pruner,
    check_completion_inputs,
    check_keep_fraction,
    completion_decision,
    proportional_keep_probs,
    step_generator,
)
from megatron_dppo.algo.sampling_designs import SAMPLING_DESIGNS, draw
from megatron_dppo.errors import UserInputError


@dataclass
class DPPOConfig:
    # r_q: expected fraction of the drawn prompts pruned before rollout; "auto": the pool's recent zero-variance share
    # (PromptHistory.zero_variance_share), so that about as many prompts are rolled out as are expected to teach
    prompt_prune_rate: float | str = "auto"
    # r_o: expected fraction of completion candidates pruned after rewards; off by default (docs/results.md's
    # screening: 1.24x against the filtered GRPO with it off, 1.14x at 0.25, 1.26x at 0.5 over 3 seeds; off is simpler)
    completion_prune_rate: float = 0.0
    mode: str = "stochastic"  # "stochastic" (unbiased) | "deterministic" (the paper's Algorithm 1)
    keep_policy: str = "proportional"  # "uniform" (p = 1 - r) | "proportional" (p ∝ score, floored at a p_min)
    # The prompt floor is higher: a history's prediction is a stale guess (a prompt all-correct last time may be
    # informative now, and would then carry weight 1/p_min), while a completion's |A| is exact.
    prompt_p_min: float = 0.2
    completion_p_min: float = 0.05
    # "all" | "below_mean" (only items scoring <= the mean may be pruned: batch for prompts, group for completions;
    # InfoBatch-style, our reading of "low |A|")
    candidates: str = "below_mean"
    # what the prompt level scores: "auto" is "success_rate" while every recorded reward is 0 or 1 and
    # "zero_variance" once one is not (a graded reward); "success_rate" ranks by sqrt(E[Σ A²]) under the history's
    # Beta belief about the prompt's success rate (pass/fail rewards), "zero_variance" by sqrt(1 - z), z the
    # EMA-predicted probability that the group is zero-variance (both: every prompt has one once anything was rolled
    # out, its stratum's prior); the others rank by an EMA of a per-visit score, and only prompts seen before may be
    # pruned
    prompt_score: str = "auto"
    # how the prompt level draws from its keep probabilities (algo/sampling_designs.py): "systematic" keeps exactly
    # the target number (the rollout batch with refill), "bernoulli" an independent coin each (the count varies)
    prompt_sampling: str = "systematic"
    group_size: int = 8  # G, for the success-rate score's E[Σ A²] and the probe
    advantage_estimator: str = "grpo"  # whose Σ A² the success-rate score predicts
    # The in-step probe: probe_samples > 0 rolls out that many samples of each of probe_prompts prompts first, then
    # continues exactly the batch's worth of groups, keeping each with probability ∝ sqrt(P(its group varies | the
    # probe, the history)), floored at probe_p_min; a continued group weighs 1 / that probability
    probe_samples: int = 0
    probe_prompts: int = 0  # prompts probed per step (0: twice the rollout batch)
    probe_p_min: float = 0.1
    refill: bool = True  # draw M = B / (1 - r_q) candidates (at most refill_max x B), so about B are rolled out
    refill_max: float = 4.0
    importance_weights: bool = True  # False: the biased shortcut (kept prompts weight 1, the kept batch normalises)
    seed: int = 0

    def __post_init__(self):
        if self.prompt_prune_rate != "auto":
            check_keep_fraction("dppo prompt_prune_rate", self.prompt_prune_rate)
        check_keep_fraction("dppo completion_prune_rate", self.completion_prune_rate)
        choices = {"mode": ("stochastic", "deterministic"), "keep_policy": ("uniform", "proportional"),
                   "candidates": ("all", "below_mean"), "prompt_score": PROMPT_SCORES,
                   "prompt_sampling": SAMPLING_DESIGNS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"dppo {name} is {getattr(self, name)!r}: choose one of {allowed}")
        if not 0 <= self.probe_samples < self.group_size:
            raise ValueError(f"dppo probe_samples is {self.probe_samples}: it must be in [0, {self.group_size}) (the "
                             "probe rolls out part of a group of --n-samples-per-prompt)")
        if self.probe_samples and (self.mode != "stochastic" or self.prompt_score not in ("auto", "success_rate")):
            raise ValueError("the dppo probe continues groups by the success-rate posterior and weighs them by "
                             "1 / P(continue): it needs --dppo-mode stochastic and --dppo-prompt-score auto or "
                             "success_rate")
        if not 0.0 < self.probe_p_min <= 1.0:
            raise ValueError(f"dppo probe_p_min is {self.probe_p_min}: it must be in (0, 1]")
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
        ─► score each: sqrt(E[Σ A²]) under the history's success-rate belief (or sqrt(1 - z), or a score EMA)
        ─► keep probabilities π_i = clip(c · score_i, p_min, 1), c such that Σ π = B (mean 1 - r), over candidates
        ─► keep exactly B by a fixed-size design (systematic; or an independent coin each, bernoulli), weight 1 / π;
           or the top ones (deterministic; weight M / kept)
        [probe] ─► the B kept are probe_prompts (P): k samples each, then exactly B groups continued
                   (select_continuations), weight 1 / (π_i · π'_i)

    Unbiased (stochastic, importance weights on): every drawn prompt has π > 0, any design keeps it with probability
    exactly π, and the loss normaliser is that of the M drawn prompts x G (full_batch_counts), so E[loss] is the GRPO
    loss of the drawn batch whatever M is; a rule "draw until B are kept" would not be (its random stopping makes the
    estimate a biased ratio). Why sqrt: pruning prompt i costs variance ∝ (1/π_i - 1) E‖g_i‖², E‖g_i‖² ∝ E[Σ A² L],
    and minimising Σ E‖g_i‖² / (π_i c_i) for a fixed cost Σ π_i c_i gives π_i ∝ sqrt(E[Σ A² L] / c_i); with a
    prompt's cost c_i ∝ its generated tokens G · L_i the lengths cancel, and π_i ∝ sqrt(E[Σ A²]) (= sqrt((G - 1)(1 - z))
    for grpo's advantages: a zero-variance group adds nothing).
    """

    def __init__(self, config: DPPOConfig):
        self.config = config
        self.prompt_score = config.prompt_score
        self.probe_samples = config.probe_samples

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

    def prompt_target(self, batch_size: int, history: PromptHistory | None = None) -> int:
        """How many prompts the prompt level keeps per step: the batch, or the probe's prompt count."""
        if not self.probing(history):
            return batch_size
        return self.config.probe_prompts or 2 * batch_size

    def probing(self, history: PromptHistory | None) -> bool:
        """The probe runs once the history has recorded a group: before that nothing predicts which probed groups to
        continue, and a stopped group's length could not be counted in the full batch (full_batch_counts)."""
        return bool(self.config.probe_samples) and history is not None and not math.isnan(
            history.zero_variance_share())

    def score_used(self, history: PromptHistory) -> str:
        """The prompt score this step ranks by: `auto` resolves to success_rate while every reward recorded was 0 or
        1, else to zero_variance (the success-rate belief counts passes, which a graded reward does not have)."""
        if self.config.prompt_score != "auto":
            return self.config.prompt_score
        return "success_rate" if history.rewards_pass_fail else "zero_variance"

    def predictions(self, prompt_ids, history: PromptHistory, difficulties) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, z) [P]: the keep rule's score and the predicted probability that the group is zero-variance, NaN
        where the history knows nothing yet."""
        score = self.score_used(history)
        if score == "success_rate":
            a, b = history.success_rate_posterior(prompt_ids, difficulties)
            known = ~torch.isnan(a)
            scores, predicted = torch.full_like(a, math.nan), torch.full_like(a, math.nan)
            group_size = self.config.group_size
            scores[known] = expected_sum_squared_advantages(a[known], b[known], group_size,
                                                            self.config.advantage_estimator).clamp(min=0.0).sqrt()
            predicted[known] = all_equal_probability(a[known], b[known], group_size)
            return scores, predicted
        predicted = history.zero_variance_probability(prompt_ids, difficulties)
        if score == "zero_variance":
            return (1.0 - predicted).clamp(min=0.0).sqrt(), predicted
        return history.lookup(prompt_ids)[0], predicted

    def select_prompts(self, prompt_ids, history, step, difficulties=None, batch_size=None) -> PromptDecision:
        """The prompt level's decision over the M drawn `prompt_ids`; `batch_size`: how many to keep with the refill
        (its B); without the refill, or by default, M x (1 - rate)."""
        num_prompts = len(prompt_ids)
        if history is None:
            history = PromptHistory()
        lengths = history.expected_lengths(prompt_ids, difficulties)
        scores, predicted = self.predictions(prompt_ids, history, difficulties)
        known = ~torch.isnan(scores) & ~torch.isnan(lengths)
        # the predictive scores rank every prompt by its own prediction (the sqrt rule above); the EMA scores prune
        # only the prompts seen before and scoring below the mean. A prompt without a score, or whose length could
        # not be counted in the full batch before the draw (full_batch_counts), is never a pruning candidate
        candidates = known if self.config.prompt_score in PREDICTIVE_SCORES else (
            known & self._below_mean(scores, known))
        rate = self.prune_rate(history)
        num_candidates, fixed = int(candidates.sum()), num_prompts - int(candidates.sum())
        if self.config.prompt_sampling == "systematic" and num_candidates:
            # exactly `target` of the M drawn are rolled out (the refill's B; without the refill the M drawn are the
            # batch itself, and the level keeps M (1 - r) of them): the candidates keep target - (the others) between
            # them, at least their floors' worth (then the count is one of the two whole numbers around the floors' sum)
            target = min(batch_size, num_prompts) if batch_size is not None and self.config.refill else (
                num_prompts * (1.0 - rate))
            kept_candidates = max(target - fixed, self.config.prompt_p_min * num_candidates)
            rate = max(1.0 - kept_candidates / num_candidates, 0.0)
        elif self.config.refill and num_candidates:
            # bernoulli: about M (1 - r) of the M drawn are rolled out
            rate = min(max(1.0 - (num_prompts * (1.0 - rate) - fixed) / num_candidates, 0.0),
                       1.0 - self.config.prompt_p_min)
        keep, keep_probs, weights = self._prune(
            scores.nan_to_num(0.0), candidates, rate, self.config.prompt_p_min, step, PROMPT_LEVEL, groups=None,
            design=self.config.prompt_sampling,
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

    def select_continuations(self, prompt_ids, history: PromptHistory, difficulties, probe_passes: torch.Tensor,
                             count: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The probe's second stage: which of the P probed groups to continue, exactly `count` of them (systematic).
        `probe_passes` [P]: passing samples among each group's probe_samples. Returns (continued [count] ascending
        positions, inclusion probabilities π' [P], P(the group varies | probe, history) [P]). A probe that varies
        gives 1 (kept with certainty while the count allows); one that agrees gives the posterior chance that the rest
        of the group differs, so the history decides which agreeing groups are still worth the rest of their samples.
        """
        if not history.rewards_pass_fail:
            raise UserInputError("--dppo-probe-samples counts the probe's passing samples, but a reward other than 0 "
                                 "or 1 was recorded: drop --dppo-probe-samples for a graded reward")
        a, b = history.success_rate_posterior(prompt_ids, difficulties)
        informative = continuation_informative_probability(a, b, probe_passes, self.config.probe_samples,
                                                           self.config.group_size)
        # no history yet (NaN): continue as if informative; the count still binds
        informative = informative.nan_to_num(1.0)
        count = min(count, len(prompt_ids))
        inclusion = proportional_keep_probs(informative.sqrt(), count / max(len(prompt_ids), 1),
                                            self.config.probe_p_min)
        continued = draw("systematic", inclusion,
                         step_generator(self.config.seed + PROBE_SEED_OFFSET, step, PROMPT_LEVEL))
        return continued, inclusion, informative

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

    def _prune(self, scores, candidates, prune_rate, p_min, step, level, groups, design="bernoulli"):
        """(keep, keep_probs, weights) [n] for one level. `groups` = (P, G) ranks the deterministic mode per group;
        `design` (algo/sampling_designs.py) draws from the keep probabilities."""
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
        keep = torch.zeros(n, dtype=torch.bool)
        keep[draw(design, keep_probs, step_generator(self.config.seed, step, level))] = True
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

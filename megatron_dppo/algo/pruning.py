"""Pruners: one registry, one interface. Which prompts to roll out, which completions (and tokens) to train on. The
interface and what the levels share are in pruner_interface.py, DPPO in dppo.py, CPPO and D3S here.

per step, in the trainer (megatron_dppo/pipeline/experience.py):
  prompts_to_sample(prompt_target(B), history)           how many prompts to draw (DPPO and CPPO refill)
  select_prompts(prompt_ids, history, step, difficulties, batch_size) → PromptDecision   BEFORE rollout (DPPO level 1)
  [DPPO's probe: k samples of each kept prompt, then select_continuations → exactly B groups continued]
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
        prompt level scores each drawn prompt by what its history predicts of its group (history.py: its success
        rate's Beta belief, E[Σ A²]), keeps it with p ∝ sqrt of that floored at p_min, and with refill draws a fixed
        M ≈ B / (1 - prune rate) candidates per step of which a fixed-size design keeps exactly B (DPPOPruner;
        sampling_designs.py). An optional in-step probe rolls out k samples of 2B prompts and continues exactly B.
  cppo  keep the k = floor(G(1-P)) largest |A| per group or over the batch; renormalise over the survivors (biased
        by design, as its paper).
  d3s   keep the subset of maximal Var(A), then the top-K% tokens by |A|·H; both relaxed by a linear schedule over
        the run's progress; renormalise over the survivors (biased by design).
The DAPO filter (dapo_filter.py) is not a pruner but a level every pruner can run behind: it drops groups whose
rewards are all equal (their policy-gradient term is exactly 0) and, when over-sampling brings more varied groups
than the batch holds, keeps a uniform random `capacity` of them with weight V / capacity, so the dropped ones carry
their weight.

Randomness: a draw uses a generator seeded by (seed, step, level) only (levels: prompt, completion, the DAPO
filter's cap; the probe's continuation its own seed), so every data-parallel rank makes the same decision without
communication, and a resumed run repeats it without saving RNG state.
"""

import math
from dataclasses import dataclass

import torch

from megatron_dppo.algo.dppo import DPPOConfig, DPPOPruner
from megatron_dppo.algo.history import PromptHistory
from megatron_dppo.algo.losses import FullBatchInfo
from megatron_dppo.algo.pruner_interface import (  # noqa: F401  (the pruners' interface, imported from here too)
    COMPLETION_LEVEL,
    DAPO_LEVEL,
    NUM_LEVELS,
    PROMPT_LEVEL,
    CompletionDecision,
    PromptDecision,
    Pruner,
    check_completion_inputs,
    check_keep_fraction,
    completion_decision,
    full_batch_counts,
    normalizer_scale_estimate,
    proportional_keep_probs,
    step_generator,
)

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

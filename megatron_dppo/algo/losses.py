"""The GRPO-family policy loss of one packed micro-batch, with global normalisers.

once per step:  counts = decision.normalizer_counts → normalizer = loss_normalizer(config, counts)
per micro-batch: loss, metrics = policy_loss(config, per-token tensors, normalizer) → loss.backward()
                 (packed_policy_loss takes a packed THD micro-batch and the model's log-probs)

Per token t of sample i (all inputs are flat [tokens], THD layout, a sample id per token):
  ratio      ρ = exp(logp - old_logp)                      token level (PPO/GRPO)
             s_i = exp(mean_t (logp - old_logp))            sequence level (GSPO), the same for all t of i
  pg         max(-A ρ, -A clip(ρ, 1 - eps_low, 1 + eps_high)), then min(pg, -c A) where A < 0 (dual-clip)
  v          pg · v_t, the rollout correction's weight        rollout_correction.py: the rollout-engine/trainer
                                                            gap (none, token-tis, seq-tis, seq-mis, geo-rs, icepop)
  ℓ          pg + kl_coef · KL(k1 | k2 | k3 | low_var_kl) - entropy_coef · H
  loss       Σ_t w_i · m_t · c_t · ℓ_t / Z                  w_i the pruner's sample weight, m_t the loss mask
Aggregation:
  token-mean               c_t = 1,            Z = response tokens of the full batch        (DAPO)
  seq-mean-token-mean      c_t = 1 / |o_i|,    Z = sequences of the full batch              (GRPO)
  seq-mean-token-sum-norm  c_t = 1,            Z = sequences of the full batch · L_max      (Dr.GRPO)

Invariants: Z is fixed before the batch is split, so the SUM of policy_loss over any split into micro-batches
and data-parallel ranks is exactly the full-batch loss (and gradient). A sample's tokens must all lie in one
micro-batch (|o_i| and the GSPO ratio are computed from them); the packer never splits a sequence.
The loss is linear in the sample weights w_i, so a pruner's unbiased weights give an unbiased loss; the rollout
correction's v_t depend on sample i's own tokens only and leave Z alone, so this holds with every correction.
"""

from dataclasses import dataclass, field

import torch

from megatron_dppo.algo.rollout_correction import RolloutCorrection, correction_weights

# policy_loss's metrics are means over a micro-batch's masked tokens, except the counts and these means over its
# sequences: combine_metrics weighs each by its own count
COUNT_METRICS = ("num_tokens", "num_sequences")
SEQUENCE_MEAN_METRICS = ("rollout_correction_rejected_sequence_fraction",)
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
IMPORTANCE_LEVELS = ("token", "sequence")


@dataclass
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.2  # clip-higher (DAPO) sets it above eps_low, e.g. 0.28
    dual_clip_c: float | None = None  # e.g. 3.0; None disables dual-clip
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    aggregation: str = "seq-mean-token-mean"
    importance_level: str = "token"  # "sequence" is GSPO
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)  # default: none
    max_response_length: int | None = None  # L_max, needed by seq-mean-token-sum-norm

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {self.aggregation!r}: choose one of {AGGREGATIONS}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"unknown kl_type {self.kl_type!r}: choose one of {KL_TYPES}")
        if self.importance_level not in IMPORTANCE_LEVELS:
            raise ValueError(
                f"unknown importance_level {self.importance_level!r}: choose one of {IMPORTANCE_LEVELS}"
            )
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise ValueError(
                f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low} and {self.eps_high}"
            )
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (typically 3), got {self.dual_clip_c}; use None to disable it")
        if self.kl_coef < 0.0 or self.entropy_coef < 0.0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")
        if self.aggregation == "seq-mean-token-sum-norm" and not (self.max_response_length or 0) > 0:
            raise ValueError(
                "aggregation 'seq-mean-token-sum-norm' divides by the maximum response length: "
                f"set max_response_length to a positive int, got {self.max_response_length}"
            )


@dataclass(frozen=True)
class FullBatchInfo:
    """What the loss normaliser counts: the sequences and response tokens of the batch the loss averages over.

    For GRPO and DPPO, with or without the DAPO filter, this is the step's FULL batch (every drawn prompt x G,
    pruning.full_batch_counts), fixed before any filter or pruning draw; for CPPO and D3S it is the survivors, as
    their papers renormalise (biased by design).
    """

    num_sequences: float
    num_response_tokens: float

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor) -> "FullBatchInfo":
        """Counts of a batch whose response lengths (any shape, one per sequence) are all known."""
        return cls(num_sequences=float(lengths.numel()), num_response_tokens=float(lengths.sum()))


def loss_normalizer(config: LossConfig, full_batch: FullBatchInfo) -> float:
    """Z of the module docstring, computed once per step, before micro-batching."""
    if full_batch.num_sequences <= 0 or full_batch.num_response_tokens <= 0:
        raise ValueError(
            f"the step's batch has {full_batch.num_sequences} sequences and {full_batch.num_response_tokens} "
            "response tokens: there is nothing to train on; skip the update for this step"
        )
    if config.aggregation == "token-mean":
        return float(full_batch.num_response_tokens)
    if config.aggregation == "seq-mean-token-mean":
        return float(full_batch.num_sequences)
    return float(full_batch.num_sequences) * float(config.max_response_length)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from the sampled token's log-probs."""
    log_ratio = ref_logprobs - logprobs  # log π_ref / π_θ
    if kl_type == "k1":
        return -log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type == "k3":
        return torch.expm1(log_ratio) - log_ratio
    # low_var_kl: k3 with the clamps verl uses, so a far-off reference cannot blow up the loss.
    log_ratio = log_ratio.clamp(-20.0, 20.0)
    return (torch.expm1(log_ratio) - log_ratio).clamp(-10.0, 10.0)


def policy_loss(
    config: LossConfig,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_weights: torch.Tensor,
    sample_ids: torch.Tensor,
    normalizer: float,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the step loss (SUM it over micro-batches and ranks) and metrics over its tokens.

    Every tensor is [tokens]; `logprobs` (and `entropy`, if given) carry the gradient, the others are data.
    """
    _check_inputs(config, logprobs, ref_logprobs, rollout_logprobs, entropy, normalizer)
    mask = loss_mask.to(logprobs.dtype)
    # sample ids may be global; renumber them 0..n-1 within this micro-batch for the per-sample sums.
    _, local_ids = torch.unique(sample_ids, return_inverse=True)
    num_local = int(local_ids.max()) + 1 if local_ids.numel() else 0
    tokens_per_sample = logprobs.new_zeros(num_local).index_add_(0, local_ids, mask)

    log_ratio = logprobs - old_logprobs
    if config.importance_level == "sequence":
        summed = logprobs.new_zeros(num_local).index_add_(0, local_ids, log_ratio * mask)
        log_ratio = (summed / tokens_per_sample.clamp(min=1.0))[local_ids]
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    pg = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
    if config.dual_clip_c is not None:
        bound = -advantages * config.dual_clip_c
        dual_clipped = (advantages < 0) & (pg > bound)
        pg = torch.where(dual_clipped, bound, pg)
    correction = None
    if config.rollout_correction.enabled:
        correction = correction_weights(config.rollout_correction, old_logprobs.detach(), rollout_logprobs, mask,
                                        local_ids, num_local)
        pg = pg * correction.weights

    per_token = pg
    kl = None
    if config.kl_coef > 0.0:
        kl = kl_penalty(logprobs, ref_logprobs, config.kl_type)
        per_token = per_token + config.kl_coef * kl
    if config.entropy_coef > 0.0:
        per_token = per_token - config.entropy_coef * entropy

    scale = sample_weights.to(logprobs.dtype) * mask
    if config.aggregation == "seq-mean-token-mean":
        scale = scale / tokens_per_sample.clamp(min=1.0)[local_ids]
    loss = (per_token * scale).sum() / normalizer

    with torch.no_grad():
        num_tokens = float(mask.sum())
        denominator = max(num_tokens, 1.0)

        def token_mean(values: torch.Tensor) -> float:
            return float((values.to(mask.dtype) * mask).sum()) / denominator

        metrics = {
            "num_tokens": num_tokens,
            "num_sequences": float(num_local),
            "clip_fraction": token_mean(clipped > unclipped),
            "dual_clip_fraction": token_mean(dual_clipped),
            "ratio_mean": token_mean(ratio),
            "pg_loss": token_mean(pg),
        }
        if kl is not None:
            metrics["kl"] = token_mean(kl)
        if entropy is not None:
            metrics["entropy"] = token_mean(entropy)
        if correction is not None:
            metrics["rollout_correction_weight_mean"] = token_mean(correction.weights)
            metrics["rollout_correction_capped_fraction"] = token_mean(correction.capped)
            metrics["rollout_correction_masked_fraction"] = token_mean(correction.masked)
            metrics["rollout_correction_rejected_sequence_fraction"] = \
                float(correction.rejected.sum()) / max(num_local, 1)
    return loss, metrics


def combine_metrics(per_micro_batch: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its micro-batches' policy_loss metrics: each mean weighted by its count (tokens, or
    sequences for SEQUENCE_MEAN_METRICS); the counts themselves are left out (the trainer counts what it trained)."""
    combined = {}
    for key in (per_micro_batch[0] if per_micro_batch else {}):
        if key not in COUNT_METRICS:
            count = "num_sequences" if key in SEQUENCE_MEAN_METRICS else "num_tokens"
            total = sum(metrics[count] for metrics in per_micro_batch)
            combined[key] = sum(metrics[key] * metrics[count] for metrics in per_micro_batch) / max(total, 1.0)
    return combined


def packed_policy_loss(config: LossConfig, batch, logprobs: torch.Tensor, normalizer: float,
                       entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """policy_loss of one packed THD micro-batch (packing.THDBatch) from the model's per-token `logprobs` [T].

    On-policy with one update pass there is no old-log-prob pass: the old log-probs are the current ones, detached
    (the ratio is exactly 1 and the gradient is the policy gradient).
    """
    old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    loss, metrics = policy_loss(
        config, logprobs=logprobs, old_logprobs=old, advantages=batch.advantages, loss_mask=batch.loss_mask,
        sample_weights=batch.sample_weights, sample_ids=batch.sample_index, normalizer=normalizer,
        ref_logprobs=batch.ref_logprobs, rollout_logprobs=batch.rollout_logprobs,
        entropy=entropy if config.entropy_coef else None)
    if batch.rollout_logprobs is not None:
        with torch.no_grad():
            mask = batch.loss_mask
            gap = ((logprobs - batch.rollout_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1)
        metrics["logprob_gap_train_vs_rollout"] = float(gap)
    return loss, metrics


def _check_inputs(config, logprobs, ref_logprobs, rollout_logprobs, entropy, normalizer) -> None:
    if config.kl_coef > 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef is {config.kl_coef} but no ref_logprobs were given: pass them or set kl_coef=0")
    if config.rollout_correction.enabled and rollout_logprobs is None:
        raise ValueError(
            f"rollout correction {config.rollout_correction.name} weighs the trainer's log-probs against the rollout "
            "engine's, but no rollout_logprobs were given: pass them or use RolloutCorrection('none')"
        )
    if config.entropy_coef > 0.0 and entropy is None:
        raise ValueError(f"entropy_coef is {config.entropy_coef} but no entropy was given: pass it or set 0")
    if not normalizer > 0.0:
        raise ValueError(f"loss normalizer must be > 0, got {normalizer}: compute it with loss_normalizer()")
    if logprobs.dim() != 1:
        raise ValueError(f"policy_loss takes flat [tokens] tensors (THD layout), got logprobs {tuple(logprobs.shape)}")

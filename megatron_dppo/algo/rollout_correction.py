"""Rollout correction: what the policy loss does where the rollout engine and the trainer disagree on a token's
log-prob (other kernels, another precision, a stale or perturbed copy of the weights).

    per response token t of sequence i (THD, flat [tokens], m_t the loss mask):
        δ_t = old_logp_t − rollout_logp_t            trainer over engine, in log space (ratio ρ_t = exp δ_t)
        S_i = Σ_t m_t δ_t,  n_i = Σ_t m_t             the sequence's log ratio (ρ_i = exp S_i) and its length
    ─► CORRECTIONS[name](δ, S, n, config) ─► per-token weight v_t, detached, and which tokens it capped or masked
    ─► losses.policy_loss multiplies the clipped policy-gradient term by v_t (KL and entropy terms are not weighted)

name        weight v_t of token t in sequence i                 from
none        1
token-tis   min(ρ_t, C)                                          truncated IS (Yao et al. 2025); verl rollout_is=token
seq-tis     min(ρ_i, C)                                          verl rollout_is=sequence
seq-mis     ρ_i if ρ_i <= C, else 0 (the sequence rejected)      masked IS: verl's sequence IS in mask mode, slime MIS
geo-rs      1 if exp(S_i / n_i) in [low, high], else 0           verl rollout_rs=geometric (rejection, no IS weight)
icepop      ρ_t if ρ_t in [low, high], else 0                    IcePop (the Ring-1T report; AReaL)

A token's log ratio is clamped to [−20, 20] and a sequence's is bounded so before exp (as verl bounds them): no weight
overflows, and seq-mis compares the unbounded S_i with log C, so a sequence ratio of e^100 is rejected, never inf.

Invariants:
- a sample's weights depend on that sample's own tokens only, never on the batch (no batch normalisation), so the
  loss stays a fixed-normaliser sum of per-sample terms: DPPO's 1/p weights multiply it, and the pruned step is
  unbiased for the full batch's step with the same correction;
- the correction never changes the loss normaliser: a capped, masked or rejected token still counts in Z, as a
  pruned one does (docs/algorithms.md says why);
- a sequence's tokens lie in one micro-batch (the packer never splits one), so S_i and n_i are whole.
"""

import math
from dataclasses import dataclass

import torch

CORRECTIONS_USING_CAP = ("token-tis", "seq-tis", "seq-mis")
CORRECTIONS_USING_BAND = ("geo-rs", "icepop")
CORRECTIONS = ("none", *CORRECTIONS_USING_CAP, *CORRECTIONS_USING_BAND)
DEFAULT_CAP = 2.0  # verl's default rollout_is_threshold
# geo-rs: verl's decoupled_geo_rs preset (a geometric mean moves little: 100 tokens at ratio 1.01 each give 1.01);
# icepop: the Ring-1T report's [α, β]
DEFAULT_BANDS = {"geo-rs": (0.999, 1.001), "icepop": (0.5, 5.0)}
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """The correction and its threshold: `cap` (C) for token-tis, seq-tis and seq-mis, `band` ([low, high]) for geo-rs
    and icepop (None: DEFAULT_BANDS)."""

    name: str = "none"
    cap: float = DEFAULT_CAP
    band: tuple[float, float] | None = None

    def __post_init__(self):
        if self.name not in CORRECTIONS:
            raise ValueError(f"unknown rollout correction {self.name!r}: choose one of {CORRECTIONS}")
        if not (math.isfinite(self.cap) and self.cap > 0.0):
            raise ValueError(f"rollout correction cap must be a finite number > 0 (typically 2), got {self.cap}")
        band = DEFAULT_BANDS.get(self.name) if self.band is None else tuple(self.band)
        if band is not None:
            low, high = band
            if not (0.0 <= low <= 1.0 <= high and low < high and math.isfinite(high)):
                raise ValueError(f"rollout correction band [{low}, {high}] must hold ratio 1 (an engine that agrees) "
                                 "with 0 <= low < high: e.g. [0.5, 5] for icepop, [0.999, 1.001] for geo-rs")
        object.__setattr__(self, "band", band)

    @property
    def enabled(self) -> bool:
        return self.name != "none"


@dataclass
class CorrectionWeights:
    """A micro-batch's correction: per-token weights (detached) and what they did, for the metrics."""

    weights: torch.Tensor  # [tokens] v_t
    capped: torch.Tensor  # [tokens] bool: weight truncated at the cap (token-tis, seq-tis)
    masked: torch.Tensor  # [tokens] bool: weight set to 0 (seq-mis, geo-rs, icepop)
    rejected: torch.Tensor  # [sequences] bool: every response token of the sequence masked


def _token_tis(delta, sequence_sum, length, config):
    ratio = delta.exp()
    return ratio.clamp(max=config.cap), ratio > config.cap, torch.zeros_like(ratio, dtype=torch.bool)


def _seq_tis(delta, sequence_sum, length, config):
    ratio = _bounded_exp(sequence_sum)
    return ratio.clamp(max=config.cap), ratio > config.cap, torch.zeros_like(ratio, dtype=torch.bool)


def _seq_mis(delta, sequence_sum, length, config):
    rejected = sequence_sum > math.log(config.cap)
    return _bounded_exp(sequence_sum).masked_fill(rejected, 0.0), torch.zeros_like(rejected), rejected


def _geo_rs(delta, sequence_sum, length, config):
    low, high = config.band
    geometric_mean = (sequence_sum / length.clamp(min=1.0)).exp()
    rejected = (geometric_mean < low) | (geometric_mean > high)
    return (~rejected).to(delta.dtype), torch.zeros_like(rejected), rejected


def _icepop(delta, sequence_sum, length, config):
    low, high = config.band
    ratio = delta.exp()
    masked = (ratio < low) | (ratio > high)
    return ratio.masked_fill(masked, 0.0), torch.zeros_like(masked), masked


def _bounded_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


# name → (δ_t, S_i per token, n_i per token, config) → (weights, capped, masked), all [tokens]
WEIGHT_FUNCTIONS = {"token-tis": _token_tis, "seq-tis": _seq_tis, "seq-mis": _seq_mis, "geo-rs": _geo_rs,
                    "icepop": _icepop}


@torch.no_grad()
def correction_weights(config: RolloutCorrection, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                       mask: torch.Tensor, local_ids: torch.Tensor, num_local: int) -> CorrectionWeights:
    """The correction of one micro-batch: tensors [tokens], `local_ids` the sample of each token numbered 0..n-1."""
    delta = ((old_logprobs - rollout_logprobs) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    sequence_sums = delta.new_zeros(num_local).index_add_(0, local_ids, delta)  # [sequences] S_i, unbounded
    lengths = delta.new_zeros(num_local).index_add_(0, local_ids, mask)  # [sequences] n_i
    weights, capped, masked = WEIGHT_FUNCTIONS[config.name](delta, sequence_sums[local_ids], lengths[local_ids], config)
    live = mask > 0
    kept_tokens = delta.new_zeros(num_local).index_add_(0, local_ids, (live & ~masked).to(delta.dtype))
    return CorrectionWeights(weights * mask, capped & live, masked & live, (kept_tokens == 0) & (lengths > 0))

"""A group's pass/fail outcome under a Beta belief about the prompt's success rate: what the prompt level knows
before rollout, and what an in-step probe adds.

    success rate p ~ Beta(a, b)   (a prompt's posterior: its stratum's prior plus its own discounted counts)
    a group of G samples: k ~ BetaBinomial(G, a, b)
    ─► all_equal_probability(a, b, G)                 z = P(k = 0 or k = G): the group has no gradient
    ─► expected_sum_squared_advantages(a, b, G, est)  E[Σ_j A_j²]: what the group adds to the step's gradient norm
    ─► continuation_informative_probability(...)      after a probe of k0 samples whose rewards agree: P(the whole
                                                      group still varies)
    prior_matching(mean, z_stratum, G)                the stratum's Beta: its groups' mean success fraction and
                                                      zero-variance share

Rewards are pass/fail (0 or 1): the reward functions this project ships (math answers, GSM8K, the synthetic task)
score so. All functions take float64 tensors [P] of a and b (> 0) and are exact sums over k = 0..G (G is a group
size: small).
"""

import math

import torch

# The stratum prior's strength a + b stays in STRENGTH_RANGE: a stratum whose groups look binomial would otherwise
# get an infinitely strong prior, one whose groups are all uniform a degenerate one; its mean stays MEAN_MIN off 0 and 1
STRENGTH_RANGE = (1e-3, 1e4)
MEAN_MIN = 1e-4


def _log_beta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)


def outcome_probabilities(a: torch.Tensor, b: torch.Tensor, group_size: int) -> torch.Tensor:
    """[P, G + 1]: P(k successes of G) under Beta(a, b), the beta-binomial pmf."""
    a, b = torch.as_tensor(a, dtype=torch.float64)[:, None], torch.as_tensor(b, dtype=torch.float64)[:, None]
    k = torch.arange(group_size + 1, dtype=torch.float64)[None, :]
    log_choose = (math.lgamma(group_size + 1) - torch.lgamma(k + 1) - torch.lgamma(group_size - k + 1))
    return torch.exp(log_choose + _log_beta(a + k, b + group_size - k) - _log_beta(a, b))


def all_equal_probability(a: torch.Tensor, b: torch.Tensor, group_size: int) -> torch.Tensor:
    """[P]: z = P(every sample of a group of `group_size` passes, or every one fails) = E[p^G] + E[(1 - p)^G]."""
    probabilities = outcome_probabilities(a, b, group_size)
    return (probabilities[:, 0] + probabilities[:, -1]).clamp(0.0, 1.0)


def sum_squared_advantages(group_size: int, estimator: str) -> torch.Tensor:
    """[G + 1]: Σ_j A_j² of a group of pass/fail rewards with k passes, for the advantage estimators of
    algo/advantages.py (grpo divides by the unbiased std: G - 1 for every varied group; eps neglected)."""
    k = torch.arange(group_size + 1, dtype=torch.float64)
    spread = group_size * (k / group_size) * (1 - k / group_size)  # Σ_j (r_j - mean)²
    if estimator == "grpo":
        values = torch.full_like(k, float(group_size - 1))
    elif estimator == "dr_grpo":
        values = spread
    elif estimator == "rloo":
        values = spread * (group_size / (group_size - 1)) ** 2
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    values[0] = values[-1] = 0.0  # a group of equal rewards has advantage 0
    return values


def expected_sum_squared_advantages(a: torch.Tensor, b: torch.Tensor, group_size: int,
                                    estimator: str = "grpo") -> torch.Tensor:
    """[P]: E[Σ_j A_j²] of the next group under Beta(a, b)."""
    return outcome_probabilities(a, b, group_size) @ sum_squared_advantages(group_size, estimator)


def continuation_informative_probability(a: torch.Tensor, b: torch.Tensor, probe_passes: torch.Tensor,
                                         probe_size: int, group_size: int) -> torch.Tensor:
    """[P]: P(the group of `group_size` varies | its first `probe_size` samples passed `probe_passes` times), under
    Beta(a, b) before the probe. 1 where the probe already varies; where it agrees, the chance that the remaining
    G - k0 samples do not all repeat the probe's outcome, under the posterior Beta(a + passes, b + fails)."""
    passes = torch.as_tensor(probe_passes, dtype=torch.float64)
    a_post, b_post = a + passes, b + probe_size - passes
    rest = outcome_probabilities(a_post, b_post, group_size - probe_size)
    all_pass, all_fail = passes == probe_size, passes == 0
    return torch.where(all_pass, 1.0 - rest[:, -1], torch.where(all_fail, 1.0 - rest[:, 0], 1.0)).clamp(0.0, 1.0)


def prior_matching(mean: float, zero_variance_share: float, group_size: int) -> tuple[float, float]:
    """(a, b) of the Beta whose beta-binomial has a stratum's mean success fraction and its share of zero-variance
    groups: a = μ s, b = (1 - μ) s, the strength s found by bisection on log s (z falls as s grows, from 1 at s → 0 to
    the binomial's μ^G + (1 - μ)^G at s → ∞). Matching z, not the variance: z is what the keep rule reads, and a
    stratum of mostly all-wrong and all-right prompts (a U-shaped Beta, s small) then predicts an unseen prompt
    zero-variance as often as its groups were."""
    mu = min(max(mean, MEAN_MIN), 1.0 - MEAN_MIN)

    def share(strength: float) -> float:
        a, b = mu * strength, (1.0 - mu) * strength
        log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
        all_pass = math.lgamma(a + group_size) + math.lgamma(b) - math.lgamma(a + b + group_size) - log_beta
        all_fail = math.lgamma(a) + math.lgamma(b + group_size) - math.lgamma(a + b + group_size) - log_beta
        return math.exp(all_pass) + math.exp(all_fail)

    low, high = math.log(STRENGTH_RANGE[0]), math.log(STRENGTH_RANGE[1])
    if zero_variance_share >= share(STRENGTH_RANGE[0]):
        high = low
    elif zero_variance_share <= share(STRENGTH_RANGE[1]):
        low = high
    for _ in range(60):  # z(s) is decreasing: keep z(e^low) >= target >= z(e^high)
        middle = (low + high) / 2
        low, high = (middle, high) if share(math.exp(middle)) > zero_variance_share else (low, middle)
    strength = math.exp((low + high) / 2)
    return mu * strength, (1.0 - mu) * strength

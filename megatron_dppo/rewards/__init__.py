"""Reward functions `compute_score(response, reference) -> float`, by task name."""

from megatron_dppo.rewards import gsm8k, math, synthetic

REWARD_FUNCTIONS = {
    "math": math.compute_score,
    "gsm8k": gsm8k.compute_score,
    "synthetic": synthetic.compute_score,
}

__all__ = ["REWARD_FUNCTIONS", "gsm8k", "math", "synthetic"]

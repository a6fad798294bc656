"""Reward functions `compute_score(response, reference) -> float`, by task name."""

from megatron_dppo.rewards import gsm8k, math, synthetic

REWARD_FUNCTIONS = {
    "math": math.compute_score,
    "gsm8k": gsm8k.compute_score,
    "synthetic": synthetic.compute_score,  # the worked task (the embedded default)
    "synthetic_answer": synthetic.compute_answer_only_score,  # the answer-only task (--synthetic-task answer)
}

__all__ = ["REWARD_FUNCTIONS", "gsm8k", "math", "synthetic"]

"""Reward functions `compute_score(response, reference) -> float`, by task name, and what a batch of rewards is scored
from (RewardRow) and returns (RewardBatch): the built-in rewards and a --custom-reward-function alike."""

from dataclasses import dataclass

from megatron_dppo.rewards import gsm8k, math, synthetic

REWARD_FUNCTIONS = {
    "math": math.compute_score,
    "gsm8k": gsm8k.compute_score,
    "synthetic": synthetic.compute_score,  # the worked task (the embedded default)
    "synthetic_answer": synthetic.compute_answer_only_score,  # the answer-only task (--synthetic-task answer)
}


@dataclass(frozen=True)
class RewardRow:
    """What a reward knows of a response's prompt: the reference answer (as a string), the prompt's row as read, the
    data source it came from (a built-in name, a file, a Hub set) and where the row is, for messages."""

    label: str
    fields: dict
    source: str = ""
    location: str = ""


@dataclass(frozen=True)
class RewardBatch:
    """The rewards of a batch of responses, in order, and per response the other values its reward gave (a custom
    reward's dict: every key but "score"; empty for the built-in rewards)."""

    scores: list[float]
    extras: list[dict]

    @classmethod
    def of(cls, scores: list[float]) -> "RewardBatch":
        return cls(list(scores), [{} for _ in scores])


__all__ = ["REWARD_FUNCTIONS", "RewardBatch", "RewardRow", "gsm8k", "math", "synthetic"]

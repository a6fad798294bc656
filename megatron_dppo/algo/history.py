"""Per-prompt history for DPPO's prompt level: an EMA of a score (and of the mean response length) per prompt id.

after rewards:  score_prompts(rewards, advantages) → history.update(prompt_ids, scores, mean_response_lengths)
before rollout: history.lookup(prompt_ids) → scores, response lengths, seen  (what the prompt pruner reads)

The EMA starts at the first observed value (no bias towards an arbitrary prior). A prompt never seen has no
score: the DPPO prompt pruner never prunes it, because nothing is known about it. The state is plain tensors,
so it goes into a checkpoint with state_dict() and comes back with load_state_dict().
"""

import math

import torch

from megatron_dppo.algo.advantages import check_rewards, reject_rewards

PROMPT_SCORES = ("mean_abs_advantage", "reward_std", "unsolved_rate")


def score_prompts(rewards: torch.Tensor, advantages: torch.Tensor, score: str = "mean_abs_advantage") -> torch.Tensor:
    """One score per prompt [num_prompts] from its full group.

    mean_abs_advantage: mean |A|; reward_std: the std of its rewards (0 when G = 1); both are 0 for an all-correct
    AND for an all-wrong group. unsolved_rate: 1 - mean reward, for rewards in [0, 1]: 0 only for a prompt the
    policy already solves every time, so a prompt it has not solved yet (which may become learnable as the policy
    improves) is not scored as worthless.
    """
    check_rewards(rewards)
    if score == "mean_abs_advantage":
        return advantages.abs().mean(dim=1)
    if score == "reward_std":
        return rewards.std(dim=1) if rewards.shape[1] > 1 else torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    if score == "unsolved_rate":
        reject_rewards((rewards < 0) | (rewards > 1), rewards, "rewards outside [0, 1]",
                       "prompt score 'unsolved_rate' needs rewards in [0, 1]; use --dppo-prompt-score "
                       "mean_abs_advantage for this reward")
        return 1.0 - rewards.mean(dim=1)
    raise ValueError(f"unknown prompt score {score!r}: choose one of {PROMPT_SCORES}")


class PromptHistory:
    """EMA per prompt id: value ← decay · value + (1 - decay) · observation; the first observation is taken as is."""

    def __init__(self, ema_decay: float = 0.5):
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}: 0 keeps only the latest visit")
        self.ema_decay = ema_decay
        self._scores: dict[int, float] = {}
        self._lengths: dict[int, float] = {}
        self._visits: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._scores)

    def update(self, prompt_ids, scores, mean_response_lengths=None) -> None:
        """Fold one visit of each prompt into its EMA; `mean_response_lengths` (per prompt) is optional."""
        prompt_ids = [int(prompt_id) for prompt_id in prompt_ids]
        scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1).tolist()
        lengths = (
            [None] * len(prompt_ids)
            if mean_response_lengths is None
            else torch.as_tensor(mean_response_lengths, dtype=torch.float64).reshape(-1).tolist()
        )
        if not len(prompt_ids) == len(scores) == len(lengths):
            raise ValueError(
                f"history.update got {len(prompt_ids)} prompt ids, {len(scores)} scores and {len(lengths)} lengths: "
                "pass one score (and one mean response length) per prompt id"
            )
        for prompt_id, score, length in zip(prompt_ids, scores, lengths):
            if not math.isfinite(score):
                raise ValueError(f"score of prompt id {prompt_id} is {score}: history scores must be finite")
            self._scores[prompt_id] = self._fold(self._scores.get(prompt_id), score)
            if length is not None:
                self._lengths[prompt_id] = self._fold(self._lengths.get(prompt_id), length)
            self._visits[prompt_id] = self._visits.get(prompt_id, 0) + 1

    def _fold(self, old: float | None, new: float) -> float:
        return new if old is None else self.ema_decay * old + (1.0 - self.ema_decay) * new

    def lookup(self, prompt_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores, mean response lengths, seen) [num_prompts] each; NaN where nothing is recorded."""
        prompt_ids = [int(prompt_id) for prompt_id in prompt_ids]
        scores = torch.tensor([self._scores.get(i, math.nan) for i in prompt_ids], dtype=torch.float64)
        lengths = torch.tensor([self._lengths.get(i, math.nan) for i in prompt_ids], dtype=torch.float64)
        return scores, lengths, ~torch.isnan(scores)

    def visits(self, prompt_id: int) -> int:
        return self._visits.get(int(prompt_id), 0)

    def state_dict(self) -> dict:
        ids = sorted(self._scores)
        return {
            "ema_decay": self.ema_decay,
            "prompt_ids": torch.tensor(ids, dtype=torch.int64),
            "scores": torch.tensor([self._scores[i] for i in ids], dtype=torch.float64),
            "mean_response_lengths": torch.tensor([self._lengths.get(i, math.nan) for i in ids], dtype=torch.float64),
            "visits": torch.tensor([self._visits[i] for i in ids], dtype=torch.int64),
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"ema_decay", "prompt_ids", "scores", "mean_response_lengths", "visits"} - set(state)
        if missing:
            raise ValueError(f"prompt history state lacks {sorted(missing)}: it was not written by state_dict()")
        self.ema_decay = float(state["ema_decay"])
        ids = state["prompt_ids"].tolist()
        self._scores = dict(zip(ids, state["scores"].tolist()))
        self._lengths = {i: v for i, v in zip(ids, state["mean_response_lengths"].tolist()) if not math.isnan(v)}
        self._visits = dict(zip(ids, state["visits"].tolist()))

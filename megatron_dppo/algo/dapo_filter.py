"""The DAPO filter: a level any pruner runs behind (--dapo-filter), not a pruner itself.

per step, in the trainer (megatron_dppo/pipeline/experience.py), between the full-batch count and the completion level:
  prompts_to_sample(capacity)                       draw ceil(capacity · oversample_factor) prompts
  rollout, rewards, advantages, full_batch_counts   (algo/pruning.py: the dropped groups are counted there)
  select_groups(rewards, capacity, step) → GroupDecision   varied groups (rewards not all equal); when there are
                                                            V > capacity of them, a uniform random `capacity`,
                                                            each weighted V / capacity
  select_completions(..., prompt_decision.restricted_to(kept, weights), ...)   the pruner's completion level

Invariants:
- a dropped group is zero-variance (advantage exactly 0, no policy-gradient term) or was left out of the cap with
  its weight carried by the kept ones: every varied group's expected weight is 1, so the filter adds no bias;
- the cap's draw is seeded by (seed, step, DAPO_LEVEL) as every pruning draw is (pruning.step_generator).
"""

import math
from dataclasses import dataclass, field

import torch

from megatron_dppo.algo.advantages import check_rewards
from megatron_dppo.algo.pruner_interface import DAPO_LEVEL, step_generator


@dataclass
class DAPOConfig:
    oversample_factor: float = 1.0  # draw ceil(capacity · factor) prompts; train at most `capacity` varied groups
    seed: int = 0

    def __post_init__(self):
        if self.oversample_factor < 1.0:
            raise ValueError(f"dapo oversample_factor is {self.oversample_factor}: it must be >= 1")


@dataclass
class GroupDecision:
    kept: torch.Tensor  # [num_kept] int64 rows of the rewards given to select_groups, ascending
    weights: torch.Tensor  # [num_kept] float64
    stats: dict[str, float] = field(default_factory=dict)


class DAPOFilter:
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal, refill by over-sampling.

    A zero-variance group has advantage exactly 0, so its policy-gradient term is 0 and dropping it changes only
    its KL / entropy terms; the normaliser stays the full batch's (full_batch_counts counts the dropped groups).
    With over-sampling, V varied groups may exceed the `capacity` the step trains: then a uniform random subset of
    `capacity` of them is kept, each with weight V / capacity (its inverse inclusion probability), so the expected
    gradient still covers every varied group and a pruner in front of or behind the filter stays unbiased.
    """

    def __init__(self, config: DAPOConfig):
        self.config = config

    def prompts_to_sample(self, capacity: int) -> int:
        return math.ceil(capacity * self.config.oversample_factor - 1e-9)

    def select_groups(self, rewards: torch.Tensor, capacity: int, step: int) -> GroupDecision:
        check_rewards(rewards)
        varied = (rewards != rewards[:, :1]).any(dim=1).nonzero().squeeze(1)  # [V]
        num_varied = len(varied)
        weights = torch.ones(num_varied, dtype=torch.float64)
        if num_varied > capacity:
            generator = step_generator(self.config.seed, step, DAPO_LEVEL)
            varied = varied[torch.randperm(num_varied, generator=generator)[:capacity]].sort().values
            weights = torch.full((capacity,), num_varied / capacity, dtype=torch.float64)
        stats = {"dapo_kept_groups_fraction": len(varied) / len(rewards) if len(rewards) else 0.0,
                 "dapo_varied_groups": float(num_varied)}
        return GroupDecision(varied, weights, stats)

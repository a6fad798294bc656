"""Group-relative advantages, always computed on the FULL group of G completions, before any pruning.

rewards [num_prompts, G] → advantages [num_prompts, G]:
  grpo     (r - mean) / (std + eps)     DeepSeekMath; std is the unbiased sample std, as TRL and verl use
  dr_grpo  r - mean                     Dr.GRPO drops the std
  rloo     r - mean of the OTHER G-1    leave-one-out baseline, = G/(G-1) · (r - mean)

Invariants: a group whose rewards are all equal has advantage exactly 0 (no rounding residue), and so does a
group of one completion (G = 1 has no baseline). A NaN or infinite reward is an error that names the sample.
"""

import torch

ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def check_rewards(rewards: torch.Tensor) -> None:
    """Raise a clear error unless `rewards` is a finite float [num_prompts, G] tensor."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2 or not rewards.is_floating_point():
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(
            f"rewards must be a float tensor of shape [num_prompts, group_size], got {shape}: "
            "stack each prompt's G rewards into one row"
        )
    reject_rewards(~torch.isfinite(rewards), rewards, "non-finite rewards",
                   "the reward function must return a finite number for every completion")


def reject_rewards(bad: torch.Tensor, rewards: torch.Tensor, what: str, fix: str) -> None:
    """Raise naming the first reward where the mask `bad` [num_prompts, G] holds, how many there are, and the fix."""
    where = bad.nonzero()
    if len(where):
        prompt_index, sample_index = where[0].tolist()
        raise ValueError(
            f"reward of prompt index {prompt_index}, sample index {sample_index} is "
            f"{rewards[prompt_index, sample_index].item()} ({len(where)} {what} in all): {fix}"
        )


def compute_advantages(rewards: torch.Tensor, estimator: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Advantages [num_prompts, G] of `rewards` [num_prompts, G] with one of ESTIMATORS."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}: choose one of {ESTIMATORS}")
    check_rewards(rewards)
    group_size = rewards.shape[1]
    if group_size == 1 or rewards.shape[0] == 0:  # no group to centre (a step whose prompts were all pruned)
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        advantages = centred / (rewards.std(dim=1, keepdim=True) + eps)
    elif estimator == "dr_grpo":
        advantages = centred
    else:
        advantages = centred * (group_size / (group_size - 1))
    constant_group = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return advantages.masked_fill(constant_group, 0.0)

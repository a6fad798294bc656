import pytest
import torch

from megatron_dppo.algo.advantages import ESTIMATORS, compute_advantages


def test_grpo_advantage_is_group_standardised_reward():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [0.2, 0.9, 0.4, 0.4, 0.1]], dtype=torch.float64)
    advantages = compute_advantages(rewards, "grpo", eps=0.0)
    for row, reward in zip(advantages, rewards):
        expected = (reward - reward.mean()) / reward.std()
        torch.testing.assert_close(row, expected)
        torch.testing.assert_close(row.std(), torch.tensor(1.0, dtype=torch.float64))


def test_dr_grpo_drops_the_std_and_rloo_uses_the_mean_of_the_others():
    rewards = torch.tensor([[3.0, 1.0, 0.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(compute_advantages(rewards, "dr_grpo"), rewards - 1.5)
    leave_one_out = torch.tensor([[3.0 - 1.0, 1.0 - 5.0 / 3, 0.0 - 2.0, 2.0 - 4.0 / 3]], dtype=torch.float64)
    torch.testing.assert_close(compute_advantages(rewards, "rloo"), leave_one_out)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_all_equal_rewards_in_a_group_give_exactly_zero_advantage(estimator):
    # 0.1 is not exactly representable: a mean-subtraction residue would survive without the explicit zeroing.
    rewards = torch.tensor([[0.1] * 7, [0.3, 0.1, 0.1, 0.7, 0.1, 0.1, 0.2]], dtype=torch.float32)
    advantages = compute_advantages(rewards, estimator)
    assert torch.equal(advantages[0], torch.zeros(7))
    assert (advantages[1] != 0).all()


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_group_of_one_completion_has_zero_advantage(estimator):
    advantages = compute_advantages(torch.tensor([[1.0], [0.0], [0.5]]), estimator)
    assert torch.equal(advantages, torch.zeros(3, 1))


def test_nan_reward_is_rejected_naming_prompt_and_sample():
    rewards = torch.zeros(3, 4)
    rewards[2, 1] = float("nan")
    with pytest.raises(ValueError, match="prompt index 2, sample index 1"):
        compute_advantages(rewards)


def test_bad_reward_shape_and_unknown_estimator_are_rejected():
    with pytest.raises(ValueError, match="num_prompts, group_size"):
        compute_advantages(torch.zeros(8))
    with pytest.raises(ValueError, match="num_prompts, group_size"):
        compute_advantages(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages(torch.zeros(2, 4), "ppo")

"""The RL clock --time-budget-s counts: wall time without evaluations, or the steps' logged work at
--time-budget-prices (launch/run.py RLClock), which a busy machine cannot stretch; and a resumed run's clock goes on
from its checkpoint."""

import time

import pytest

from megatron_dppo.launch.arguments import parse_args, range_combination_errors
from megatron_dppo.launch.run import RLClock

PRICES = (0.1, 0.003, 4e-5, 1.2e-4)
STEP = {"decode_iterations": 150.0, "tokens_generated": 12000.0, "tokens_trained": 2500.0}
STEP_PRICE = 0.1 + 0.003 * 150 + 4e-5 * 12000 + 1.2e-4 * 2500  # 1.33 s


def test_priced_clock_counts_each_steps_work_at_its_prices_whatever_the_wall_time():
    clock = RLClock(PRICES)
    for step in range(1, 4):
        metrics = dict(STEP)
        time.sleep(0.01)
        clock.add_step(metrics)
        assert metrics["seconds_priced"] == pytest.approx(step * STEP_PRICE)
        assert 0.0 < metrics["seconds_wall"] < 1.0  # the wall clock is logged beside it
    assert clock.seconds() == pytest.approx(3 * STEP_PRICE)


def test_wall_clock_leaves_out_evaluations_and_a_resumed_clock_goes_on_from_the_checkpoint():
    clock = RLClock(None, {"seconds_rl": 5.0})
    time.sleep(0.05)
    clock.add_evaluation(0.04)
    assert 5.0 < clock.seconds() < 5.04
    resumed = RLClock(PRICES, {"seconds_rl": 2 * STEP_PRICE, "seconds_wall": 7.0})
    metrics = dict(STEP)
    resumed.add_step(metrics)
    assert metrics["seconds_priced"] == pytest.approx(3 * STEP_PRICE) and metrics["seconds_wall"] >= 7.0


def test_prices_without_a_budget_are_refused_naming_the_flag():
    args = parse_args(["--time-budget-s", "60", "--time-budget-prices", *map(str, PRICES)])
    assert args.time_budget_prices == list(PRICES) and not range_combination_errors(args)
    args.time_budget_s = None  # a run bounded by --train-iters alone
    assert any("--time-budget-prices prices the steps for --time-budget-s" in error
               for error in range_combination_errors(args))

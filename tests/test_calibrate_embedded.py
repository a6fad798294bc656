"""bench/calibrate_embedded.py's grid and report (no training is run)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "calibrate_embedded.py"
spec = importlib.util.spec_from_file_location("calibrate_embedded", BENCH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_grid_is_the_cartesian_product_and_colons_join_the_words_of_one_value():
    settings = bench.parse_grid(["warm-start-steps=300,600", "warm-start-cells=2x1:3x1,4x1"])
    assert settings == [
        ["--warm-start-steps", "300", "--warm-start-cells", "2x1", "3x1"],
        ["--warm-start-steps", "300", "--warm-start-cells", "4x1"],
        ["--warm-start-steps", "600", "--warm-start-cells", "2x1", "3x1"],
        ["--warm-start-steps", "600", "--warm-start-cells", "4x1"],
    ]
    assert bench.parse_grid([]) == [[]]
    assert len({bench.setting_name(flags) for flags in settings}) == 4
    with pytest.raises(ValueError, match="must read FLAG=V1,V2"):
        bench.parse_grid(["warm-start-steps"])


def test_report_gives_gain_and_rl_minus_control_in_points_and_the_best_margin():
    def result(setting, before, after, control):
        cells = {"2x1": 0.5, "16x1": 0.1}
        return {"row": {"setting": setting, "seconds": 500.0, "warm_s": 150.0, "steps": 80, "before": before,
                        "after": after, "control": control, "control_steps": 1100},
                "cells": {"warm start": cells, "RL": cells, "control": cells}}

    table, best = bench.report([result("a", 0.30, 0.50, 0.40), result("b", 0.30, 0.45, 0.44)], control=True)
    assert "| a | 500 (150) | 80 | 0.300 → 0.500 | +20.0 | 0.400 (1100) | +10.0 |" in table
    assert "| b | 500 (150) | 80 | 0.300 → 0.450 | +15.0 | 0.440 (1100) | +1.0 |" in table
    assert best == pytest.approx(10.0)
    assert "| mean | 0.300 | 0.300 | 0.300 |" in table
    _, none = bench.report([result("a", 0.3, 0.5, 0.4)], control=False)
    assert none is None

"""bench/step_cost.py on synthetic runs (no training is run): its fit recovers the step-cost model the runs follow, and
it prints every named result."""

import json
import random

import pytest

from bench import step_cost


def test_step_cost_recovers_the_cost_model_of_its_runs_and_names_each_result(tmp_path, monkeypatch, capsys):
    def finished_run(flags, run_dir, processes):
        """A run whose steps take 50 ms + 2 ms a decode iteration + 10 µs a generated and 20 µs a trained token."""
        rng = random.Random(run_dir.name)
        records = []
        for step in range(1, 9):
            iterations, generated, trained = rng.randint(20, 180), rng.randint(500, 6000), rng.randint(300, 2000)
            records.append({"step": step, "decode_iterations": iterations, "tokens_generated": generated,
                            "tokens_trained": trained, "seconds_rollout": 0.01, "seconds_update": 0.01,
                            "seconds_sync": 0.001,
                            "seconds_step": 0.05 + 0.002 * iterations + 1e-5 * generated + 2e-5 * trained})
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        return run_dir

    monkeypatch.setattr(step_cost, "launch_unless_finished", finished_run)
    step_cost.main(["--out-dir", str(tmp_path), "--skip-steps", "1"])
    lines = capsys.readouterr().out.splitlines()
    named = dict(line.split(": ") for line in lines if line.startswith(("step_cost_", "partial_rollout_")))
    assert float(named["step_cost_fixed_ms"]) == pytest.approx(50.0, abs=0.01)
    assert float(named["step_cost_per_iteration_ms"]) == pytest.approx(2.0, abs=0.001)
    assert float(named["step_cost_per_generated_token_us"]) == pytest.approx(10.0, abs=0.01)
    assert float(named["step_cost_per_trained_token_us"]) == pytest.approx(20.0, abs=0.01)
    assert set(named) >= {"step_cost_fixed_share_synchronous", "step_cost_fixed_share_partial",
                          "partial_rollout_step_speedup"}


def test_the_headline_only_runs_compare_grpo_synchronous_and_partial_on_the_engine_device(tmp_path, monkeypatch,
                                                                                          capsys):
    launched = []

    def finished_run(flags, run_dir, processes):
        launched.append(flags)
        partial = "--partial-rollout" in flags
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": step, "seconds_step": 0.5 if partial else 1.0, "decode_iterations": 20 if partial else 60})
            + "\n" for step in range(1, 9)))
        return run_dir

    monkeypatch.setattr(step_cost, "launch_unless_finished", finished_run)
    step_cost.main(["--out-dir", str(tmp_path), "--skip-steps", "1", "--headline-only", "--engine-device", "cuda",
                    "--trainer-flags", "--warm-start-steps 20"])
    assert len(launched) == 2 and all(flags[flags.index("--rollout-engine-device") + 1] == "cuda" and
                                      "--warm-start-steps" in flags and "grpo" in flags for flags in launched)
    assert "partial_rollout_step_speedup: 2.000" in capsys.readouterr().out

"""The time-to-accuracy bench (bench/time_to_accuracy.py and the modules it runs and reports with) on synthetic
metric files (no training is run)."""

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench import accuracy_curves, accuracy_runs, results_page, run_costs, training_run
from megatron_dppo.metrics import Run, load_run


def write_run(directory: Path, accuracies: list[float], seconds_step: float, before: float = 0.2,
              eval_every: int = 1, tokens: tuple[int, int] = (100, 150)) -> Path:
    """A finished run: one step per accuracy entry, an evaluation every `eval_every` steps, the last one final."""
    directory.mkdir(parents=True)
    lines = []
    for step, accuracy in enumerate(accuracies[:-1], start=1):
        record = {"step": step, "seconds_step": seconds_step, "seconds_wall": step * seconds_step * 1.1,
                  "seconds_rollout": 0.4 * seconds_step, "seconds_update": 0.5 * seconds_step,
                  "tokens_generated": tokens[0], "tokens_trained": tokens[1], "kept_fraction_prompts": 1.0,
                  "response_length_mean": 5.0, "kept_fraction": 0.5, "reward_mean": accuracy}
        if step % eval_every == 0:
            record["heldout_accuracy"] = accuracy
        lines.append(json.dumps(record))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (directory / "summary.json").write_text(json.dumps({"heldout_accuracy_before": before,
                                                        "heldout_accuracy_after": accuracies[-1],
                                                        "steps": len(accuracies) - 1}))
    return directory


def curve(points):
    return [(float(x), float(y)) for x, y in points]


def test_final_accuracy_is_the_mean_of_the_last_three_evaluations():
    assert accuracy_curves.final_accuracy(curve([(0, 0.1), (1, 0.3), (2, 0.4), (3, 0.5)])) == pytest.approx(0.4)
    assert accuracy_curves.final_accuracy(curve([(0, 0.1), (1, 0.3)])) == pytest.approx(0.2)


# a baseline seed: warm start 0.2, rising to its final accuracy 0.6 (mean of the last three evaluations)
RISING = [(0, 0.2), (10, 0.4), (20, 0.55), (30, 0.6), (40, 0.6), (50, 0.6)]


def test_every_methods_seed_s_run_shares_grpos_pool_order_heldout_set_and_start(tmp_path, monkeypatch):
    from megatron_dppo.launch.arguments import parse_args

    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path)])
    warm_start = tmp_path / "warm_start"
    # the parsed values that decide the pool's content and order, the held-out set and the start
    # (megatron_dppo/launch/run.py build_task, pipeline/tasks.py synthetic_task)
    decisive = ("prompt_data", "synthetic_task", "data_synthetic_cells", "data_train_size", "eval_size", "seed",
                "rl_seed", "load")

    def pairing(method, seed):
        args = parse_args(accuracy_runs.rl_flags(settings, method, seed, warm_start))
        return {name: getattr(args, name) for name in decisive}

    for seed in (1, 2):
        grpo = pairing("grpo", seed)
        assert grpo["rl_seed"] == seed
        for method in accuracy_runs.ALL_METHODS:
            assert pairing(method, seed) == grpo, method
    assert pairing("dppo", 1) != pairing("dppo", 2)
    # the two baselines differ in the DAPO filter alone: grpo-paper's --no-dapo-filter wins over RL_FLAGS'
    paper, filtered = (parse_args(accuracy_runs.rl_flags(settings, name, 1, warm_start)) for name in ("grpo-paper",
                                                                                                     "grpo"))
    assert (paper.dapo_filter, filtered.dapo_filter) == (False, True)
    monkeypatch.setitem(accuracy_runs.ALL_METHODS, "reseeded", ["--algorithm", "dppo", "--rl-seed", "7"])
    with pytest.raises(ValueError, match="would no longer share GRPO's seed-s pool"):
        accuracy_runs.rl_flags(settings, "reseeded", 1, warm_start)


def test_flops_follow_the_documented_formula():
    size = run_costs.ModelSize(parameters=1000, layers=2, hidden=8)
    record = {"tokens_trained": 60, "tokens_generated": 40, "kept_fraction": 0.25, "kept_fraction_prompts": 0.5,
              "response_length_mean": 4.0}
    train, rollout = run_costs.step_flops(record, size, old_logprob_pass=False)
    # 40 tokens / 4 per response = 10 rollouts of the half of the drawn prompts the prompt level kept, so 20
    # drawn x G; a quarter of those kept = 5 sequences of 60 / 5 = 12 tokens
    forward = 2 * 1000 + 4 * 2 * 8 * 12 / 2
    assert train == pytest.approx(60 * 3 * forward)
    assert rollout == pytest.approx(40 * (2 * 1000 + 4 * 2 * 8 * 2))
    train_with_pass, _ = run_costs.step_flops(record, size, old_logprob_pass=True)
    assert train_with_pass == pytest.approx(60 * 4 * forward)


def test_cost_columns_accumulate_over_steps_and_read_at_the_time_to_target(tmp_path):
    run = load_run(write_run(tmp_path / "run", [0.3, 0.35, 0.4, 0.45], seconds_step=2.0))
    costed = run_costs.with_costs(run, run_costs.ModelSize(1000, 2, 8), old_logprob_pass=False)
    assert [r["seconds_steps"] for r in costed.records] == [2.0, 4.0, 6.0]
    assert [r["tokens_generated_total"] for r in costed.records] == [100, 200, 300]
    assert costed.records[-1]["flops_total"] == pytest.approx(3 * costed.records[0]["flops_total"])
    assert run_costs.value_at(costed, "tokens_trained_total", "seconds_steps", 3.0) == 300
    assert run_costs.value_at(costed, "tokens_trained_total", "seconds_steps", 0.0) == 0.0
    assert run_costs.value_at(costed, "tokens_trained_total", "seconds_steps", None) is None
    # the last step was an evaluation step: the trainer's final evaluation stands at its x and is counted once
    assert accuracy_curves.accuracy_points(costed, "seconds_steps") == [(0.0, 0.2), (2.0, 0.3), (4.0, 0.35),
                                                                        (6.0, 0.45)]


def test_phase_breakdown_puts_the_unaccounted_time_in_other():
    records = [{"step": 1, "seconds_step": 1.0, "seconds_rollout": 0.3, "seconds_update": 0.5},
               {"step": 2, "seconds_step": 3.0, "seconds_rollout": 0.7, "seconds_update": 1.5, "seconds_sync": 0.2}]
    phases = run_costs.phase_breakdown([Run("m", records)])
    assert phases["seconds_step"] == pytest.approx(2.0)
    assert phases["seconds_rollout"] == pytest.approx(0.5) and phases["seconds_update"] == pytest.approx(1.0)
    assert phases["other"] == pytest.approx(2.0 - 0.5 - 1.0 - 0.1)


def test_step_cost_fit_recovers_a_linear_cost_model():
    records = [{"tokens_generated": g, "tokens_trained": t, "seconds_step": 0.1 + 0.001 * g + 0.002 * t}
               for g, t in ((100, 50), (200, 80), (150, 200), (300, 10), (50, 120))]
    fit = run_costs.fit_step_cost([Run("a", records[:3]), Run("b", records[3:])])
    assert fit["fixed"] == pytest.approx(0.1) and fit["per_generated"] == pytest.approx(0.001)
    assert fit["per_trained"] == pytest.approx(0.002) and fit["r_squared"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="cannot fit"):
        run_costs.fit_step_cost([Run("a", records[:2])])


def test_write_page_replaces_only_its_own_generated_block(tmp_path):
    page = tmp_path / "results.md"
    results_page.write_page(page, "quick", "first")
    page.write_text(page.read_text() + "\nHand-written analysis.\n")
    results_page.write_page(page, "full", "full tables")
    results_page.write_page(page, "quick", "second")
    text = page.read_text()
    assert "second" in text and "first" not in text and "full tables" in text
    assert "Hand-written analysis." in text
    page.write_text("<!-- BEGIN GENERATED quick by bench/time_to_accuracy.py -->\nno end marker\n")
    with pytest.raises(ValueError, match="restore the end marker"):
        results_page.write_page(page, "quick", "x")


def test_bad_command_line_values_are_rejected_with_the_flag_name(capsys):
    with pytest.raises(SystemExit):
        accuracy_runs.parse_args(["--budget-s", "0"])
    assert "--budget-s 0.0 must be > 0" in capsys.readouterr().err
    settings = accuracy_runs.parse_args(["--quick", "--methods", "cppo"])
    assert settings.methods == ["grpo-paper", "grpo", "dapo-dynamic-sampling", "cppo"]
    assert settings.seeds == [1] and settings.budget_s == 25.0
    full = accuracy_runs.parse_args([])
    assert full.methods == list(accuracy_runs.METHODS) and (full.budget_s, full.eval_interval) == (240.0, 10)
    assert (full.seeds, full.max_seeds, full.secondary_seeds, full.eval_size) == ([1, 2, 3, 4, 5, 6], 12, 3, 512)
    assert accuracy_runs.pool_size() == 2048  # the embedded default's pool: the regime where RL learns


def test_bench_runs_the_worked_task_by_default_and_the_answer_task_by_flag():
    worked, answer = accuracy_runs.parse_args([]), accuracy_runs.parse_args(["--synthetic-task", "answer"])
    assert (worked.task, answer.task) == ("worked", "answer")
    assert worked.warm_start_steps == accuracy_runs.TASK_SETTINGS["worked"]["warm_start_steps"]
    assert worked.out_dir != answer.out_dir  # one warm start per output directory
    assert accuracy_runs.page_block("worked", False) == "full"
    assert accuracy_runs.page_block("answer", True) == "quick-answer"
    for task in ("worked", "answer"):
        flags = accuracy_runs.task_flags(task)
        assert flags[flags.index("--synthetic-task") + 1] == task
        limit = accuracy_runs.TASK_SETTINGS[task]["rollout_max_response_len"]
        assert flags[flags.index("--rollout-max-response-len") + 1] == str(limit)


def test_supervised_control_trains_on_the_warm_starts_data_for_the_rl_budgets_steps(tmp_path, monkeypatch):
    """The control's command differs from the warm start's only in its step count (and its cache): the same task,
    warm-start data flags (problem pool, cells, batch, lr) and seed, so the same problems, then more epochs of them."""
    launched = []

    def record(flags, run_dir, processes):
        launched.append(flags)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps({"seconds": 100.0 if "build" in str(run_dir) else 40.0,
                                                          "heldout_accuracy_before": 0.1}))
        return run_dir

    monkeypatch.setattr(accuracy_runs, "launch_unless_finished", record)
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--warm-start-steps", "120", "--budget-s", "50"])
    (tmp_path / "cache" / "warm" / "embedded_x" / "warm_start").mkdir(parents=True)
    _, steps_per_second = accuracy_runs.prepare_warm_start(settings)
    assert steps_per_second == pytest.approx(120 / 60)
    _, extra_steps = accuracy_runs.run_control(settings, steps_per_second)
    assert extra_steps == 100  # 50 s of RL budget at 2 supervised steps/s
    warm, control = launched[0], launched[-1]

    def without(flags, *names):
        kept, skip = [], False
        for flag in flags:
            if skip:
                skip = False
            elif flag in names:
                skip = True
            else:
                kept.append(flag)
        return kept

    assert warm[warm.index("--warm-start-steps") + 1] == "120"
    assert control[control.index("--warm-start-steps") + 1] == "220"
    assert without(warm, "--warm-start-steps", "--cache-dir") == without(control, "--warm-start-steps", "--cache-dir")
    for flag in ("--warm-start-problems", "--synthetic-task", "--seed"):
        assert flag in control


def write_outcomes(directory: Path, steps: int, per_step: int, pruned: int, zero_every: int) -> None:
    """prompt_outcomes.jsonl: per step, `per_step` groups, every `zero_every`-th zero-variance and predicted so."""
    lines = []
    for step in range(1, steps + 1):
        for index in range(per_step):
            zero = index % zero_every == 0
            lines.append(json.dumps({"step": step, "prompt_id": index, "difficulty": "c", "rewards": [1.0, 1.0]
                                     if zero else [1.0, 0.0], "zero_variance": zero, "keep_prob": 0.5 if zero else 1.0,
                                     "predicted_zero_variance": 0.9 if zero else 0.1, "response_length_mean": 5.0}))
    (directory / "prompt_outcomes.jsonl").write_text("\n".join(lines) + "\n")
    metrics = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    for record in metrics:
        record.update(prompts_drawn=float(per_step + pruned), prompts_pruned=float(pruned),
                      groups_rolled_out=float(per_step),
                      zero_variance_groups_rolled_out=float(len(range(0, per_step, zero_every))))
    (directory / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in metrics) + "\n")


def test_prompt_level_table_counts_epochs_pruned_share_and_prediction_quality(tmp_path):
    run_dir = write_run(tmp_path / "runs" / "dppo" / "seed_1", [0.3] * 11, 1.0)
    write_outcomes(run_dir, steps=10, per_step=4, pruned=4, zero_every=2)
    groups = {"dppo": {1: load_run(run_dir, "dppo")}}
    table = results_page.prompt_level_table(tmp_path / "runs", groups, pool=16)
    row = next(line for line in table.splitlines() if line.startswith("| dppo"))
    # 10 steps x 8 drawn over a pool of 16: 5 epochs drawn, 2.5 rolled out; the first epoch ends at step 2; half the
    # drawn prompts pruned; half the rolled-out groups zero-variance, each predicted right: precision and recall 1
    assert row.startswith("| dppo | 5.0 | 2.5 | 0.50 | 0.50 | 1.00 | 1.00 |")


def test_grpo_tuning_changes_one_setting_at_a_time_from_the_common_flags():
    settings = accuracy_runs.grpo_settings()
    assert settings[0] == ("RL_FLAGS", [])
    for label, extra in settings[1:]:
        flag, value = extra
        assert flag in accuracy_runs.GRPO_GRID and value != accuracy_runs.flag_value(accuracy_runs.RL_FLAGS, flag)
        assert label == f"{flag} {value}"
    assert len(settings) == 1 + sum(len(values) - 1 for values in accuracy_runs.GRPO_GRID.values())


def test_the_benchs_own_task_settings_are_ones_the_trainer_takes():
    from megatron_dppo.launch.arguments import EMBEDDED_TASK_DEFAULTS, parse_args

    for task, settings in accuracy_runs.TASK_SETTINGS.items():
        assert set(settings) == set(EMBEDDED_TASK_DEFAULTS[task])
        args = parse_args([*accuracy_runs.task_flags(task), *accuracy_runs.warm_start_flags(task),
                           "--warm-start-steps", str(settings["warm_start_steps"])])
        assert (args.rollout_max_response_len, args.warm_start_problems) == (settings["rollout_max_response_len"],
                                                                              settings["warm_start_problems"])


def test_a_pause_file_holds_the_benchmark_before_its_next_run_until_it_is_removed(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(training_run, "PAUSE_POLL_S", 0.01)
    pause = tmp_path / "bench" / training_run.PAUSE_FILE
    pause.parent.mkdir()
    pause.touch()
    run_dir = tmp_path / "bench" / "runs" / "grpo" / "seed_1"
    holding = threading.Thread(target=training_run.hold_while_paused, args=(run_dir,))
    holding.start()
    holding.join(0.2)
    assert holding.is_alive()  # held while the file is there
    pause.unlink()
    holding.join(5)
    assert not holding.is_alive()


def test_step_cost_fit_recovers_a_per_iteration_cost_when_runs_log_decode_iterations():
    records = [{"seconds_step": 0.05 + 0.003 * it + 0.0001 * gen + 0.0002 * tr, "decode_iterations": it,
                "tokens_generated": gen, "tokens_trained": tr}
               for it, gen, tr in ((170, 6000, 1400), (80, 5000, 900), (120, 7000, 2000), (60, 3000, 500),
                                   (176, 6500, 300))]
    fit = run_costs.fit_step_cost([Run("a", records)])
    assert fit["fixed"] == pytest.approx(0.05) and fit["per_iteration"] == pytest.approx(0.003)
    assert fit["per_generated"] == pytest.approx(0.0001) and fit["per_trained"] == pytest.approx(0.0002)


def test_a_recorded_run_is_restored_on_a_fresh_checkout_and_refused_from_another_command_or_warm_start(
        tmp_path, monkeypatch):
    """The full benchmark's finished runs are kept in the repository, one folder per command: a later sitting
    elsewhere (other checkout path, other --out-dir) restores a run recorded with the same command from the same warm
    start instead of running it; another command runs and is recorded beside the first; a record from another warm
    start is a clear error; runs at other than the default settings are not recorded."""
    launched = []

    def fake_launch(flags, run_dir, processes):  # a training run: its command, metrics and summary
        launched.append(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)  # as the real launch does
        write_run(run_dir, [0.3, 0.4, 0.5], 1.0, before=0.25)
        (run_dir / "command.txt").write_text(" ".join(training_run.command_for(flags, run_dir, processes)[1:]) + "\n")
        return 1.0

    monkeypatch.setattr(training_run, "launch", fake_launch)
    records = tmp_path / "records"

    def sitting(out_dir: Path, warm_accuracy: float, budget: str = "150", control: bool = False, save: bool = True):
        settings = accuracy_runs.parse_args(["--out-dir", str(out_dir)])
        settings.records_dir, settings.save_records = records, save
        (out_dir / "warm_start" / "build").mkdir(parents=True, exist_ok=True)
        (out_dir / "warm_start" / "build" / "summary.json").write_text(
            json.dumps({"heldout_accuracy_before": warm_accuracy}))
        if control:  # a warm start of its own: its accuracy at the start is its own, not the shared warm start's
            return accuracy_runs.launch_recorded(settings, ["--warm-start-steps", budget],
                                                 out_dir / "runs" / accuracy_runs.CONTROL / "seed_1",
                                                 from_warm_start=False)
        warm_start = out_dir / "cache" / "warm" / "x"
        flags = [*accuracy_runs.rl_flags(settings, "grpo", 1, warm_start), "--budget-marker", budget]
        return accuracy_runs.launch_recorded(settings, flags, out_dir / "runs" / "grpo" / "seed_1")

    def recorded() -> list[Path]:
        return sorted(records.glob("runs/grpo/seed_1/*/metrics.jsonl.gz"))

    first = sitting(tmp_path / "first", 0.25)
    assert launched == [first] and len(recorded()) == 1
    assert str(tmp_path) not in (recorded()[0].parent / "command.txt").read_text()  # portable

    second = sitting(tmp_path / "second", 0.25)  # a fresh machine: restored, not run
    assert launched == [first]
    assert (second / "metrics.jsonl").read_text() == (first / "metrics.jsonl").read_text()
    assert training_run.finished(second)

    third = sitting(tmp_path / "third", 0.25, budget="99")  # another command: run, recorded beside the first
    assert launched == [first, third] and len(recorded()) == 2
    assert training_run.finished(sitting(tmp_path / "third_again", 0.25, budget="99"))  # then restored
    assert training_run.finished(sitting(tmp_path / "first_again", 0.25))  # and the first still is
    assert launched == [first, third]
    unsaved = sitting(tmp_path / "sixth", 0.25, budget="7", save=False)  # not the default settings: not recorded
    assert launched == [first, third, unsaved] and len(recorded()) == 2
    with pytest.raises(RuntimeError, match="another warm start"):
        sitting(tmp_path / "fourth", 0.31)
    control = sitting(tmp_path / "first", 0.25, control=True)
    assert launched == [first, third, unsaved, control]
    assert training_run.finished(sitting(tmp_path / "fifth", 0.31, control=True))  # restored from the records
    assert launched == [first, third, unsaved, control]




def test_a_pause_file_per_holder_holds_the_benchmark_until_the_last_is_removed(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(training_run, "PAUSE_POLL_S", 0.01)
    (tmp_path / "bench").mkdir()
    holders = [tmp_path / "bench" / f"{training_run.PAUSE_FILE}.{name}" for name in ("tests", "docs")]
    for pause in holders:
        pause.touch()
    holding = threading.Thread(target=training_run.hold_while_paused, args=(tmp_path / "bench" / "runs" / "x",))
    holding.start()
    holders[0].unlink()
    holding.join(0.2)
    assert holding.is_alive()  # one holder left
    holders[1].unlink()
    holding.join(5)
    assert not holding.is_alive()


def test_the_machines_load_beside_a_run_counts_other_processes_not_the_runs_own():
    import subprocess
    import sys

    busy, own = training_run.machine_busy_seconds(), training_run.children_cpu_seconds()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    child = training_run.children_cpu_seconds() - own
    assert child > 0.05  # the child's CPU time is the bench's own
    if busy is not None:  # Linux: the machine was busy at least as long as the child ran
        assert training_run.machine_busy_seconds() - busy >= 0.5 * child


# ------------------------------------------------------------------------------------------------ the estimator
# a baseline seed: warm start 0.2, rising to its final accuracy 0.6 (mean of the last three evaluations)
RISING = [(0, 0.2), (10, 0.4), (20, 0.55), (30, 0.6), (40, 0.6), (50, 0.6)]


def test_the_centred_mean_leaves_a_steady_rise_where_it_is_where_a_trailing_mean_lags():
    steady = curve([(0, 0.2), (10, 0.3), (20, 0.4), (30, 0.5), (40, 0.6)])
    assert [y for _, y in accuracy_curves.centred(steady)] == pytest.approx([y for _, y in steady])
    spike = curve([(0, 0.2), (10, 0.2), (20, 0.5), (30, 0.2), (40, 0.2)])
    # a single lucky evaluation is shared with its neighbours; the warm start and the last point stay as measured
    assert [y for _, y in accuracy_curves.centred(spike)] == pytest.approx([0.2, 0.3, 0.3, 0.3, 0.2])


def test_seed_mean_curve_averages_seeds_on_a_common_grid_up_to_the_shortest_seed():
    fast = curve([(0, 0.2), (10, 0.4), (20, 0.6)])  # a steady rise: the centred mean keeps it
    slow = curve([(0, 0.2), (20, 0.4), (40, 0.6)])
    mean = accuracy_curves.seed_mean_curve([fast, slow], grid_points=5)
    # grid 0, 5, 10, 15, 20 (the shorter seed's end): fast 0.2 .. 0.6, slow 0.2 .. 0.4
    assert [x for x, _ in mean] == pytest.approx([0, 5, 10, 15, 20])
    assert [y for _, y in mean] == pytest.approx([0.2, 0.275, 0.35, 0.425, 0.5])


def test_targets_lie_on_the_rising_part_of_both_curves_and_swapping_the_methods_inverts_the_speedup():
    baseline = [curve(RISING)]
    lower = [curve([(x / 2, 0.2 + 0.75 * (y - 0.2)) for x, y in RISING])]  # twice as fast, to a lower plateau 0.5
    targets = accuracy_curves.comparison_targets(baseline, lower)
    # the lower final (0.5) sets the gain 0.3: 0.35 / 0.425 / 0.47; the paper's target is the baseline's own 0.6
    assert targets == pytest.approx({0.5: 0.35, 0.75: 0.425, 0.9: 0.47, 1.0: 0.6})
    forward, backward = accuracy_curves.speedups(baseline, lower), accuracy_curves.speedups(lower, baseline)
    assert forward["reached_all"] and backward["reached_all"]
    assert forward["headline"] * backward["headline"] == pytest.approx(1.0)
    falling = [curve([(0, 0.2), (10, 0.15), (20, 0.18), (30, 0.18), (40, 0.18)])]
    assert accuracy_curves.comparison_targets(baseline, falling) is None  # no gain on one side: nothing to time


def test_headline_is_the_geometric_mean_of_the_speedups_to_the_three_targets():
    baseline = [curve(RISING)]
    method = [curve([(0, 0.2), (5, 0.4), (10, 0.55), (15, 0.6), (100, 0.6), (120, 0.6)])]  # fast early
    result = accuracy_curves.speedups(baseline, method)
    expected = (result["speedups"][0.5] * result["speedups"][0.75] * result["speedups"][0.9]) ** (1 / 3)
    assert result["headline"] == pytest.approx(expected)
    assert result["paper"] == pytest.approx(result["speedups"][1.0])
    for fraction, target in result["targets"].items():
        base_time = accuracy_curves.crossing_time(accuracy_curves.seed_mean_curve(baseline), target)
        assert result["speedups"][fraction] == pytest.approx(base_time / result["times"][fraction][0])
    halved = [curve([(x / 2, y) for x, y in RISING])]  # the same curve at half the time: 2x to every target
    assert accuracy_curves.speedups(baseline, halved)["speedups"] == pytest.approx(dict.fromkeys((0.5, 0.75, 0.9, 1.0),
                                                                                                2.0))


def test_a_target_the_method_never_reaches_counts_its_end():
    stuck = [curve([(0, 0.2), (10, 0.45), (20, 0.45), (30, 0.45), (40, 0.45)])]
    result = accuracy_curves.speedups([curve(RISING)], stuck)
    # the paper's target (the baseline's final 0.6) is never reached: the end, 40 s, stands in and is marked
    assert result["times"][1.0] == (40.0, False) and not result["reached_paper"]
    assert result["reached_all"]  # the headline targets lie below the lower plateau, 0.45


def test_the_paired_comparison_drops_a_seeds_two_runs_together_in_its_jackknife():
    with pytest.raises(ValueError, match="no seed in common"):
        accuracy_curves.compare_paired({1: curve(RISING)}, {2: curve(RISING)})
    scale = {seed: 1 + 0.5 * seed for seed in range(1, 6)}  # a seed stretches both of its runs alike
    baseline = {seed: curve([(x * k, y) for x, y in RISING]) for seed, k in scale.items()}
    method = {seed: curve([(x * k / 2, y) for x, y in RISING]) for seed, k in scale.items()}
    paired = accuracy_curves.compare_paired(baseline, method)
    assert paired["estimate"]["headline"] == pytest.approx(2.0)
    assert paired["headline_interval"] == pytest.approx((2.0, 2.0))  # every leave-one-out estimate is 2
    unpaired = accuracy_curves.compare_paired(baseline, {seed: method[seed % 5 + 1] for seed in method})
    low, high = unpaired["headline_interval"]
    assert low < 2.0 < high and high - low > 0.2
    two_seeds = accuracy_curves.compare_paired({1: baseline[1], 2: baseline[2]}, {1: method[1], 2: method[2]})
    assert two_seeds["headline_interval"] is None  # no interval from fewer than 3 seeds


def test_t_quantiles_and_the_jackknife_interval():
    # Student's t at 0.975 (tables): 3.182 (3 degrees of freedom), 2.776 (4), 2.571 (5), 2.201 (11)
    for dof, exact in ((3, 3.1824), (4, 2.7764), (5, 2.5706), (11, 2.2010)):
        assert accuracy_curves.t_quantile(0.975, dof) == pytest.approx(exact, abs=5e-3)
    low, high = accuracy_curves.jackknife_interval(2.0, [1.8, 2.0, 2.2, 2.0])
    logs = [math.log(v) for v in (1.8, 2.0, 2.2, 2.0)]
    mean = sum(logs) / 4
    half = accuracy_curves.t_quantile(0.975, 3) * math.sqrt(3 / 4 * sum((v - mean) ** 2 for v in logs))
    assert (low, high) == pytest.approx((2.0 * math.exp(-half), 2.0 * math.exp(half)))


def test_the_estimator_reads_a_known_speedup_on_simulated_benches_and_its_interval_covers_it():
    from bench import estimator_check

    rows = estimator_check.calibration([1.0, 2.0], seeds=6, datasets=60)
    for row in rows:
        assert row["median"] == pytest.approx(row["ratio"], rel=0.08), row
        assert row["coverage"] >= 0.85, row
    assert "| 2.00 |" in estimator_check.calibration_table(rows, 6)


def test_cost_model_time_prices_every_step_by_one_fit_of_its_logged_work():
    records = [{"seconds_step": 0.1 + 0.05 * rounds + 0.002 * it + 0.0001 * gen + 0.0003 * tr, "dapo_rounds": rounds,
                "decode_iterations": it, "tokens_generated": gen, "tokens_trained": tr}
               for rounds, it, gen, tr in ((1, 170, 6000, 1400), (2, 80, 5000, 900), (1, 120, 7000, 2000),
                                           (3, 60, 3000, 500), (1, 176, 6500, 300), (2, 90, 4000, 800))]
    fit = run_costs.fit_step_cost([Run("a", records)])
    assert (fit["fixed"], fit["per_round"], fit["per_iteration"]) == pytest.approx((0.1, 0.05, 0.002))
    slow = [{**r, "seconds_step": 2 * r["seconds_step"]} for r in records]  # the same work on a busy machine
    priced = run_costs.with_cost_model(Run("slow", slow), fit)
    assert [r["cost_model_seconds"] for r in priced.records] == pytest.approx(
        list(itertools.accumulate(r["seconds_step"] for r in records)))


def test_runs_are_interleaved_in_a_seeded_order_and_the_other_methods_run_with_the_first_seeds(tmp_path):
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path)])
    orders = {seed: accuracy_runs.run_order(settings, seed) for seed in settings.seeds}
    headline = set(accuracy_runs.BASELINES) | set(accuracy_runs.HEADLINE_METHODS)
    for seed, order in orders.items():
        assert set(order) == headline and len(order) == len(headline)
        assert order == accuracy_runs.run_order(settings, seed)  # the same order when a sitting resumes
        others = accuracy_runs.run_order(settings, seed, secondary=True)
        assert set(others) == (set(accuracy_runs.SECONDARY_METHODS) if seed <= 3 else set())
    assert len({tuple(order) for order in orders.values()}) > 1  # not one fixed order


def synthetic_groups(step_seconds: dict[str, float], seeds=(1, 2, 3)) -> dict[str, dict[int, Run]]:
    """Runs that learn alike step by step (accuracy by step), each method at its own seconds per step, the seeds'
    curves a little apart; with the cost columns the report reads."""
    groups = {}
    for method, seconds in step_seconds.items():
        groups[method] = {}
        for seed in seeds:
            records = []
            for step in range(1, 61):
                record = {"step": step, "seconds_step": seconds, "tokens_generated": 100, "tokens_trained": 50,
                          "decode_iterations": 10, "groups_rolled_out": 8, "zero_variance_groups_rolled_out": 4}
                if step % 4 == 0:
                    record["heldout_accuracy"] = 0.2 + (0.3 + 0.01 * seed) * (1 - math.exp(-step / 15))
                records.append(record)
            run = run_costs.with_costs(Run(method, records, {"heldout_accuracy_before": 0.2}),
                                       run_costs.ModelSize(1000, 2, 8), False)
            groups[method][seed] = run_costs.with_cost_model(run, {"fixed": seconds, "per_round": 0.0,
                                                                   "per_iteration": 0.0, "per_generated": 0.0,
                                                                   "per_trained": 0.0})
    return groups


def test_grpo_against_grpo_paper_reads_their_step_time_ratio_and_the_last_lines_name_every_baseline():
    groups = synthetic_groups({"grpo-paper": 1.2, "grpo": 1.0, "dapo-dynamic-sampling": 1.5, "dppo": 0.5})
    comparisons = results_page.compare_all(groups)
    lines = results_page.last_lines(comparisons, groups)
    assert lines[:6] == ["dppo_speedup_vs_grpo: 2.40 [2.40, 2.40]",
                         "dppo_speedup_vs_grpo_cost_model: 2.40 [2.40, 2.40]",
                         "dppo_speedup_vs_grpo_filtered: 2.00 [2.00, 2.00]",
                         "dppo_speedup_vs_grpo_filtered_cost_model: 2.00 [2.00, 2.00]",
                         "dppo_speedup_vs_grpo_dynamic_sampling: 3.00 [3.00, 3.00]",
                         "dppo_speedup_vs_grpo_dynamic_sampling_cost_model: 3.00 [3.00, 3.00]"]
    assert lines[-2:] == ["grpo_filter_check: 1.20 [1.20, 1.20], step-time ratio 1.20",
                          "grpo_filter_check_cost_model: 1.20 [1.20, 1.20], step-time ratio 1.20"]
    assert results_page.decided(comparisons)
    del groups["dppo"][3]
    del groups["dppo"][2]
    assert not results_page.decided(results_page.compare_all(groups))  # one seed: no interval, not decided


def test_the_report_reads_every_method_against_every_baseline_and_ends_with_the_last_lines(tmp_path, monkeypatch):
    import time

    model_dir = tmp_path / "cache" / "init" / "embedded_x" / "init"
    model_dir.mkdir(parents=True)
    save_file({"embed": torch.zeros(10, 8), "layer": torch.zeros(8, 8)}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8}))
    monkeypatch.setattr(results_page, "CALIBRATION_DATASETS", 10)
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--methods", "dppo", "--seeds", "1", "2", "3",
                                         "--no-control"])
    accuracies = [0.25, 0.3, 0.35, 0.4, 0.42, 0.42, 0.42, 0.42]
    for seed in (1, 2, 3):
        for method, seconds_step in (("grpo-paper", 1.2), ("grpo", 1.0), ("dapo-dynamic-sampling", 1.5),
                                     ("dppo", 0.5)):
            run_dir = write_run(tmp_path / "runs" / method / f"seed_{seed}", [a + 0.01 * seed for a in accuracies],
                                seconds_step)
            write_outcomes(run_dir, steps=7, per_step=4, pruned=0, zero_every=2)
            (run_dir / training_run.MACHINE_FILE).write_text(json.dumps({"other_cores_busy": 0.1 * seed}))
    report, last_lines = results_page.results_report(settings, 4.0, None, None, time.perf_counter())
    for baseline in accuracy_runs.BASELINES:
        assert f"### Time to accuracy against {baseline} (" in report
    assert "### The estimator where the answer is known" in report and "| 1.50 |" in report
    assert "0.20 (max 0.30)" in report  # the machine's load beside every method's runs
    lines = last_lines.splitlines()
    assert lines[0].startswith("dppo_speedup_vs_grpo: 2.40 [") and lines[4].startswith(
        "dppo_speedup_vs_grpo_dynamic_sampling: 3.00 [")
    assert lines[-2] == "grpo_filter_check: 1.20 [1.20, 1.20], step-time ratio 1.20"
    assert report.endswith("\n".join(f"    {line}" for line in lines))
    (tmp_path / "runs" / "grpo-paper").rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"no finished run of the baseline\(s\) \['grpo-paper'\]"):
        results_page.results_report(settings, 4.0, None, None, time.perf_counter())


def test_main_runs_every_seed_then_adds_seeds_until_the_headline_decides(tmp_path, monkeypatch, capsys):
    """Seed by seed, the methods of a seed in its own order; then one more seed at a time while the headline
    intervals are wider than 0.5, up to --max-seeds; the report is made after every run."""
    from bench import time_to_accuracy

    events, decisions = [], iter([False, True])

    def fake_launch(flags, run_dir, processes):  # a finished run: the warm start builds in 100 s, loads in 40 s
        events.append(str(run_dir.relative_to(tmp_path)))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "command.txt").write_text(" ".join(training_run.command_for(flags, run_dir, processes)[1:]) + "\n")
        (run_dir / "summary.json").write_text(json.dumps({"seconds": 40.0 if run_dir.name == "cached" else 100.0}))
        return 1.0

    def fake_report(settings, sft_steps_per_second, control, math_model, started):
        events.append("report")
        return "the report", "dppo_speedup_vs_grpo: nan"

    monkeypatch.setattr(training_run, "launch", fake_launch)
    monkeypatch.setattr(time_to_accuracy, "results_report", fake_report)
    monkeypatch.setattr(time_to_accuracy, "headline_decided", lambda settings: next(decisions))
    (tmp_path / "cache" / "warm" / "embedded_x" / "warm_start").mkdir(parents=True)
    time_to_accuracy.main(["--out-dir", str(tmp_path), "--methods", "dppo", "cppo", "--seeds", "1", "2", "--budget-s",
                           "30", "--no-control"])
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--methods", "dppo", "cppo"])
    expected = ["warm_start/build", "warm_start/cached"]
    for seed in (1, 2, 3):  # seed 3 added once (not decided), then decided
        expected += [f"runs/{method}/seed_{seed}" for method in accuracy_runs.run_order(settings, seed)]
    expected += [f"runs/cppo/seed_{seed}" for seed in (1, 2, 3)]  # the other methods last, with the first 3 seeds
    assert events == [*expected, "report"]
    assert "adding seed 3" in capsys.readouterr().out

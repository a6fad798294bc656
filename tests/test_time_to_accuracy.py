"""The time-to-accuracy bench (bench/time_to_accuracy.py and the modules it runs and reports with) on synthetic
metric files (no training is run)."""

import json
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


def test_crossing_needs_the_trailing_mean_not_one_lucky_evaluation():
    points = curve([(0, 0.2), (10, 0.5), (20, 0.3), (30, 0.35), (40, 0.46), (50, 0.47)])
    # trailing means of 3: 0.2, 0.35 (the spike at 10 s with the start), 0.333, 0.383, 0.37, 0.4267: the spike does
    # not reach 0.4; the trailing mean crosses it between 40 s (0.37) and 50 s (0.4267)
    assert accuracy_curves.crossing_time(points, 0.4) == pytest.approx(40 + 10 * (0.4 - 0.37) / (1.28 / 3 - 0.37))
    assert accuracy_curves.crossing_time(points, 0.2) == 0.0
    assert accuracy_curves.crossing_time(points, 0.9) is None


# a baseline seed: warm start 0.2, rising to its final accuracy 0.6 (mean of the last three evaluations)
RISING = [(0, 0.2), (10, 0.4), (20, 0.55), (30, 0.6), (40, 0.6), (50, 0.6)]


def test_targets_lie_at_50_75_and_90_percent_of_the_baselines_gain_over_the_warm_start():
    targets = accuracy_curves.target_accuracies(curve(RISING))
    # gain 0.6 - 0.2 = 0.4: targets 0.2 + 0.2, 0.2 + 0.3, 0.2 + 0.36, and the final accuracy (the paper's target)
    assert targets == pytest.approx({0.5: 0.4, 0.75: 0.5, 0.9: 0.56, 1.0: 0.6})
    falling = curve([(0, 0.5), (10, 0.4), (20, 0.45), (30, 0.45)])
    assert accuracy_curves.target_accuracies(falling) is None  # no gain: no rising part to time
    assert accuracy_curves.speedups(falling, falling) is None


def test_headline_is_the_geometric_mean_of_the_speedups_to_the_three_targets():
    baseline = curve(RISING)
    method = curve([(0, 0.2), (5, 0.4), (10, 0.55), (15, 0.6), (100, 0.6), (120, 0.6)])  # fast early, slow late
    result = accuracy_curves.speedups(baseline, method)
    ratios = {fraction: accuracy_curves.crossing_time(baseline, target) / accuracy_curves.crossing_time(method, target)
              for fraction, target in result["targets"].items()}
    assert result["speedups"] == pytest.approx(ratios)
    # twice as fast to 50% and 75% (the same rise at half the time), slower to 90% (its trailing mean waits for the
    # evaluation at 100 s): 2, 2, (30 + 10 x 0.65) / (15 + 85 x 0.65)
    assert (ratios[0.5], ratios[0.75], ratios[0.9]) == pytest.approx((2.0, 2.0, 36.5 / 70.25))
    expected = (ratios[0.5] * ratios[0.75] * ratios[0.9]) ** (1 / 3)
    assert result["headline"] == pytest.approx(expected)
    assert result["headline"] != pytest.approx((ratios[0.5] + ratios[0.75] + ratios[0.9]) / 3)
    assert result["paper"] == pytest.approx(ratios[1.0])
    assert result["reached_all"] and result["reached_paper"]
    # the same curve at half the time: twice as fast to every target
    halved = curve([(x / 2, y) for x, y in RISING])
    assert accuracy_curves.speedups(baseline, halved)["headline"] == pytest.approx(2.0)


def test_a_target_the_method_never_reaches_counts_its_budget():
    stuck = curve([(0, 0.2), (10, 0.45), (20, 0.45), (30, 0.45), (40, 0.45)])  # plateau below the 75% target 0.5
    result = accuracy_curves.speedups(curve(RISING), stuck)
    assert result["times"][0.75] == (40.0, False) and result["times"][0.9] == (40.0, False)
    assert result["times"][0.5][1] and not result["reached_all"] and not result["reached_paper"]
    base_time = accuracy_curves.crossing_time(curve(RISING), 0.56)
    assert result["speedups"][0.9] == pytest.approx(base_time / 40.0)  # an upper bound: the budget stood in


def test_the_comparison_is_paired_over_the_seeds_both_ran():
    with pytest.raises(ValueError, match="no seed in common"):
        accuracy_curves.compare_paired({1: curve(RISING)}, {2: curve(RISING)})
    result = accuracy_curves.compare_paired({1: curve(RISING), 2: curve(RISING), 3: curve(RISING)},
                                            {2: curve(RISING), 3: curve(RISING)}, resamples=50)
    assert result["seeds"] == [2, 3] and result["estimate"]["headline"] == pytest.approx(1.0)


def test_paired_seeds_give_a_narrower_interval_than_the_same_runs_unpaired():
    """Each seed stretches the time axis of both its runs alike (a slower pool, say): paired, the stretch cancels in
    every resample's ratio; with the method's seeds shifted by one (the same runs, pairs broken), it does not."""
    scale = {seed: 1 + 0.5 * seed for seed in range(1, 6)}
    baseline = {seed: curve([(x * k, y) for x, y in RISING]) for seed, k in scale.items()}
    method = {seed: curve([(x * k / 2, y) for x, y in RISING]) for seed, k in scale.items()}
    unpaired = {seed: method[seed % 5 + 1] for seed in method}
    paired_result = accuracy_curves.compare_paired(baseline, method, resamples=400)
    unpaired_result = accuracy_curves.compare_paired(baseline, unpaired, resamples=400)
    assert paired_result["estimate"]["headline"] == pytest.approx(2.0)
    assert unpaired_result["estimate"]["headline"] == pytest.approx(2.0)  # the same seed-mean curves
    low, high = paired_result["headline_interval"]
    assert (low, high) == pytest.approx((2.0, 2.0))
    unpaired_low, unpaired_high = unpaired_result["headline_interval"]
    assert unpaired_high - unpaired_low > 0.3 and unpaired_low < 2.0 < unpaired_high
    assert paired_result["usable"] == 1.0 and paired_result["reached_all"] == 1.0


def test_the_last_lines_give_dppo_against_both_baselines_then_the_papers_definition():
    baseline = {seed: curve(RISING) for seed in (1, 2)}
    faster = {seed: curve([(x / 2, y) for x, y in RISING]) for seed in (1, 2)}
    comparisons = {name: {name: accuracy_curves.compare_paired(baseline, baseline, resamples=50),
                          "dppo": accuracy_curves.compare_paired(baseline, faster, resamples=50)}
                   for name in accuracy_runs.BASELINES}
    assert results_page.last_lines(comparisons) == [
        "dppo_speedup_vs_grpo: 2.00 [2.00, 2.00]", "dppo_speedup_vs_grpo_filtered: 2.00 [2.00, 2.00]",
        "dppo_speedup_vs_grpo_paper_definition: 2.00 [2.00, 2.00]",
        "dppo_speedup_vs_grpo_filtered_paper_definition: 2.00 [2.00, 2.00]"]
    del comparisons["grpo"]["dppo"]
    assert results_page.last_lines(comparisons)[1] == "dppo_speedup_vs_grpo_filtered: nan"


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
    assert accuracy_curves.accuracy_points(costed, "seconds_steps") == [(0.0, 0.2), (2.0, 0.3), (4.0, 0.35),
                                                                        (6.0, 0.4), (6.0, 0.45)]


def test_phase_breakdown_puts_the_unaccounted_time_in_other():
    records = [{"step": 1, "seconds_step": 1.0, "seconds_rollout": 0.3, "seconds_update": 0.5},
               {"step": 2, "seconds_step": 3.0, "seconds_rollout": 0.7, "seconds_update": 1.5, "seconds_sync": 0.2}]
    phases = run_costs.phase_breakdown([Run("m", records)])
    assert phases["seconds_step"] == pytest.approx(2.0)
    assert phases["seconds_rollout"] == pytest.approx(0.5) and phases["seconds_update"] == pytest.approx(1.0)
    assert phases["other"] == pytest.approx(2.0 - 0.5 - 1.0 - 0.1)


def test_tables_from_metric_files_on_disk(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file({"embed": torch.zeros(10, 8), "layer": torch.zeros(8, 8)}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8}))
    size = run_costs.model_size(model_dir)
    assert (size.parameters, size.layers, size.hidden) == (144, 2, 8)
    for seed in (1, 2):
        write_run(tmp_path / "runs" / "grpo" / f"seed_{seed}", [0.25, 0.3, 0.35, 0.4, 0.4, 0.4], 1.0)
        write_run(tmp_path / "runs" / "dppo-proportional" / f"seed_{seed}", [0.4, 0.4, 0.42, 0.42], 0.5,
                  tokens=(100, 60))
        write_run(tmp_path / "runs" / "stuck" / f"seed_{seed}", [0.25, 0.3, 0.3, 0.3, 0.3], 1.0)
    groups = run_costs.load_groups(tmp_path / "runs", dict.fromkeys(["grpo", "dppo-proportional", "stuck", "cppo"],
                                                                    [1, 2, 3]), size)
    assert sorted(groups) == ["dppo-proportional", "grpo", "stuck"] and sorted(groups["grpo"]) == [1, 2]
    curves = {method: {seed: accuracy_curves.accuracy_points(run, "seconds_steps") for seed, run in by_seed.items()}
              for method, by_seed in groups.items()}
    comparisons = {method: accuracy_curves.compare_paired(curves["grpo"], points, resamples=50)
                   for method, points in curves.items()}
    # GRPO: warm start 0.2, final 0.4, so targets 0.3 / 0.35 / 0.38 and 0.4; its trailing mean of 3 evaluations
    # (0.2, 0.225, 0.25, 0.3, 0.35, 0.383, 0.4 at 0, 1, ..., 5, 5 s) reaches 0.3 at 3 s, 0.35 at 4 s, 0.38 at 4.9 s,
    # 0.4 at the final evaluation (5 s). DPPO's (0.2, 0.3, 1/3, 1.22/3 at 0, 0.5, 1, 1.5 s) crosses 0.3 at 0.5 s and
    # the others between 1 and 1.5 s
    def dppo_time(target):
        return 1 + 0.5 * (target - 1 / 3) / (1.22 / 3 - 1 / 3)

    estimate = comparisons["dppo-proportional"]["estimate"]
    assert estimate["targets"] == pytest.approx({0.5: 0.3, 0.75: 0.35, 0.9: 0.38, 1.0: 0.4})
    assert {f: t for f, (t, _) in estimate["times"].items()} == pytest.approx(
        {0.5: 0.5, 0.75: dppo_time(0.35), 0.9: dppo_time(0.38), 1.0: dppo_time(0.4)})
    section = results_page.speedup_section("grpo", groups, curves["grpo"], comparisons)
    assert "0.300 / 0.350 / 0.380" in section and "after 4.9 s of RL and 4 evaluations" in section
    headline = (3 / 0.5 * 4 / dppo_time(0.35) * 4.9 / dppo_time(0.38)) ** (1 / 3)
    dppo_row = next(line for line in section.splitlines() if line.startswith("| dppo-proportional | 2 |"))
    assert f"**{headline:.2f}x** [{headline:.2f}, {headline:.2f}]" in dppo_row  # identical seeds
    paper = 5 / dppo_time(0.4)  # the paper's definition: to GRPO's final accuracy
    assert f"**{paper:.2f}x** [{paper:.2f}, {paper:.2f}]" in dppo_row
    # the per-target rows: RL time, speed-up, tokens generated by then (100 per 0.5 s step; 3 steps by 1.32 s)
    assert f"| dppo-proportional | 90% (0.380) | 1.3 | {4.9 / dppo_time(0.38):.2f}x | 300 |" in section
    # stuck reaches the 50% target (its trailing mean is 0.3 at 4 s) and never the others: the budget stands in,
    # marked, and the page says what the marker means
    assert "| stuck | 50% (0.300) | 4.0 | 0.75x |" in section
    assert "| stuck | 75% (0.350) | 4.0† | 1.00x |" in section
    stuck_row = next(line for line in section.splitlines() if line.startswith("| stuck | 2 |"))
    assert "x**†" in stuck_row and "0% of draws reach" in stuck_row
    assert "† never reached within the budget" in section
    assert "| ms/step |" in results_page.phase_table({m: list(r.values()) for m, r in groups.items()})
    # the speed-up to the 90% target splits into fewer steps (GRPO 5 steps by 4.9 s, DPPO 3 by 1.35 s) x shorter
    # steps
    times = {"grpo": 4.9, "dppo-proportional": 1.35, "stuck": None}
    parts = run_costs.speedup_decomposition(groups, times, "grpo")
    assert parts["dppo-proportional"]["steps"] == 3 and parts["stuck"]["steps"] is None
    assert parts["dppo-proportional"]["step_ratio"] == pytest.approx(5 / 3)
    assert parts["dppo-proportional"]["step_ratio"] * parts["dppo-proportional"]["step_time_ratio"] == \
        pytest.approx(4.9 / 1.35)
    assert "| dppo-proportional | 3 | 1.67x" in results_page.decomposition_table(groups, times, "grpo")
    assert "about" in results_page.projection(groups, times, "grpo", "dppo-proportional")
    assert "did not reach grpo's 90% target" in results_page.projection(groups, times, "grpo", "stuck")


def test_the_report_reads_every_method_against_both_baselines_and_ends_with_the_last_lines(tmp_path):
    import time

    model_dir = tmp_path / "cache" / "init" / "embedded_x" / "init"
    model_dir.mkdir(parents=True)
    save_file({"embed": torch.zeros(10, 8), "layer": torch.zeros(8, 8)}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8}))
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--methods", "dppo", "--seeds", "1", "2",
                                         "--no-control"])
    for seed in (1, 2):
        # grpo-paper: the same curve as grpo's at 1.2 s a step (it trains every group), dppo at 0.5 s a step
        for method, accuracies, seconds_step in (("grpo-paper", [0.25, 0.3, 0.35, 0.4, 0.4, 0.4], 1.2),
                                                 ("grpo", [0.25, 0.3, 0.35, 0.4, 0.4, 0.4], 1.0),
                                                 ("dppo", [0.25, 0.3, 0.35, 0.4, 0.4, 0.4], 0.5)):
            run_dir = write_run(tmp_path / "runs" / method / f"seed_{seed}", accuracies, seconds_step)
            write_outcomes(run_dir, steps=5, per_step=4, pruned=0, zero_every=2)
    report, last_lines = results_page.results_report(settings, 4.0, None, None, time.perf_counter())
    assert "### Time to accuracy against grpo-paper" in report and "### Time to accuracy against grpo (" in report
    # the same curve at 0.5 s a step: 2.4x grpo-paper's time and 2x grpo's, to every target
    assert last_lines.splitlines() == [
        "dppo_speedup_vs_grpo: 2.40 [2.40, 2.40]", "dppo_speedup_vs_grpo_filtered: 2.00 [2.00, 2.00]",
        "dppo_speedup_vs_grpo_paper_definition: 2.40 [2.40, 2.40]",
        "dppo_speedup_vs_grpo_filtered_paper_definition: 2.00 [2.00, 2.00]"]
    assert report.endswith("\n".join(f"    {line}" for line in last_lines.splitlines()))
    (tmp_path / "runs" / "grpo-paper").rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"no finished run of the baseline\(s\) \['grpo-paper'\]"):
        results_page.results_report(settings, 4.0, None, None, time.perf_counter())


def test_seed_mean_curve_averages_seeds_per_evaluation_then_takes_the_trailing_mean():
    # two seeds of one method, four evaluations each (warm start, two logged, final): accuracy averaged per
    # evaluation at the seeds' mean time, then the trailing mean of 3 evaluations
    seed_1 = Run("m", [{"seconds_steps": 1.0, "heldout_accuracy": 0.3}, {"seconds_steps": 2.0,
                                                                       "heldout_accuracy": 0.5}],
                 {"heldout_accuracy_before": 0.1, "heldout_accuracy_after": 0.5})
    seed_2 = Run("m", [{"seconds_steps": 3.0, "heldout_accuracy": 0.1}, {"seconds_steps": 4.0,
                                                                       "heldout_accuracy": 0.3}],
                 {"heldout_accuracy_before": 0.1, "heldout_accuracy_after": 0.3})
    (curve_,) = accuracy_curves.seed_mean_runs({"m": {1: seed_1, 2: seed_2}})
    assert curve_.label == "m"
    xs, ys = curve_.series("heldout_accuracy", "seconds_steps")
    assert xs == [0.0, 2.0, 3.0, 3.0]
    assert ys == pytest.approx([0.1, (0.1 + 0.2) / 2, (0.1 + 0.2 + 0.4) / 3, (0.2 + 0.4 + 0.4) / 3])


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
    assert settings.methods == ["grpo-paper", "grpo", "cppo"] and settings.seeds == [1] and settings.budget_s == 25.0
    full = accuracy_runs.parse_args([])
    assert full.methods == list(accuracy_runs.METHODS) and (full.budget_s, full.eval_interval) == (75.0, 6)


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


def test_crossing_time_interpolates_the_trailing_mean_between_evaluations():
    points = curve([(0, 0.2), (10, 0.2), (20, 0.2), (30, 0.5), (40, 0.5)])
    # trailing means: 0.2, 0.2, 0.2, 0.3 at 30 s, 0.4 at 40 s: 0.35 is crossed halfway between 30 and 40 s
    assert accuracy_curves.crossing_time(points, 0.35) == pytest.approx(35.0)
    assert accuracy_curves.crossing_time(points, 0.2) == 0.0
    assert accuracy_curves.crossing_time(points, 0.9) is None


def test_paired_bootstrap_interval_holds_the_speedup_and_widens_with_the_methods_seed_spread():
    baseline = {seed: curve(RISING) for seed in range(5)}
    same = {seed: curve([(x / 2, y) for x, y in RISING]) for seed in range(5)}
    spread = {seed: curve([(x * (0.3 + 0.2 * seed), y) for x, y in RISING]) for seed in range(5)}
    same_result = accuracy_curves.compare_paired(baseline, same, resamples=500)
    assert same_result["estimate"]["headline"] == pytest.approx(2.0)
    assert same_result["headline_interval"] == pytest.approx((2.0, 2.0))  # identical seeds: nothing to resample
    spread_result = accuracy_curves.compare_paired(baseline, spread, resamples=500)
    low, high = spread_result["headline_interval"]
    assert low < spread_result["estimate"]["headline"] < high and high - low > 0.2


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


def test_main_starts_every_run_before_it_makes_the_report(tmp_path, monkeypatch, capsys):
    """RL runs, the supervised control and the MATH runs are all started first; the report is made after them."""
    from bench import time_to_accuracy

    events = []

    def fake_launch(flags, run_dir, processes):  # a finished run: the warm start builds in 100 s, loads in 40 s
        events.append(str(run_dir.relative_to(tmp_path)))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "command.txt").write_text(" ".join(training_run.command_for(flags, run_dir, processes)[1:]) + "\n")
        (run_dir / "summary.json").write_text(json.dumps({"seconds": 40.0 if run_dir.name == "cached" else 100.0}))
        return 1.0

    def fake_report(settings, sft_steps_per_second, control, math_model, started):
        events.append("report")
        return "the report", "dppo_speedup_vs_grpo: nan\ndppo_speedup_vs_grpo_filtered: nan"

    monkeypatch.setattr(training_run, "launch", fake_launch)
    monkeypatch.setattr(accuracy_runs, "prepare_math_model", lambda out_dir: out_dir / "math_model")
    monkeypatch.setattr(time_to_accuracy, "results_report", fake_report)
    (tmp_path / "cache" / "warm" / "embedded_x" / "warm_start").mkdir(parents=True)
    time_to_accuracy.main(["--out-dir", str(tmp_path), "--methods", "grpo", "dppo", "--seeds", "1", "2",
                           "--budget-s", "30", "--math-budget-s", "5"])
    # both baselines always run, every method with every seed, seed by seed
    assert events == ["warm_start/build", "warm_start/cached", "runs/grpo-paper/seed_1", "runs/grpo/seed_1",
                      "runs/dppo/seed_1", "runs/grpo-paper/seed_2", "runs/grpo/seed_2", "runs/dppo/seed_2",
                      "runs/sft-control/seed_1", "math/grpo-paper/seed_1", "math/grpo/seed_1", "math/dppo/seed_1",
                      "report"]
    assert capsys.readouterr().out.endswith(
        "the report\ndppo_speedup_vs_grpo: nan\ndppo_speedup_vs_grpo_filtered: nan\n")

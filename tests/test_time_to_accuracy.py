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

from bench import accuracy_curves, accuracy_runs, markdown_table, results_page, run_costs, training_run, verdict
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


def test_every_methods_seed_s_run_shares_grpos_pool_order_heldout_set_and_start_but_the_null_checks(tmp_path,
                                                                                                     monkeypatch):
    from megatron_dppo.launch.arguments import parse_args

    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path)])
    warm_start = tmp_path / "warm_start"
    # the parsed values that decide the pool's content and order, the held-out set and the start
    # (megatron_dppo/launch/run.py build_task, pipeline/tasks.py synthetic_task)
    decisive = ("prompt_data", "synthetic_task", "data_synthetic_cells", "data_train_size", "eval_size", "seed",
                "rl_seed", "load")

    def parsed(method, seed):
        return parse_args(accuracy_runs.rl_flags(settings, method, seed, warm_start))

    def pairing(method, seed):
        return {name: getattr(parsed(method, seed), name) for name in decisive}

    for seed in (1, 2):
        grpo = pairing("grpo", seed)
        assert grpo["rl_seed"] == seed
        for method in accuracy_runs.METHODS:
            if method not in accuracy_runs.RESEEDED:
                assert pairing(method, seed) == grpo, method
        # the null check: grpo itself with --rl-seed s + 1000, every other flag equal
        null, base = vars(parsed("grpo-null", seed)), vars(parsed("grpo", seed))
        assert null["rl_seed"] == seed + 1000
        assert {key for key in base if null[key] != base[key]} == {"rl_seed"}
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


def test_step_cost_fit_recovers_a_linear_cost_model_and_prices_nothing_below_zero():
    records = [{"tokens_generated": g, "tokens_trained": t, "seconds_step": 0.1 + 0.001 * g + 0.002 * t}
               for g, t in ((100, 50), (200, 80), (150, 200), (300, 10), (50, 120))]
    fit = run_costs.fit_step_cost([Run("a", records[:3]), Run("b", records[3:])])
    assert fit["fixed"] == pytest.approx(0.1) and fit["per_generated"] == pytest.approx(0.001)
    assert fit["per_trained"] == pytest.approx(0.002) and fit["r_squared"] == pytest.approx(1.0)
    # a step time that falls with the trained tokens: unconstrained least squares reads a negative price, the price
    # list reads 0 and the rest of the fit takes the steps
    falling = [{**r, "seconds_step": 0.5 + 0.001 * r["tokens_generated"] - 0.001 * r["tokens_trained"]}
               for r in records]
    fit = run_costs.fit_step_cost([Run("a", falling)])
    assert min(fit["prices"].values()) >= 0 and fit["per_trained"] == 0
    with pytest.raises(ValueError, match="cannot fit"):
        run_costs.fit_step_cost([Run("a", records[:2])])


def test_write_page_replaces_only_its_own_generated_block(tmp_path):
    page = tmp_path / "results.md"
    markdown_table.write_page(page, "quick", "first")
    page.write_text(page.read_text() + "\nHand-written analysis.\n")
    markdown_table.write_page(page, "full", "full tables")
    markdown_table.write_page(page, "quick", "second")
    text = page.read_text()
    assert "second" in text and "first" not in text and "full tables" in text
    assert "Hand-written analysis." in text
    page.write_text("<!-- BEGIN GENERATED quick by bench/time_to_accuracy.py -->\nno end marker\n")
    with pytest.raises(ValueError, match="restore the end marker"):
        markdown_table.write_page(page, "quick", "x")


def test_bad_command_line_values_are_rejected_with_the_flag_name(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        accuracy_runs.parse_args(["--budget-s", "0"])
    assert "--budget-s 0.0 must be > 0" in capsys.readouterr().err
    settings = accuracy_runs.parse_args(["--quick", "--methods", "cppo"])
    assert settings.methods == ["grpo-paper", "grpo", "dapo-dynamic-sampling", "cppo"]
    assert settings.seeds == [1] and settings.budget_s == 25.0 and settings.looks == ()
    full = accuracy_runs.parse_args([])
    assert full.methods == list(accuracy_runs.METHODS) and (full.budget_s, full.eval_interval) == (240.0, 10)
    assert (full.seeds, full.looks, full.secondary_seeds, full.eval_size) == ([1, 2, 3, 4, 5, 6], (6, 9, 12), 3, 512)
    assert accuracy_runs.parse_args(["--seeds", "1", "2", "3"]).looks == ()  # given seeds: no further looks
    assert accuracy_runs.pool_size() == 2048  # the embedded default's pool: the regime where RL learns
    monkeypatch.setattr(accuracy_runs, "SCREENING", {})
    with pytest.raises(SystemExit):
        accuracy_runs.parse_args(["--screen"])
    assert "SCREENING names no DPPO variant" in capsys.readouterr().err
    monkeypatch.setattr(accuracy_runs, "SCREENING", {"dppo-x": ["--algorithm", "dppo"]})
    assert accuracy_runs.parse_args(["--screen"]).seeds == [1, 2, 3]


def test_the_warm_start_lies_where_the_trainers_cache_key_puts_it_so_an_analysis_needs_no_build(tmp_path):
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--analyse-only"])
    path = accuracy_runs.prepare_warm_start(settings)  # nothing is built
    assert not (tmp_path / "warm_start").exists()
    recorded = next(accuracy_runs.RECORDS_DIR.glob("warm_start_*/runs/grpo/seed_1/*/command.txt")).read_text()
    assert f"--load $OUT/{path.relative_to(tmp_path)} " in recorded  # the warm start the records started from


def test_bench_runs_the_worked_task_and_its_quick_smoke_check_elsewhere():
    full, quick = accuracy_runs.parse_args([]), accuracy_runs.parse_args(["--quick"])
    assert full.out_dir != quick.out_dir  # one warm start per output directory
    assert (accuracy_runs.page_block(False), accuracy_runs.page_block(True)) == ("full", "quick")
    flags = accuracy_runs.task_flags()
    assert flags[flags.index("--synthetic-task") + 1] == "worked"
    assert flags[flags.index("--rollout-max-response-len") + 1] == "176"





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


def test_grpo_tuning_reuses_the_grpo_runs_and_runs_batch_64_with_the_leads_exact_command(tmp_path, monkeypatch):
    launched = []

    def fake(flags, run_dir, processes):
        launched.append((flags, run_dir))
        return run_dir

    monkeypatch.setattr(accuracy_runs, "launch_unless_finished", fake)
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--no-records", "--tune-grpo", "--seeds", "1",
                                         "2"])
    warm = tmp_path / "warm"
    run_dirs = accuracy_runs.run_grpo_tuning(settings, warm)
    assert list(run_dirs) == ["RL_FLAGS", "--rollout-batch-size 64"]
    assert run_dirs["RL_FLAGS"] == [tmp_path / "runs" / "grpo" / f"seed_{seed}" for seed in (1, 2)]
    for seed in (1, 2):  # the very command the batch-64 records were run with
        expected = ([*accuracy_runs.rl_flags(settings, "grpo", seed, warm), "--rollout-batch-size", "64"],
                    tmp_path / "tuning" / "rollout-batch-size_64" / f"seed_{seed}")
        assert expected in launched
    assert (accuracy_runs.rl_flags(settings, "grpo", 1, warm), tmp_path / "runs" / "grpo" / "seed_1") in launched
    assert len(launched) == 4


def test_the_benchs_own_task_settings_are_ones_the_trainer_takes():
    from megatron_dppo.launch.arguments import EMBEDDED_TASK_DEFAULTS, parse_args

    settings = accuracy_runs.TASK_SETTINGS
    assert set(settings) <= set(EMBEDDED_TASK_DEFAULTS["worked"])
    args = parse_args([*accuracy_runs.task_flags(), *accuracy_runs.warm_start_flags(),
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
    assert "a decode iteration 3 ± 0 ms" in run_costs.price_list(fit)


def test_a_recorded_run_is_restored_on_a_fresh_checkout_and_refused_from_another_command_or_warm_start(
        tmp_path, monkeypatch):
    """The full benchmark's finished runs are kept in the repository, one folder per command: a later sitting
    elsewhere (other checkout path, other --out-dir) restores a run recorded with the same command from the same warm
    start instead of running it; another command runs and is recorded beside the first; a sitting from another warm
    start (another machine's kernels) runs and keeps its records apart; runs at other than the default settings are
    not recorded."""
    launched = []

    def fake_launch(flags, run_dir, processes):  # a training run from its sitting's warm start
        launched.append(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)  # as the real launch does
        warm = json.loads((run_dir.parents[2] / "warm_start" / "build" / "summary.json").read_text())
        write_run(run_dir, [0.3, 0.4, 0.5], 1.0, before=warm["heldout_accuracy_before"])
        (run_dir / "command.txt").write_text(" ".join(training_run.command_for(flags, run_dir, processes)[1:]) + "\n")
        return 1.0

    monkeypatch.setattr(training_run, "launch", fake_launch)
    records = tmp_path / "records"

    def sitting(out_dir: Path, warm_accuracy: float, budget: str = "150", save: bool = True):
        settings = accuracy_runs.parse_args(["--out-dir", str(out_dir)])
        settings.records_dir, settings.save_records = records, save
        (out_dir / "warm_start" / "build").mkdir(parents=True, exist_ok=True)
        (out_dir / "warm_start" / "build" / "summary.json").write_text(
            json.dumps({"heldout_accuracy_before": warm_accuracy}))
        warm_start = out_dir / "cache" / "warm" / "x"
        flags = [*accuracy_runs.rl_flags(settings, "grpo", 1, warm_start), "--budget-marker", budget]
        return accuracy_runs.launch_recorded(settings, flags, out_dir / "runs" / "grpo" / "seed_1")

    def recorded() -> list[Path]:
        return sorted(records.glob("warm_start_0.2500/runs/grpo/seed_1/*/metrics.jsonl.gz"))

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
    other_machine = sitting(tmp_path / "fourth", 0.31)  # another warm start: run, and recorded apart
    assert launched == [first, third, unsaved, other_machine] and len(recorded()) == 2
    assert len(list(records.glob("warm_start_0.3100/runs/grpo/seed_1/*/metrics.jsonl.gz"))) == 1
    assert training_run.finished(sitting(tmp_path / "fourth_again", 0.31))  # restored from its own folder
    assert launched == [first, third, unsaved, other_machine]
    for record in records.glob("warm_start_*/runs/*/seed_*/*"):  # every record's folder is named by its command's hash
        assert record.name == accuracy_runs.command_hash((record / "command.txt").read_text().strip())


def test_a_renamed_methods_records_are_read_by_the_command_they_ran_with_never_by_the_name_it_left(tmp_path,
                                                                                                   monkeypatch):
    """dppo's records of `--algorithm dppo` at an older revision sit under dppo-05487f4: that name restores them (its
    command.txt says what ran), the new dppo finds none and runs, and without flags of today the old name refuses a
    seed it has no record of."""
    launched = []

    def fake_launch(flags, run_dir, processes):
        launched.append(run_dir)
        write_run(run_dir, [0.3, 0.4, 0.5], 1.0, before=0.25)
        (run_dir / "command.txt").write_text(" ".join(training_run.command_for(flags, run_dir, processes)[1:]) + "\n")
        return 1.0

    monkeypatch.setattr(training_run, "launch", fake_launch)
    records = tmp_path / "records"
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path / "old")])
    settings.records_dir, settings.save_records = records, True
    (settings.out_dir / "warm_start" / "build").mkdir(parents=True)
    (settings.out_dir / "warm_start" / "build" / "summary.json").write_text('{"heldout_accuracy_before": 0.25}')
    warm = settings.out_dir / "cache" / "warm" / "x"
    old_run = accuracy_runs.run_rl(settings, "dppo", 1, warm)  # dppo, as it ran then: recorded under runs/dppo
    (records / "warm_start_0.2500" / "runs" / "dppo").rename(
        records / "warm_start_0.2500" / "runs" / "dppo-05487f4")  # the rename, as in the repository
    fresh = accuracy_runs.parse_args(["--out-dir", str(tmp_path / "new")])
    fresh.records_dir, fresh.save_records = records, True
    (fresh.out_dir / "warm_start" / "build").mkdir(parents=True)
    (fresh.out_dir / "warm_start" / "build" / "summary.json").write_text('{"heldout_accuracy_before": 0.25}')
    warm = fresh.out_dir / "cache" / "warm" / "x"
    renamed = accuracy_runs.run_rl(fresh, "dppo-05487f4", 1, warm)
    assert launched == [old_run] and renamed == fresh.out_dir / "runs" / "dppo-05487f4" / "seed_1"
    assert "--log-dir $OUT/runs/dppo/seed_1" in accuracy_runs.portable_command(
        (renamed / "command.txt").read_text(), fresh.out_dir)  # the command it ran with
    assert (renamed / "metrics.jsonl").read_text() == (old_run / "metrics.jsonl").read_text()
    new_run = accuracy_runs.run_rl(fresh, "dppo", 1, warm)  # today's dppo: not the old record
    assert launched == [old_run, new_run]
    with_flags = accuracy_runs.run_rl(fresh, "dppo-05487f4", 2, warm)  # a seed with no record: today's flags run it
    assert launched == [old_run, new_run, with_flags]
    assert " ".join(accuracy_runs.RENAMED_FLAGS["dppo-05487f4"]) in (with_flags / "command.txt").read_text()
    monkeypatch.setitem(accuracy_runs.ALL_METHODS, "dppo-05487f4", None)  # and without them, refused
    with pytest.raises(ValueError, match="no record of seed 3 and no flags of today"):
        accuracy_runs.run_rl(fresh, "dppo-05487f4", 3, warm)



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


def test_the_load_monitor_reads_a_busy_process_of_known_cpu_time_beside_a_run_and_not_the_runs_own(tmp_path,
                                                                                                    monkeypatch):
    """A run (a process tree: a child burning CPU, as torchrun's ranks do) beside another process that burns 0.6 s of
    CPU while the run runs: machine.json counts the other process's 0.6 s and none of the run's own processes."""
    import subprocess
    import sys
    import time

    ready, gate, done, pids = (tmp_path / name for name in ("ready", "gate", "done", "pids"))
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass\n"
    other = subprocess.Popen([sys.executable, "-c", (
        f"import pathlib, sys, time\npathlib.Path({str(ready)!r}).touch()\n"
        f"while not pathlib.Path({str(gate)!r}).exists(): time.sleep(0.01)\n"
        + burn.format(0.6) + f"pathlib.Path({str(done)!r}).touch()\nsys.stdin.read()\n")], stdin=subprocess.PIPE)
    run = (f"import os, pathlib, subprocess, sys, time\npathlib.Path({str(gate)!r}).touch()\n"
           f"child = subprocess.Popen([sys.executable, '-c', {burn.format(0.4)!r}])\n"
           f"pathlib.Path({str(pids)!r}).write_text(f'{{os.getpid()}} {{child.pid}}')\nchild.wait()\n"
           f"while not pathlib.Path({str(done)!r}).exists(): time.sleep(0.01)\n")
    monkeypatch.setattr(training_run, "command_for", lambda flags, log_dir, processes: [sys.executable, "-c", run])
    while not ready.exists():  # its start-up is done before the run's first reading
        assert other.poll() is None
        time.sleep(0.01)
    try:
        training_run.launch([], tmp_path / "run", 1)
    finally:
        other.communicate(b"", timeout=30)
    machine = json.loads((tmp_path / "run" / training_run.MACHINE_FILE).read_text())
    by_pid = {process["pid"]: process["cpu_seconds"] for process in machine["other_processes"]}
    assert by_pid.get(other.pid) == pytest.approx(0.6, abs=0.1)  # the known extra load (time.process_time)
    assert not set(map(int, pids.read_text().split())) & set(by_pid)  # the run's own processes are not others
    assert machine["run_cpu_seconds"] >= 0.4 and machine["other_cpu_seconds"] >= 0.5
    assert machine["other_cores_busy"] == pytest.approx(machine["other_cpu_seconds"] / machine["wall_seconds"])


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
    # Student's t at 0.975 (tables): 3.182 (3 degrees of freedom), 2.776 (4), 2.571 (5), 2.201 (11); at 0.99167
    # (Holm's first level of three, two-sided): 3.534 (5); the distribution function at 0 and of t(1) = Cauchy at 1
    for dof, exact in ((3, 3.1824), (4, 2.7764), (5, 2.5706), (11, 2.2010)):
        assert accuracy_curves.t_quantile(0.975, dof) == pytest.approx(exact, abs=1e-3)
    assert accuracy_curves.t_quantile(1 - 0.05 / 6, 5) == pytest.approx(3.534, abs=2e-3)
    assert accuracy_curves.t_cdf(0.0, 5) == pytest.approx(0.5) and accuracy_curves.t_cdf(1.0, 1) == pytest.approx(0.75)
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
    records = [{"seconds_step": 0.1 + 0.002 * it + 0.0001 * gen + 0.0003 * tr, "dapo_rounds": rounds,
                "engine_batches": rounds, "decode_iterations": it, "tokens_generated": gen, "tokens_trained": tr}
               for rounds, it, gen, tr in ((1, 170, 6000, 1400), (2, 280, 11000, 900), (1, 120, 7000, 2000),
                                           (3, 400, 15000, 500), (1, 176, 6500, 300), (2, 300, 12000, 800))]
    fit = run_costs.fit_step_cost([Run("a", records)])
    assert (fit["fixed"], fit["per_iteration"], fit["per_generated"]) == pytest.approx((0.1, 0.002, 0.0001))
    slow = [{**r, "seconds_step": 2 * r["seconds_step"]} for r in records]  # the same work on a busy machine
    priced = run_costs.with_cost_model(Run("slow", slow), fit)
    assert [r["cost_model_seconds"] for r in priced.records] == pytest.approx(
        list(itertools.accumulate(r["seconds_step"] for r in records)))


def test_engine_batches_are_derived_for_older_records_and_a_later_batchs_loop_is_estimated_not_fitted():
    """Records from before the trainer logged engine batches: G rows per rolled-out group, 256 at a time per round;
    where a round overflowed, the later batch's iterations are added from its groups' mean lengths over the run's
    ratio of the longest group mean to the logged iterations on one-batch steps, and the step is left out of the
    fit."""
    one = {"step": 1, "groups_rolled_out": 32.0, "decode_iterations": 100.0, "seconds_step": 1.0}
    two = {"step": 2, "groups_rolled_out": 36.0, "decode_iterations": 120.0, "seconds_step": 2.0}
    rounds = {"step": 3, "groups_rolled_out": 96.0, "dapo_rounds": 3.0, "decode_iterations": 300.0,
              "seconds_step": 3.0}
    outcomes = ([{"step": 1, "response_length_mean": 80.0 if g == 0 else 10.0} for g in range(32)]
                + [{"step": 2, "response_length_mean": 40.0 if g == 33 else 10.0} for g in range(36)])
    run = run_costs.with_engine_work(Run("old", [one, two, rounds]), outcomes, samples_per_prompt=8)
    assert [r["engine_batches"] for r in run.records] == [1.0, 2.0, 3.0]
    # step 1: 80 / 100 = 0.8; step 2's later batch (groups 32-35) longest mean 40 -> 40 / 0.8 = 50 more iterations
    assert run.records[1]["decode_iterations"] == pytest.approx(170.0) and run.records[1]["work_estimated"]
    assert not run.records[0].get("work_estimated") and not run.records[2].get("work_estimated")
    logged = [{**r, "engine_batches": 1.0} for r in (one, two)]
    assert run_costs.with_engine_work(Run("new", logged), outcomes, 8).records == logged  # logged: kept as is


def test_runs_are_interleaved_in_a_seeded_order_and_the_other_methods_run_with_the_first_seeds(tmp_path):
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path)])
    every_seed = set(accuracy_runs.BASELINES) | set(accuracy_runs.HEADLINE_METHODS)
    assert "dppo-no-refill" not in every_seed and "grpo-null" in every_seed
    orders = {}
    for seed in settings.seeds:
        methods = accuracy_runs.seed_methods(settings, seed)
        assert set(methods) == every_seed | (set(accuracy_runs.SECONDARY_METHODS) if seed <= 3 else set())
        orders[seed] = accuracy_runs.run_order(settings, seed, methods)
        assert sorted(orders[seed]) == sorted(methods)
        assert orders[seed] == accuracy_runs.run_order(settings, seed, methods)  # the same when a sitting resumes
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
            groups[method][seed] = run_costs.with_cost_model(run, {"prices": {"fixed": seconds}})
    return groups


def test_the_checks_read_their_known_ratios_and_the_last_lines_give_each_baselines_verdict():
    groups = synthetic_groups({"grpo-paper": 1.2, "grpo": 1.0, "dapo-dynamic-sampling": 1.5, "dppo": 0.5,
                               "grpo-null": 1.0})
    comparisons = results_page.compare_all(groups)
    rule = results_page.rule_verdicts(comparisons)
    lines = results_page.last_lines(comparisons, groups, rule)
    # every seed pair reads the same: zero-width intervals, a difference at any level
    assert lines[:3] == ["dppo_verdict_vs_grpo: faster (cost-model time, 3 seeds)",
                         "dppo_verdict_vs_grpo_filtered: faster (cost-model time, 3 seeds)",
                         "dppo_verdict_vs_grpo_dynamic_sampling: faster (cost-model time, 3 seeds)"]
    assert lines[3:9] == ["dppo_speedup_vs_grpo: 2.40 [2.40, 2.40]",
                          "dppo_speedup_vs_grpo_cost_model: 2.40 [2.40, 2.40]",
                          "dppo_speedup_vs_grpo_paper_definition: 2.40 [2.40, 2.40]",
                          "dppo_speedup_vs_grpo_filtered: 2.00 [2.00, 2.00]",
                          "dppo_speedup_vs_grpo_filtered_cost_model: 2.00 [2.00, 2.00]",
                          "dppo_speedup_vs_grpo_filtered_paper_definition: 2.00 [2.00, 2.00]"]
    assert lines[-4:] == ["grpo_filter_check: 1.20 [1.20, 1.20], step-time ratio 1.20",
                          "grpo_filter_check_cost_model: 1.20 [1.20, 1.20], step-time ratio 1.20",
                          "grpo_null_check: 1.00 [1.00, 1.00]", "grpo_null_check_cost_model: 1.00 [1.00, 1.00]"]
    del groups["dppo"][3]
    del groups["dppo"][2]
    rule = results_page.rule_verdicts(results_page.compare_all(groups))
    assert {decided["verdict"] for decided in rule.values()} == {"undecided"}  # one seed: no interval


def test_the_verdicts_rule_holm_equivalence_and_its_stop():
    def result(estimate, log_se, seeds=6):
        return {"estimate": {"headline": estimate}, "log_se": log_se, "seeds": list(range(seeds))}

    # t(5) at 0.975 is 2.571: a log speed-up of 0.30 with SE 0.1 (t = 3.0, p = 0.030) alone is a difference at 5%,
    # but not at Holm's first level of three (0.0167) and so with it neither it nor the next is
    alone = verdict.verdicts({"a": result(math.exp(0.30), 0.1)})
    assert alone["a"]["verdict"] == "faster"
    three = verdict.verdicts({"a": result(math.exp(0.30), 0.1), "b": result(1.0, 0.5), "c": result(1.0, 0.5)})
    assert three["a"]["verdict"] == "undecided"
    strong = verdict.verdicts({"a": result(math.exp(-0.6), 0.1), "b": result(math.exp(0.30), 0.1),
                               "c": result(1.02, 0.03)})
    # a: t = 6 (p < 0.0167): slower; then b at 0.025: t = 3.0, p = 0.030 > 0.025, not a difference; c: the 90% ...
    assert strong["a"]["verdict"] == "slower" and strong["b"]["verdict"] == "undecided"
    # ... interval of 1.02 at SE 0.03, at Holm's level for its rank, lies inside [0.8, 1.25]: equivalent
    assert strong["c"]["verdict"] == "equivalent"
    low, high = strong["c"]["equivalence_interval"]
    assert 0.8 < low < 1.02 < high < 1.25
    assert verdict.should_stop({"a": result(2.0, 0.22 / 2.571 - 1e-4)})
    assert not verdict.should_stop({"a": result(2.0, 0.22 / 2.571 + 1e-4), "b": result(1.0, 0.01)})
    assert not verdict.should_stop({"a": {"estimate": None, "log_se": None, "seeds": [1]}})


def test_the_rule_on_simulated_benches_mostly_decides_a_large_speedup_and_never_calls_one_of_1_faster():
    from bench import estimator_check

    rows = estimator_check.rule_check([1.0, 2.37], benches=3)
    assert rows[0]["faster"] == 0 and rows[0]["slower"] == 0
    assert rows[1]["faster"] >= 0.75 and rows[1]["slower"] == 0 and rows[1]["seeds"] in verdict.LOOKS
    assert f"| 2.37 | {100 * rows[1]['faster']:.1f}% |" in estimator_check.rule_table(rows)


def test_the_report_reads_every_method_against_every_baseline_and_ends_with_the_last_lines(tmp_path, monkeypatch):
    import time

    model_dir = tmp_path / "cache" / "init" / "embedded_x" / "init"
    model_dir.mkdir(parents=True)
    save_file({"embed": torch.zeros(10, 8), "layer": torch.zeros(8, 8)}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8}))
    monkeypatch.setattr(results_page, "CALIBRATION_DATASETS", 10)
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--methods", "dppo", "grpo-null", "--seeds", "1",
                                         "2", "3"])
    accuracies = [0.25, 0.3, 0.35, 0.4, 0.42, 0.42, 0.42, 0.42]
    for seed in (1, 2, 3):
        for method, seconds_step in (("grpo-paper", 1.2), ("grpo", 1.0), ("dapo-dynamic-sampling", 1.5),
                                     ("dppo", 0.5), ("grpo-null", 1.0)):
            run_dir = write_run(tmp_path / "runs" / method / f"seed_{seed}", [a + 0.01 * seed for a in accuracies],
                                seconds_step, tokens=(round(1000 * seconds_step) + 10 * seed,
                                                      round(500 * seconds_step)))
            write_outcomes(run_dir, steps=7, per_step=4, pruned=0, zero_every=2)
            (run_dir / training_run.MACHINE_FILE).write_text(json.dumps({"other_cpu_seconds": 1.0 * seed,
                                                                        "other_cores_busy": 0.1 * seed}))
    report, last_lines = results_page.results_report(settings, time.perf_counter())
    for baseline in accuracy_runs.BASELINES:
        assert f"### Time to accuracy against {baseline} (" in report
    assert report.startswith("### Status\n\nDPPO against each baseline by the rule fixed above")
    assert "| dppo | grpo-paper | **faster** (3 seeds) |" in report
    assert "### The estimator where the answer is known" in report and "| 1.50 |" in report
    assert "0.20 (max 0.30)" in report  # the machine's load beside every method's runs
    assert "generation 45% of a GRPO step" in report and "a decode iteration" in report
    lines = last_lines.splitlines()
    assert lines[0] == "dppo_verdict_vs_grpo: faster (cost-model time, 3 seeds)"
    assert "dppo_speedup_vs_grpo: 2.40 [2.40, 2.40]" in lines
    assert lines[-4] == "grpo_filter_check: 1.20 [1.20, 1.20], step-time ratio 1.20"
    assert lines[-2] == "grpo_null_check: 1.00 [1.00, 1.00]"
    assert report.endswith("\n".join(f"    {line}" for line in lines))
    assert "the null check (grpo-null against grpo) reads 1.00 [1.00, 1.00] in cost-model time against a true " \
           "1.00: holds" in report
    (tmp_path / "runs" / "grpo-paper").rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"no finished run of the baseline\(s\) \['grpo-paper'\]"):
        results_page.results_report(settings, time.perf_counter())


def test_main_runs_six_seeds_then_looks_at_9_and_12_until_the_rule_stops(tmp_path, monkeypatch, capsys):
    """Seed by seed, the methods of a seed in its own order; then three more seeds at a time while the rule does not
    stop, up to 12; the report is made once, after every run."""
    from bench import time_to_accuracy

    events, stops = [], iter([False, True])

    def fake_launch(flags, run_dir, processes):  # a finished run
        events.append(str(run_dir.relative_to(tmp_path)))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "command.txt").write_text(" ".join(training_run.command_for(flags, run_dir, processes)[1:]) + "\n")
        (run_dir / "summary.json").write_text(json.dumps({"seconds": 1.0}))
        return 1.0

    def fake_report(settings, started):
        events.append("report")
        return "the report", "dppo_verdict_vs_grpo: undecided"

    monkeypatch.setattr(training_run, "launch", fake_launch)
    monkeypatch.setattr(time_to_accuracy, "results_report", fake_report)
    monkeypatch.setattr(time_to_accuracy, "rule_stops", lambda settings: next(stops))
    accuracy_runs.warm_start_path(accuracy_runs.parse_args(["--out-dir", str(tmp_path)])).mkdir(parents=True)
    time_to_accuracy.main(["--out-dir", str(tmp_path), "--methods", "dppo", "cppo", "--no-records"])
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--methods", "dppo", "cppo"])
    expected = ["warm_start/build"]
    for seed in range(1, 10):  # 6, then 9 (not stopped at 6), then stopped at 9
        methods = accuracy_runs.seed_methods(settings, seed)
        expected += [f"runs/{method}/seed_{seed}" for method in accuracy_runs.run_order(settings, seed, methods)]
    assert events == [*expected, "report"]
    assert "the rule goes on to its next look: seeds 7-9" in capsys.readouterr().out


def test_a_step_logs_the_embedded_engines_batches_and_their_decode_loops_in_sequence():
    """320 rows (40 prompts x 8): the embedded engine decodes rows 0-255, then 256-319, each batch's loop as long as
    its own longest response, one after the other; an engine that batches continuously runs one loop."""
    from megatron_dppo.algo.pruning import PromptDecision
    from megatron_dppo.launch.arguments import parse_args
    from megatron_dppo.pipeline.experience import ExperienceMaker
    from megatron_dppo.pipeline.tasks import Prompt, Task
    from megatron_dppo.rewards import RewardBatch
    from megatron_dppo.rollout.client import Completion

    lengths = {5: 50, 300: 30}  # row -> response length; every other row 3 tokens

    class Client:
        def generate(self, prompts, params, n=1):
            return [Completion(index, sample, [7] * lengths.get(index * n + sample, 3), [-0.1] *
                               lengths.get(index * n + sample, 3), "stop", None)
                    for index in range(len(prompts)) for sample in range(n)]

    class Tokenizer:
        eos_token_id = 0

        def decode(self, ids):
            return "x"

    prompts = [Prompt(i, [i + 1], "x", difficulty="cell") for i in range(40)]
    task = Task(prompts, [], lambda responses, rows: RewardBatch.of([1.0] * len(responses)), seed=0)
    for backend, batches, iterations in (("embedded", 2.0, 80.0), ("sglang", 1.0, 50.0)):
        args = parse_args(["--n-samples-per-prompt", "8", "--rollout-batch-size", "40", "--algorithm", "grpo"])
        args.rollout_backend = backend
        rollouts = ExperienceMaker(args, task, Tokenizer(), Client()).roll_out(
            prompts, PromptDecision.keep_all(40), 1, 40, 40)
        assert (rollouts.stats["engine_batches"], rollouts.stats["decode_iterations"]) == (batches, iterations)


def test_the_screening_reads_each_variant_against_grpo_in_cost_model_time_and_in_steps(tmp_path, monkeypatch):
    """A variant that learns as fast per step as grpo at half the work per step: 2x in cost-model time, 1x in
    steps; a variant without runs is listed as such."""
    from bench import tuning_reports

    monkeypatch.setattr(tuning_reports, "SCREENING", {"dppo-half": ["--algorithm", "dppo", "--x"], "dppo-none": []})
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--seeds", "1", "2", "3"])
    accuracies = [0.25, 0.3, 0.35, 0.4, 0.42, 0.42, 0.42, 0.42]
    for seed in (1, 2, 3):
        for method, seconds_step in (("grpo", 1.0), ("dppo-half", 0.5)):
            write_run(tmp_path / "runs" / method / f"seed_{seed}", [a + 0.01 * seed for a in accuracies],
                      seconds_step, tokens=(round(1000 * seconds_step) + 10 * seed, round(500 * seconds_step)))
    report, lines = tuning_reports.screening_report(settings)
    assert "| dppo-half | 3 | **2.00x** [2.00, 2.00] | **1.00x** [1.00, 1.00] | **2.00x** [2.00, 2.00] | " \
           "`--algorithm dppo --x` |" in report
    assert "| dppo-none | 0 | no finished run |" in report
    assert lines == "screening_dppo-half: 2.00 [2.00, 2.00] cost model, 1.00 [1.00, 1.00] steps"


def test_screen_runs_the_variants_alone_seed_by_seed_after_restoring_grpo(tmp_path, monkeypatch):
    from bench import time_to_accuracy

    events = []

    def fake_launch(flags, run_dir, processes):
        events.append(str(run_dir.relative_to(tmp_path)))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "command.txt").write_text(" ".join(training_run.command_for(flags, run_dir, processes)[1:]) + "\n")
        (run_dir / "summary.json").write_text("{}")
        return 1.0

    variants = {"dppo-a": ["--algorithm", "dppo"], "dppo-b": ["--algorithm", "dppo", "--no-dppo-refill"]}
    monkeypatch.setattr(accuracy_runs, "SCREENING", variants)
    monkeypatch.setitem(accuracy_runs.ALL_METHODS, "dppo-a", variants["dppo-a"])
    monkeypatch.setitem(accuracy_runs.ALL_METHODS, "dppo-b", variants["dppo-b"])
    monkeypatch.setattr(training_run, "launch", fake_launch)
    monkeypatch.setattr(time_to_accuracy, "screening_report", lambda settings: ("the screening", "screening_x: 1"))
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--screen"])
    accuracy_runs.warm_start_path(settings).mkdir(parents=True)
    time_to_accuracy.main(["--out-dir", str(tmp_path), "--screen", "--no-records"])
    expected = ["warm_start/build"]
    for seed in (1, 2, 3):
        order = ["grpo", *accuracy_runs.run_order(settings, seed, list(variants))]
        expected += [f"runs/{method}/seed_{seed}" for method in order]
    assert events == expected
    # more seeds for a chosen variant: its runs and grpo's are added, the finished ones read, the others left alone
    events.clear()
    time_to_accuracy.main(["--out-dir", str(tmp_path), "--screen", "--no-records", "--variants", "dppo-b",
                           "--seeds", "1", "2", "3", "4"])
    assert events == ["runs/grpo/seed_4", "runs/dppo-b/seed_4"]

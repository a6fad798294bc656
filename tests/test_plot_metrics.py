"""tools/plot_metrics.py: PNGs for one and several runs, and clear errors on bad input (the reader it plots
from, megatron_dppo.metrics.load_run, is tested in test_metrics_log.py)."""

import json

import pytest

from megatron_dppo.metrics import Run, load_run, plot_runs
from tools import plot_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(directory, steps=6, eval_every=2, summary=True, reward_offset=0.0):
    directory.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "seconds_wall": 0.5 * step, "reward_mean": reward_offset + 0.1 * step}
        if step % eval_every == 0:
            record["heldout_accuracy"] = 0.2 + 0.02 * step
        lines.append(json.dumps(record))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary:
        (directory / "summary.json").write_text(json.dumps(
            {"heldout_accuracy_before": 0.2, "heldout_accuracy_after": 0.4, "steps": steps, "seconds_rl": 3.1}))
    return directory


def assert_png(path):
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_one_run_gives_reward_and_accuracy_pngs_against_time_and_step(tmp_path):
    run = load_run(write_run(tmp_path / "grpo"))
    written = plot_runs([run], tmp_path / "plots")
    assert sorted(path.name for path in written) == [
        "heldout_accuracy_vs_seconds_wall.png", "heldout_accuracy_vs_step.png",
        "reward_mean_vs_seconds_wall.png", "reward_mean_vs_step.png"]
    for path in written:
        assert_png(path)


def test_several_runs_go_on_one_figure_per_metric_from_the_command_line(tmp_path, capsys):
    first = write_run(tmp_path / "a" / "seed_1")
    second = write_run(tmp_path / "a" / "seed_2", reward_offset=0.05)
    third = write_run(tmp_path / "b", summary=False)
    written = plot_metrics.main([f"{first}=DPPO", f"{second}=DPPO", f"{third / 'metrics.jsonl'}=GRPO",
                                 "--output-dir", str(tmp_path / "plots"), "--metrics", "reward_mean",
                                 "--x", "step", "--smooth", "3"])
    assert [path.name for path in written] == ["reward_mean_vs_step.png"]
    assert_png(written[0])
    assert str(written[0]) in capsys.readouterr().out


def test_metric_no_run_holds_is_an_error_not_an_empty_figure(tmp_path):
    run = load_run(write_run(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"no run has both 'reward_max' and 'step'"):
        plot_runs([run], tmp_path / "plots", metrics=("reward_max",), x_axes=("step",))
    with pytest.raises(ValueError, match="no runs to plot"):
        plot_runs([], tmp_path / "plots")
    with pytest.raises(ValueError, match="smooth window 0"):
        plot_runs([run], tmp_path / "plots", smooth=0)


def test_command_line_reports_a_missing_run_as_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plot_metrics.main([str(tmp_path / "missing"), "--output-dir", str(tmp_path / "plots")])
    assert exit_info.value.code == 2
    assert "no metrics file at" in capsys.readouterr().err


def test_defaults_skip_accuracy_when_no_run_evaluated(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "metrics.jsonl").write_text('{"step": 1, "seconds_wall": 0.5, "reward_mean": 0.1}\n')
    written = plot_runs([Run("r", load_run(directory).records)], tmp_path / "plots")
    assert sorted(path.name for path in written) == ["reward_mean_vs_seconds_wall.png", "reward_mean_vs_step.png"]

"""megatron_dppo/metrics.py's reader: load_run reads what MetricsLogger writes, adds the summary's evaluations to the
held-out accuracy series, and refuses bad files with the path and the fix."""

import json

import pytest

from megatron_dppo.metrics import MetricsLogger, load_run, smoothed


def log_steps(directory, steps=6, eval_every=2):
    """A run written by the trainer's own logger: reward every step, held-out accuracy every `eval_every` steps."""
    logger = MetricsLogger(directory, enabled=True, total_steps=steps)
    for step in range(1, steps + 1):
        metrics = {"seconds_wall": 0.5 * step, "reward_mean": 0.1 * step}
        if step % eval_every == 0:
            metrics["heldout_accuracy"] = 0.2 + 0.02 * step
        logger.log(step, metrics)
    logger.close()
    return directory


def test_the_reader_reads_what_the_logger_writes_and_adds_the_summary_evaluations_at_both_ends(tmp_path):
    directory = log_steps(tmp_path / "run")
    bare = load_run(directory)
    assert [record["step"] for record in bare.records] == [1, 2, 3, 4, 5, 6]
    assert bare.series("heldout_accuracy", "step")[0] == [2.0, 4.0, 6.0]
    (directory / "summary.json").write_text(json.dumps({"heldout_accuracy_before": 0.2,
                                                        "heldout_accuracy_after": 0.4}))
    xs, ys = load_run(directory).series("heldout_accuracy", "seconds_wall")
    assert xs == [0.0, 1.0, 2.0, 3.0, 3.0]
    assert ys == pytest.approx([0.2, 0.24, 0.28, 0.32, 0.4])


def test_run_label_defaults_to_the_directory_name_and_records_are_sorted_by_step(tmp_path):
    directory = tmp_path / "cppo"
    directory.mkdir()
    (directory / "metrics.jsonl").write_text('{"step": 2, "reward_mean": 0.5}\n\n{"step": 1, "reward_mean": 0.1}\n')
    run = load_run(directory)
    assert run.label == "cppo"
    assert [record["step"] for record in run.records] == [1, 2]


def test_trailing_mean_smoothing():
    assert smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smoothed([1.0, 3.0], 1) == [1.0, 3.0]


def test_missing_metrics_file_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no metrics file at .*nowhere.*--log-dir"):
        load_run(tmp_path / "nowhere")


def test_garbled_metrics_line_names_the_file_and_line(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.1}\n{"step": 2, "rew\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2 is not JSON"):
        load_run(directory)
    (directory / "metrics.jsonl").write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r"line 1 is not a step record"):
        load_run(directory)


def test_empty_metrics_file_and_garbled_summary_are_rejected(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no step records"):
        load_run(directory)
    (directory / "metrics.jsonl").write_text('{"step": 1}\n')
    (directory / "summary.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"summary.json is not JSON"):
        load_run(directory)

"""Weights & Biases beside TensorBoard (--wandb-project, --wandb-exp-name, --wandb-save-dir, Megatron-LM's names;
--wandb-entity, --wandb-group): in W&B's offline mode the run is kept on disk, and what it holds is read back here,
record by record, and compared with the TensorBoard events of the same steps; a run given its id continues it.
Without the wandb package, --wandb-project is one line naming the extra to install. The trainer's own W&B run, its
table of sample rollouts and its resume are checked in tests/test_custom_reward.py."""

import importlib.util
import json
import struct
import time
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.metrics import MetricsLogger, WandbRun

WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
BLOCK = 32768  # the LevelDB log format W&B writes its records in: 32 KiB blocks of (crc, length, type) chunks
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_files(save_dir: Path) -> list[Path]:
    """The offline runs' record files under `save_dir`, in the order they started (a resumed W&B run adds one)."""
    return sorted(save_dir.glob("wandb/offline-run-*/run-*.wandb"))


def wandb_records(save_dir: Path, run_file: Path | None = None, wait_s: float = 60.0) -> list:
    """Every record (wandb_internal_pb2.Record) of `run_file` (default: the one offline run under `save_dir`), in the
    order written, once the run's "exit" record is there: W&B's service process may still be writing the file when
    finish() has returned (seen on a loaded machine: no record at all yet), so the read waits for it, `wait_s` at
    most."""
    if run_file is None:
        (run_file,) = run_files(save_dir)
    deadline = time.monotonic() + wait_s
    while True:
        records = parse_records(run_file)
        if any(record.WhichOneof("record_type") == "exit" for record in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def parse_records(run_file: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    records, pending, position = [], b"", WANDB_HEADER
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        if kind == 0:  # zeroed space after the last record
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_runs(save_dir: Path) -> list:
    """The run record (project, entity, run_group, display_name, run_id) of each offline run, in start order."""
    return [next(record.run for record in wandb_records(save_dir, path) if record.WhichOneof("record_type") == "run")
            for path in run_files(save_dir)]


def run_file_of(save_dir: Path, run_id: str | None, resumed: bool) -> Path:
    """The record file of W&B run `run_id`'s first start (or, `resumed`, its last); run_id None: the one run there."""
    if run_id is None:
        (only,) = run_files(save_dir)
        return only
    found = [path for path in run_files(save_dir) if path.name == f"run-{run_id}.wandb"]
    return found[-1] if resumed else found[0]


def history_items(save_dir: Path, run_id: str | None = None, resumed: bool = False):
    """(step, [(key path, value)]) of every history record of the run."""
    for record in wandb_records(save_dir, run_file_of(save_dir, run_id, resumed)):
        if record.WhichOneof("record_type") == "history":
            yield record.history.step.num, [((item.key,) if item.key else tuple(item.nested_key),
                                             json.loads(item.value_json)) for item in record.history.item]


def wandb_history(save_dir: Path, run_id: str | None = None, resumed: bool = False) -> dict[int, dict]:
    """step -> the scalars logged at it (W&B's own _step, _runtime, _timestamp and the parts of logged tables left
    out)."""
    return {step: {path[0]: value for path, value in items if len(path) == 1 and not path[0].startswith("_")}
            for step, items in history_items(save_dir, run_id, resumed)}


def wandb_tables(save_dir: Path, run_id: str | None, key: str) -> list[dict]:
    """Every table the run's first start logged under `key`: {"step", "columns", "data"}, read back from the file W&B
    wrote it to."""
    folder = run_file_of(save_dir, run_id, False).parent
    return [{"step": step, **json.loads((folder / "files" / value).read_text())}
            for step, items in history_items(save_dir, run_id) for path, value in items if path == (key, "path")]


def tensorboard_scalars(directory: Path) -> dict[int, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    scalars: dict[int, dict] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            scalars.setdefault(event.step, {})[tag] = event.value
    return scalars


def test_wandb_gets_every_scalar_tensorboard_gets_at_the_same_step_read_back_from_the_offline_run(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = WandbRun("dppo-tests", "three-steps", tmp_path / "wandb", {"lr": 1e-6, "algorithm": "dppo"})
    logger = MetricsLogger(tmp_path / "log", enabled=True, total_steps=3, wandb=run)
    for step in range(1, 4):  # strings and non-finite numbers go to the JSONL file only, as for TensorBoard
        logger.log(step, {"reward_mean": 0.25 * step, "prompts_drawn": 16, "algorithm": "dppo",
                          "ratio": float("nan") if step == 2 else 1.0})
    logger.close()
    history, scalars = wandb_history(tmp_path / "wandb"), tensorboard_scalars(tmp_path / "log" / "tensorboard")
    assert sorted(history) == sorted(scalars) == [1, 2, 3]
    for step in history:
        assert history[step] == pytest.approx(scalars[step], rel=1e-6), step  # TensorBoard keeps float32
    assert history[2] == {"reward_mean": 0.5, "prompts_drawn": 16}
    (run,) = wandb_runs(tmp_path / "wandb")
    assert (run.project, run.display_name) == ("dppo-tests", "three-steps")


def test_wandb_entity_and_group_are_the_runs_and_a_run_given_its_id_continues_it(tmp_path, monkeypatch):
    """--wandb-entity and --wandb-group reach the run; a resumed training run passes the id its checkpoint saved
    (wandb.init(id=..., resume="allow")), and its steps go to that same run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = WandbRun("dppo-tests", "resumed", tmp_path / "wandb", {}, entity="my-team", group="sweep-1")
    first = MetricsLogger(tmp_path / "log", enabled=True, total_steps=3, wandb=run)
    for step in (1, 2):
        first.log(step, {"reward_mean": 0.1 * step})
    first.close()
    time.sleep(1.1)  # W&B names an offline run's folder by its start time, to the second
    second = MetricsLogger(tmp_path / "log", enabled=True, total_steps=3, start_step=2, wandb=replace(
        run, run_id=first.wandb_run_id))
    second.log(3, {"reward_mean": 0.3})
    second.close()
    assert second.wandb_run_id == first.wandb_run_id
    runs = wandb_runs(tmp_path / "wandb")
    assert [(r.run_id, r.entity, r.run_group) for r in runs] == [(first.wandb_run_id, "my-team", "sweep-1")] * 2
    assert wandb_history(tmp_path / "wandb", first.wandb_run_id) == {1: {"reward_mean": 0.1}, 2: {"reward_mean": 0.2}}
    assert wandb_history(tmp_path / "wandb", first.wandb_run_id, resumed=True) == {3: {"reward_mean": 0.3}}


def test_wandb_flags_without_a_project_are_refused_in_one_line(capsys):
    for flag, value in (("--wandb-entity", "my-team"), ("--wandb-group", "sweep-1"),
                        ("--wandb-rollout-table-rows", "2")):
        with pytest.raises(SystemExit) as stopped:
            parse_args([flag, value])
        assert stopped.value.code == 2
        assert capsys.readouterr().err.splitlines()[0] == (
            f"pretrain_dppo.py: error: {flag} sets up the W&B run, which needs --wandb-project NAME: add it or drop "
            f"{flag}")


def test_wandb_project_without_the_wandb_package_names_the_extra(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "wandb"
                        else real_find_spec(name, *rest))
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--wandb-project", "dppo"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "pretrain_dppo.py: error: argument --wandb-project: logging to Weights & Biases needs the wandb package, "
        "which is not installed: pip install -e '.[wandb]' (or drop --wandb-project)")

"""Weights & Biases beside TensorBoard (--wandb-project, --wandb-exp-name, --wandb-save-dir, Megatron-LM's names):
in W&B's offline mode the run is kept on disk, and what it holds is read back here, record by record, and compared
with the TensorBoard events of the same steps. Without the wandb package, --wandb-project is one line naming the
extra to install."""

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.metrics import MetricsLogger, WandbRun

WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
BLOCK = 32768  # the LevelDB log format W&B writes its records in: 32 KiB blocks of (crc, length, type) chunks
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(save_dir: Path) -> list:
    """Every record (wandb_internal_pb2.Record) of the one offline run under `save_dir`, in the order written."""
    from wandb.proto import wandb_internal_pb2

    (run_file,) = save_dir.glob("wandb/offline-run-*/run-*.wandb")
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


def wandb_history(save_dir: Path) -> dict[int, dict]:
    """step -> the metrics logged at it (W&B's own _step, _runtime, _timestamp left out)."""
    history = {}
    for record in wandb_records(save_dir):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {key: value for key, value in row.items() if not key.startswith("_")}
    return history


def wandb_run_names(save_dir: Path) -> list[tuple[str, str]]:
    return [(record.run.project, record.run.display_name) for record in wandb_records(save_dir)
            if record.WhichOneof("record_type") == "run"]


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
    assert wandb_run_names(tmp_path / "wandb") == [("dppo-tests", "three-steps")]


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

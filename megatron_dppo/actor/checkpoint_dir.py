"""What a save directory holds, read without torch: its checkpoints by step, the one `latest` names, and each one's
run record. actor/checkpoint.py writes the directory; the resume decision (launch/resume.py) reads it before
anything is built.

    <save>/iter_0000040/complete       the checkpoint is whole (written last, then the directory is renamed in)
    <save>/iter_0000040/run.json       the run that wrote it: its fingerprint, model config and flags (absent in a
                                       converter's or a warm start's model-only checkpoint)
    <save>/iter_0000040/dppo_state.pt  the trainer's state (absent in a model-only checkpoint)
    <save>/latest                      the name of the checkpoint the run last finished writing

Invariants: checkpoints are ordered by their step, the number in their name, never by the name's text; a
checkpoint without `complete` is never listed; `latest` is the trainer's own record of where it stands, and a
directory whose `latest` is missing or names what is not there falls back to its newest complete checkpoint.
"""

import json
from pathlib import Path

LATEST = "latest"
COMPLETE = "complete"
HF_CONFIG = "hf_config.json"
RUN_RECORD = "run.json"
TRAINER_STATE = "dppo_state.pt"
ITERATION_PREFIX = "iter_"


def iteration_dir(save_dir: str | Path, step: int) -> Path:
    return Path(save_dir) / f"{ITERATION_PREFIX}{step:07d}"


def checkpoint_step(checkpoint: str | Path) -> int:
    """The step an iter_* directory holds, from its name."""
    return int(Path(checkpoint).name.removeprefix(ITERATION_PREFIX))


def is_iteration_name(name: str) -> bool:
    return name.startswith(ITERATION_PREFIX) and name.removeprefix(ITERATION_PREFIX).isdigit()


def complete_checkpoints(save_dir: str | Path) -> list[Path]:
    """The complete checkpoints of `save_dir`, oldest step first."""
    directory = Path(save_dir)
    if not directory.is_dir():
        return []
    found = [path for path in directory.iterdir() if is_iteration_name(path.name) and (path / COMPLETE).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_name(save_dir: str | Path) -> str | None:
    """What `latest` names, or None where there is no `latest`."""
    marker = Path(save_dir) / LATEST
    return marker.read_text().strip() if marker.is_file() else None


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The checkpoint a run in `save_dir` stands at: the one `latest` names where it exists (a damaged one too, which
    the load then refuses by name), else (no `latest` yet, or one naming a checkpoint that is gone) the newest
    complete one; None where there is none."""
    name = latest_name(save_dir)
    if name is not None and (Path(save_dir) / name).is_dir():
        return Path(save_dir) / name
    complete = complete_checkpoints(save_dir)
    return complete[-1] if complete else None


def named_checkpoint(load: str | Path) -> Path:
    """The checkpoint directory `load` names: an iter_* directory itself, or a save directory's latest (where it has
    one; else `load` itself, for the caller to check)."""
    path = Path(load)
    if is_iteration_name(path.name):
        return path
    return latest_checkpoint(path) or path


def read_run_record(checkpoint: str | Path) -> dict | None:
    """The run record a checkpoint was written with; None for a model-only checkpoint or an unreadable record."""
    path = Path(checkpoint) / RUN_RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def holds_trainer_state(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / TRAINER_STATE).is_file()

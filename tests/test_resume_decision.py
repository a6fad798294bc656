"""Where a run starts, decided from what its --save holds (launch/resume.py), and what a save directory keeps
(actor/checkpoint.py), on directories laid out as the trainer writes them (a checkpoint's shards are not read here:
the decision reads names, markers and run records only; tests/test_trainer.py and tests/test_mixed_precision_resume.py
run, kill and resume real runs).

- the run record: the same flags and model give the same fingerprint, also under another run length, layout or log
  directory; a flag that changes training or a model config key gives another; every flag said not to matter exists;
- the precedence: another run's checkpoints (another flag, another model, or no record) are refused in one line
  naming the difference, and nothing in the directory changes; this run's latest wins over a --load that is where it
  started; an explicit --load of this run's own checkpoint wins over the latest; --fresh-start needs an empty --save;
- keep-last keeps the newest checkpoints by step (not by the name's text) and never the one `latest` names; a crash
  before `latest` was first written, or after the checkpoint it named was lost, falls back to the newest complete.
"""

import json
from pathlib import Path

import pytest

from megatron_dppo.actor.checkpoint import checkpoints_past_keeping, replace_directory
from megatron_dppo.actor.checkpoint_dir import (
    COMPLETE,
    LATEST,
    RUN_RECORD,
    TRAINER_STATE,
    iteration_dir,
    latest_checkpoint,
)
from megatron_dppo.errors import UserInputError
from megatron_dppo.launch.arguments import build_parser, parse_args
from megatron_dppo.launch.resume import RUN_INDEPENDENT_FLAGS, resume_decision, run_record

MODEL = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128,
         "transformers_version": "5.23.0", "torch_dtype": "bfloat16"}
BASE = ["--rollout-backend", "embedded", "--lr", "1e-3", "--rollout-batch-size", "4"]


def record(*flags: str, model: dict = MODEL) -> dict:
    return run_record(parse_args([*BASE, *flags]), build_parser(), model)


def write_checkpoint(save: Path, step: int, run: dict | None, trainer_state: bool = True,
                     complete: bool = True) -> Path:
    """An iter_* directory as save_checkpoint leaves it (shards left out), and `latest` naming it."""
    path = iteration_dir(save, step)
    path.mkdir(parents=True)
    if run is not None:
        (path / RUN_RECORD).write_text(json.dumps(run))
    if trainer_state:
        (path / TRAINER_STATE).write_bytes(b"state")
    if complete:
        (path / COMPLETE).write_text(str(step))
    (save / LATEST).write_text(path.name)
    return path


def listing(directory: Path) -> dict[str, str]:
    return {str(path.relative_to(directory)): path.read_text() if path.is_file() else "" for path in
            sorted(directory.rglob("*"))}


def test_the_fingerprint_ignores_length_layout_and_logs_and_changes_with_training_flags_and_the_model(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # room for TP 2
    same = record()["fingerprint"]
    for flags in (["--train-iters", "9"], ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
                  ["--log-dir", "elsewhere"], ["--save-interval", "3", "--save", "ckpt"], ["--time-budget-s", "60"],
                  ["--eval-interval", "5"], ["--recompute-granularity", "selective"]):
        assert record(*flags)["fingerprint"] == same, flags
    for flags in (["--lr", "2e-3"], ["--seed", "7"], ["--algorithm", "grpo"], ["--n-samples-per-prompt", "4"],
                  ["--bf16"], ["--prompt-data", "gsm8k", "--hf-checkpoint", "model", "--dry-run"]):
        assert record(*flags)["fingerprint"] != same, flags
    assert record(model={**MODEL, "transformers_version": "5.0.0", "torch_dtype": "float32"})["fingerprint"] == same
    assert record(model={**MODEL, "hidden_size": 128})["fingerprint"] != same


def test_every_flag_said_not_to_change_training_is_a_flag_of_the_parser():
    dests = {action.dest for action in build_parser()._actions}
    assert RUN_INDEPENDENT_FLAGS <= dests, sorted(RUN_INDEPENDENT_FLAGS - dests)


def test_a_save_of_another_configuration_is_refused_naming_the_flag_and_left_as_it_was(tmp_path):
    save = tmp_path / "run"
    write_checkpoint(save, 20, record())
    write_checkpoint(save, 40, record())
    before = listing(save)
    with pytest.raises(UserInputError) as refused:
        resume_decision(str(save), None, False, record("--lr", "2e-3"))
    message = str(refused.value)
    assert "\n" not in message and f"--save {save} holds checkpoints of another run" in message
    assert "--lr 0.001 there, 0.002 here" in message and "another --save" in message
    with pytest.raises(UserInputError, match="config.json hidden_size 64 there, 128 here"):
        resume_decision(str(save), None, False, record(model={**MODEL, "hidden_size": 128}))
    with pytest.raises(UserInputError, match="holds checkpoints of another run"):  # --fresh-start does not bypass it
        resume_decision(str(save), None, True, record("--lr", "2e-3"))
    assert listing(save) == before


def test_a_save_holding_a_model_only_or_unrecorded_checkpoint_is_refused(tmp_path):
    converted = tmp_path / "converted"
    write_checkpoint(converted, 0, None, trainer_state=False)
    with pytest.raises(UserInputError, match="written without a run record: a converter's"):
        resume_decision(str(converted), str(converted), False, record())


def test_this_runs_latest_wins_over_the_load_it_started_from(tmp_path):
    converted, save = tmp_path / "converted", tmp_path / "run"
    write_checkpoint(converted, 0, None, trainer_state=False)
    for step in (2, 4):
        write_checkpoint(save, step, record())
    decision = resume_decision(str(save), str(converted), False, record("--train-iters", "8"))
    assert decision.checkpoint == str(save / "iter_0000004")
    assert decision.message.startswith(f"resuming from {save / 'iter_0000004'} (step 4): --save {save} holds this "
                                       f"run's checkpoints; --load {converted} is where it started")
    # another run's checkpoint as the starting point: the same (it is not this run's own)
    other = tmp_path / "other"
    write_checkpoint(other, 9, record("--lr", "5e-3"))
    assert resume_decision(str(save), str(other), False, record()).checkpoint == str(save / "iter_0000004")
    # nothing saved yet: --load as given, nothing said
    empty = resume_decision(str(tmp_path / "new"), str(converted), False, record())
    assert (empty.checkpoint, empty.message) == (str(converted), None)


def test_an_explicit_load_of_this_runs_own_checkpoint_wins_and_says_what_the_save_holds(tmp_path):
    save = tmp_path / "run"
    for step in (2, 4):
        write_checkpoint(save, step, record())
    decision = resume_decision(str(save), str(save / "iter_0000002"), False, record())
    assert decision.checkpoint == str(save / "iter_0000002")
    assert decision.message == (f"resuming from {save / 'iter_0000002'} (step 2), as --load names; --save {save} "
                                "holds this run up to step 4")
    assert resume_decision(str(save), str(save), False, record()).checkpoint == str(save)  # --load = --save


def test_fresh_start_needs_an_empty_save(tmp_path):
    save = tmp_path / "run"
    write_checkpoint(save, 2, record())
    with pytest.raises(UserInputError) as refused:
        resume_decision(str(save), None, True, record())
    assert f"but {save} holds 2 entries (iter_0000002, latest)" in str(refused.value)
    (tmp_path / "empty").mkdir()
    for directory in (tmp_path / "empty", tmp_path / "absent"):
        decision = resume_decision(str(directory), None, True, record())
        assert decision.checkpoint is None and "--fresh-start" in decision.message
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--fresh-start"])  # without --save


def test_keep_last_keeps_the_newest_by_step_and_never_the_one_latest_names(tmp_path):
    save = tmp_path / "run"
    for step in (9_999_998, 9_999_999, 10_000_000, 10_000_001):  # 'iter_10000000' sorts before 'iter_9999998'
        write_checkpoint(save, step, record())
    assert [path.name for path in checkpoints_past_keeping(save, 2)] == ["iter_9999998", "iter_9999999"]
    # resumed from an earlier checkpoint of the run: `latest` names it, and later steps outnumber it
    (save / LATEST).write_text("iter_9999998")
    assert [path.name for path in checkpoints_past_keeping(save, 2)] == ["iter_9999999"]
    assert [path.name for path in checkpoints_past_keeping(save, 1)] == ["iter_9999999", "iter_10000000"]


def test_a_crash_before_latest_or_after_its_checkpoint_was_lost_falls_back_to_the_newest_complete(tmp_path):
    save = tmp_path / "run"
    write_checkpoint(save, 2, record())
    write_checkpoint(save, 4, record())
    write_checkpoint(save, 6, record(), complete=False)  # still being written: never a candidate
    (save / LATEST).unlink()
    assert latest_checkpoint(save) == save / "iter_0000004"
    (save / LATEST).write_text("iter_0000008")  # names a checkpoint that is gone
    assert latest_checkpoint(save) == save / "iter_0000004"
    (save / LATEST).write_text("iter_0000002")  # the trainer's record wins where it stands
    assert latest_checkpoint(save) == save / "iter_0000002"


def test_a_step_saved_again_replaces_its_directory_and_leaves_nothing_aside(tmp_path):
    old, new = tmp_path / "iter_0000002", tmp_path / ".tmp_iter_0000002"
    old.mkdir()
    (old / "shard").write_text("old")
    new.mkdir()
    (new / "shard").write_text("new")
    replace_directory(new, old)
    assert (old / "shard").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002"]

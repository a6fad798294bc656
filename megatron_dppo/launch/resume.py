"""Where a run starts: from its own latest checkpoint in --save (resume), from --load, or afresh; and --fresh-start.

    flags + the starting model's config.json ─► run_record: {fingerprint, model, flags}, written into every
    checkpoint the run saves (run.json)
    --save's checkpoints (actor/checkpoint_dir.py) + --load + --fresh-start + run_record ─► resume_decision:
        the checkpoint to load (or None: start from the model) and the one line said at start, or a UserInputError

The precedence, as Megatron-LM's `--load` = `--save` habit and verl's resume_mode=auto behave:
1. --save holds checkpoints of another run (a run record that differs, or none) ─► refused, never overwritten;
2. --fresh-start ─► --save must be empty (or not exist): the run starts from --load / --hf-checkpoint;
3. --load names a checkpoint of this run (its run record matches) ─► it is loaded: an explicit --load wins (to
   resume from an earlier checkpoint, or from this run's checkpoints in another directory);
4. --save holds checkpoints of this run ─► the run resumes from its latest, whatever --load names: a --load that is
   not this run's own (a converter's checkpoint, another run's) is where the run started, and it has moved on;
5. otherwise ─► --load as given (None: the model of --hf-checkpoint, or the embedded default's warm start).

What makes "the same run": the model's config.json (less the keys that describe a copy rather than the model:
VOLATILE_CONFIG_KEYS) and every flag that changes what is trained, which is every flag but those of
RUN_INDEPENDENT_FLAGS: the run's length (so a rerun with a larger --train-iters extends it; the LR schedule and the
run's progress then follow the new length), where checkpoints and logs go, evaluation, the parallel layout and
memory settings a checkpoint resumes under, and where and how the rollout servers run. A new flag counts as one
that changes what is trained until it is listed there: a change of it refuses the resume, loudly, rather than
mixing two runs silently.

Invariants: imports no torch (the flag is parsed with the others); the decision only reads the directory, and a
refusal leaves it as it was.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_dppo.actor.checkpoint_dir import (
    checkpoint_step,
    complete_checkpoints,
    holds_trainer_state,
    latest_checkpoint,
    named_checkpoint,
    read_run_record,
)
from megatron_dppo.errors import UserInputError

# Flags (argparse dests) that leave what is trained unchanged, so a checkpoint resumes under any value of them
RUN_INDEPENDENT_FLAGS = frozenset({
    # the run's length
    "train_iters", "time_budget_s", "time_budget_prices",
    # checkpoints and logs
    "load", "save", "save_interval", "keep_last_checkpoints", "no_load_optim", "fresh_start", "log_dir",
    # the watchdog and the ports (launch/cluster_flags.py)
    "heartbeat_timeout_s", "heartbeat_interval_s", "heartbeat_port", "weight_sync_port",
    "wandb_project", "wandb_entity", "wandb_group", "wandb_exp_name", "wandb_save_dir", "wandb_rollout_table_rows",
    "wandb_rollout_table_interval", "save_debug_rollout_data",
    # evaluation
    "eval_prompt_data", "eval_prompt_data_split", "eval_prompt_data_config", "eval_size", "eval_interval",
    # the layout and memory settings a checkpoint resumes under (docs/trainer.md, "Checkpoints")
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel", "use_distributed_optimizer",
    "transformer_impl", "recompute_granularity", "recompute_method", "recompute_num_layers", "gpu_memory_gib",
    "max_tokens_per_gpu", "packing_window", "distributed_timeout_minutes",
    # where and how the rollout servers run
    "rollout_backend", "rollout_python", "rollout_urls", "rollout_num_servers", "rollout_max_concurrency",
    "rollout_timeout_s", "rollout_weight_bucket_mb", "rollout_server_gpus", "weight_sync_master_address",
    "rollout_engine_threads", "rollout_engine_workers", "rollout_engine_disable_radix_cache", "rollout_engine_device",
    "rollout_colocate",
    # paths of what the record holds by content (the model's config), and the entry point's own modes
    "hf_checkpoint", "cache_dir", "dry_run",
})
# Keys of config.json that describe a copy of the model (who wrote it, in which dtype), not the model itself
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype"})
FINGERPRINT_CHARS = 16
DIFFERENCES_SHOWN = 3


def resume_flags(parser: argparse.ArgumentParser) -> None:
    resume = parser.add_argument_group("resume (a run continues from its own latest checkpoint in --save)")
    resume.add_argument("--fresh-start", action="store_true",
                        help="start from --load / --hf-checkpoint even where --save holds this run's checkpoints: "
                             "--save must then be empty or not exist. Without it a run whose --save holds its own "
                             "checkpoints resumes from the latest, and one holding another run's is refused")


def resume_errors(args: argparse.Namespace) -> list[str]:
    if args.fresh_start and not args.save:
        return ["--fresh-start starts over into an empty --save DIR, which is not given: add --save or drop "
                "--fresh-start"]
    return []


def run_record(args: argparse.Namespace, parser: argparse.ArgumentParser, hf_config: dict) -> dict:
    """{fingerprint, model, flags}: the model's config less VOLATILE_CONFIG_KEYS, and every flag of `parser` but
    RUN_INDEPENDENT_FLAGS by its option name, with the value this run resolved (JSON types)."""
    model = {key: value for key, value in hf_config.items() if key not in VOLATILE_CONFIG_KEYS}
    flags = {action.option_strings[0]: getattr(args, action.dest) for action in parser._actions
             if action.option_strings and action.dest not in RUN_INDEPENDENT_FLAGS and hasattr(args, action.dest)}
    content = json.loads(json.dumps({"model": model, "flags": flags}, sort_keys=True, default=str))
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:FINGERPRINT_CHARS]
    return {"fingerprint": digest, **content}


@dataclass(frozen=True)
class ResumeDecision:
    checkpoint: str | None  # what the run loads: None starts from the model
    message: str | None  # the one line rank 0 says at start (None: nothing to say)


def resume_decision(save: str | None, load: str | None, fresh_start: bool, record: dict) -> ResumeDecision:
    """The checkpoint a run loads, by the precedence of the module docstring; a UserInputError (one line naming the
    directory, the difference and the way on) where --save holds another run's checkpoints or --fresh-start finds it
    not empty."""
    if not save:
        return ResumeDecision(load, None)
    saved = complete_checkpoints(save)
    foreign = next((path for path in saved if _fingerprint(path) != record["fingerprint"]), None)
    if foreign is not None:
        raise UserInputError(f"--save {save} holds checkpoints of another run ({foreign.name}: "
                             f"{record_difference(read_run_record(foreign), record)}), which this run never "
                             "overwrites: give it another --save directory, or rerun with that run's model and flags "
                             "to resume it")
    if fresh_start:
        entries = sorted(path.name for path in Path(save).iterdir()) if Path(save).is_dir() else []
        if entries:
            shown = ", ".join(entries[:DIFFERENCES_SHOWN]) + (" ..." if len(entries) > DIFFERENCES_SHOWN else "")
            raise UserInputError(f"--fresh-start starts over into an empty --save, but {save} holds {len(entries)} "
                                 f"entries ({shown}): give an empty or new directory, or drop --fresh-start to "
                                 "resume this run from its latest checkpoint there")
        return ResumeDecision(load, f"starting afresh into {save} (--fresh-start)")
    latest = latest_checkpoint(save) if saved else None
    if load and _fingerprint(named_checkpoint(load)) == record["fingerprint"]:
        where = named_checkpoint(load)
        later = f"; --save {save} holds this run up to step {checkpoint_step(latest)}" if latest and \
            checkpoint_step(latest) > checkpoint_step(where) else ""
        return ResumeDecision(load, f"resuming from {where} (step {checkpoint_step(where)}), as --load names{later}")
    if latest is None:
        return ResumeDecision(load, None)
    started = f"; --load {load} is where it started" if load else ""
    return ResumeDecision(str(latest), f"resuming from {latest} (step {checkpoint_step(latest)}): --save {save} "
                                       f"holds this run's checkpoints{started} (--fresh-start with an empty --save "
                                       "starts over)")


def _fingerprint(checkpoint: Path) -> str | None:
    """The fingerprint a trainer checkpoint was written with (None: a model-only one, or one without a record)."""
    record = read_run_record(checkpoint) if holds_trainer_state(checkpoint) else None
    return record.get("fingerprint") if isinstance(record, dict) else None


def record_difference(saved: dict | None, current: dict) -> str:
    """What sets a saved run record apart from this run's, in words: the model's config keys or the flags (up to
    DIFFERENCES_SHOWN of each, with both values), or that the checkpoint records no run."""
    if not isinstance(saved, dict) or "flags" not in saved or "model" not in saved:
        return ("written without a run record: a converter's or warm start's model-only checkpoint, or a run of an "
                "earlier version")
    parts = []
    for kind, prefix in (("model", "config.json "), ("flags", "")):
        names = sorted(set(saved[kind]) | set(current[kind]), key=str)
        changed = [name for name in names if saved[kind].get(name) != current[kind].get(name)]
        parts += [f"{prefix}{name} {_shown(saved[kind].get(name))} there, {_shown(current[kind].get(name))} here"
                  for name in changed[:DIFFERENCES_SHOWN]]
        if len(changed) > DIFFERENCES_SHOWN:
            parts.append(f"{len(changed) - DIFFERENCES_SHOWN} more {'config keys' if kind == 'model' else 'flags'}")
    return "; ".join(parts) or "another fingerprint"


def _shown(value) -> str:
    return "unset" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)

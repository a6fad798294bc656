"""Megatron distributed checkpoints of the actor: atomic and resumable; the model loads under any TP/PP, the
optimizer as its format allows (below).

Layout of a save directory:

    <save>/iter_0000040/          one checkpoint (megatron dist_checkpointing, torch_dist backend)
        .metadata, __*.distcp      the sharded state: {"model": ..., "optimizer": ..., "scheduler": ...}
        hf_config.json             the HF config.json the model was built from (export needs it)
        dppo_state.pt              trainer state that is not sharded: step, data position, pruner history,
                                   RNG states per rank, metrics cursor, the optimizer's layout (absent in a
                                   converter's checkpoint)
        run.json                   the run that wrote it (launch/resume.py: its fingerprint, model config and
                                   flags), which decides whether a later run resumes it (absent in a converter's)
        complete                   written last: a checkpoint without it is partial and never loaded
    <save>/latest                  "iter_0000040", replaced atomically after the checkpoint is complete

Loading is strict, with one exception. Transformer Engine's modules save FP8 metadata as `*._extra_state`; a
checkpoint written under the local spec (our converter's, the CPU mode's) has no such entry for modules the TE spec
adds (core attention, norms), so a TE model loading it keeps those modules' own extra state. Any other key the model
or optimizer needs and the checkpoint lacks is an error naming it.

What loads under another layout: the model's weights, under any TP/PP (megatron-core reshards them); the optimizer's
state (fp32 main parameters, Adam's moments and step counts) without --use-distributed-optimizer, under any TP/PP
too (it is kept per model parameter); with it, only under the TP/PP it was saved with, at any DP: its
`dp_reshardable` format (Megatron-LM's default) saves each model-parallel rank's flat buffers as they are, keyed by
that rank. megatron-core's `fully_reshardable` format would reshard them, by gathering the whole optimizer state on
DP rank 0 at every save (about 48 GB for Qwen3-4B): not used. A load of the optimizer under another layout is
therefore refused, naming the change (`optimizer_layout_error`, from the layout the trainer saves in dppo_state.pt),
and --no-load-optim loads the weights alone.

Writes go to `<save>/.tmp_iter_XXXXXXX` first and are renamed when every rank has finished, so a crash leaves
either the old checkpoint or the new one, never half of one under its final name. Then `latest` is replaced, and only
then does --keep-last-checkpoints delete: the newest checkpoints by step are kept, and never the one `latest` names,
so a crash at any point leaves `latest` naming a complete checkpoint (checkpoint_dir.latest_checkpoint falls back to
the newest complete one where a crash came before the first `latest`). A step saved again (a run resumed from an
earlier checkpoint of its own) replaces the old directory by two renames, never by deleting it first.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException

from megatron_dppo.actor.checkpoint_dir import (
    COMPLETE,
    HF_CONFIG,
    LATEST,
    RUN_RECORD,
    TRAINER_STATE,
    complete_checkpoints,
    iteration_dir,
    latest_name,
    named_checkpoint,
)

EXTRA_STATE = "_extra_state"  # Transformer Engine's per-module FP8 metadata (a torch state dict entry)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def stop_writer_results_manager() -> None:
    """Stop the process that megatron's torch_dist writer serves its results queue from. megatron 0.16.1 starts it
    (a multiprocessing Manager, spawned) at a rank's first save and keeps it for the rank's lifetime
    (`filesystem_async._results_queue`); it never checks for its parent, so a rank killed later (SIGKILL, the OOM
    killer, a failing peer under torchrun) would leave it and multiprocessing's resource tracker running forever.
    The next save starts a new one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        filesystem_async._results_queue._manager.shutdown()
        filesystem_async._results_queue = None


def save_checkpoint(save_dir: str | Path, step: int, sharded_state: dict, hf_config: dict,
                    trainer_state: dict | None = None, keep_last: int | None = None, sharded_strategy=None,
                    run_record: dict | None = None) -> Path:
    """Save `sharded_state` (values from `.sharded_state_dict()`) atomically as checkpoint `step`; every rank calls.

    `trainer_state` is a picklable dict saved by rank 0 (per-rank parts, e.g. RNG states, are gathered by the
    caller); `run_record` the run that writes it (launch/resume.py). Keeps the newest `keep_last` complete
    checkpoints by step when given, and always the one `latest` names. `sharded_strategy` replaces megatron's
    default torch_dist writer (the streaming converter passes one that reads each chunk just before writing it)."""
    save_dir = Path(save_dir)
    final = iteration_dir(save_dir, step)
    staging = save_dir / f".tmp_{final.name}"
    if _rank0():
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(sharded_state, str(staging), sharded_strategy=sharded_strategy)
    stop_writer_results_manager()
    _barrier()
    if _rank0():
        (staging / HF_CONFIG).write_text(json.dumps(hf_config, indent=2))
        if run_record is not None:
            (staging / RUN_RECORD).write_text(json.dumps(run_record, indent=2, sort_keys=True))
        if trainer_state is not None:
            torch.save(trainer_state, staging / TRAINER_STATE)
        (staging / COMPLETE).write_text(str(step))
        replace_directory(staging, final)
        marker = save_dir / f".{LATEST}.tmp"
        marker.write_text(final.name)
        os.replace(marker, save_dir / LATEST)
        if keep_last:
            for old in checkpoints_past_keeping(save_dir, keep_last):
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def replace_directory(source: Path, target: Path) -> None:
    """Rename `source` to `target`. An existing `target` is first renamed aside and deleted once `source` stands in
    its place: a crash in between leaves one of the two whole under `target`'s name or beside it, never nothing."""
    if not target.exists():
        os.replace(source, target)
        return
    aside = target.with_name(f".replaced_{target.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(target, aside)
    os.replace(source, target)
    shutil.rmtree(aside, ignore_errors=True)


def checkpoints_past_keeping(save_dir: str | Path, keep_last: int) -> list[Path]:
    """The complete checkpoints --keep-last-checkpoints deletes: all but the newest `keep_last` by step, never the
    one `latest` names (after a resume from an earlier checkpoint, later steps of the run may outnumber it)."""
    complete = complete_checkpoints(save_dir)
    latest = latest_name(save_dir)
    return [path for path in complete[:-keep_last] if path.name != latest]


def resolve_checkpoint(load: str | Path) -> Path:
    """The checkpoint directory `load` names: an iter_* directory itself, or a save directory (its `latest`, else
    its newest complete checkpoint).

    A partial checkpoint (no `complete` marker), or missing files, is a clear error naming what is missing and the
    newest complete checkpoint that can be loaded instead."""
    path = named_checkpoint(load)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist: pass --load a save directory or an iter_* dir")
    missing = [name for name in (COMPLETE, HF_CONFIG, ".metadata") if not (path / name).is_file()]
    if missing:
        fallback = [p for p in complete_checkpoints(path.parent) if p != path]
        hint = f"load the previous complete checkpoint {fallback[-1]}" if fallback else "no complete checkpoint exists"
        raise FileNotFoundError(
            f"checkpoint {path} is partial or corrupted: missing {', '.join(missing)}; {hint}")
    return path


def read_hf_config(checkpoint: str | Path) -> dict:
    return json.loads((Path(checkpoint) / HF_CONFIG).read_text())


def _is_extra_state(key: str) -> bool:
    return key.split("/")[0].endswith(EXTRA_STATE)


def _on_every_rank(keys: set[str]) -> list[str]:
    """The union over ranks, so every rank raises alike (a rank that went on alone would hang in a collective)."""
    if not dist.is_initialized():
        return sorted(keys)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    return sorted(set().union(*gathered))


def load_sharded(checkpoint: str | Path, sharded_state: dict) -> dict:
    """Load the parts of `sharded_state` (a dict of `.sharded_state_dict()` values) from `checkpoint`.

    Keys of `sharded_state` that the checkpoint lacks are an error naming them, except `*._extra_state`, which is
    left out of the result (see the module docstring; `load_module_state` keeps the module's own value)."""
    path = resolve_checkpoint(checkpoint)
    try:
        # RETURN_UNEXPECTED: requested keys the checkpoint lacks ("unexpected" in megatron's terms) are dropped
        # from the request and returned, instead of failing inside the storage reader as a missing key.
        loaded, _, absent = dist_checkpointing.load(sharded_state, str(path),
                                                    strict=StrictHandling.RETURN_UNEXPECTED)
    # A damaged shard surfaces as torch's CheckpointException (a BaseException, not an Exception) or as the
    # reader's own error, depending on where the bytes run out.
    except (Exception, CheckpointException) as error:
        # a checkpoint saved before the trainer recorded its optimizer layout reaches here under a layout change too
        layout = (" (or, if it holds distributed-optimizer state saved under another TP/PP, resume under that layout "
                  "or with --no-load-optim)") if "optimizer" in sharded_state else ""
        raise RuntimeError(
            f"checkpoint {path} could not be read ({type(error).__name__}: {error}); its shard files are damaged or "
            f"incomplete: load an earlier checkpoint{layout}"
        ) from error
    missing = [key for key in _on_every_rank(absent) if not _is_extra_state(key)]
    if missing:
        raise KeyError(f"checkpoint {path} has no {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} "
                       "keys) that this model needs: it was saved for another model config, or without optimizer "
                       "state; check --hf-checkpoint/hf_config.json, or load it without the optimizer")
    return loaded


def load_module_state(module: torch.nn.Module, state: dict) -> None:
    """`module.load_state_dict(state)`, strict except for `*._extra_state` entries `load_sharded` left out."""
    result = module.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if not _is_extra_state(key)]
    if missing or result.unexpected_keys:
        raise KeyError(f"loaded state does not fit the model: missing {missing[:8]}, "
                       f"unexpected {result.unexpected_keys[:8]}")


def optimizer_layout(tp: int, pp: int, distributed_optimizer: bool) -> dict:
    """What decides where an optimizer's saved state loads (the trainer saves it with the checkpoint)."""
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "use_distributed_optimizer": distributed_optimizer}


def optimizer_layout_error(checkpoint: str | Path, saved: dict | None, current: dict) -> str | None:
    """Why the optimizer state of `checkpoint`, saved under layout `saved`, cannot load under `current` (None: it
    can, or the checkpoint predates the record); one line naming the change and the ways on."""
    if saved is None or saved == current:
        return None
    fallback = ("or pass --no-load-optim to load the model weights alone (they load under any TP/PP; Adam's moments "
                "and the LR schedule start afresh)")
    if saved["use_distributed_optimizer"] != current["use_distributed_optimizer"]:
        given = "with" if saved["use_distributed_optimizer"] else "without"
        return (f"checkpoint {checkpoint} holds optimizer state saved {given} --use-distributed-optimizer, whose "
                f"format this run's optimizer cannot load: resume {given} --use-distributed-optimizer, {fallback}")
    if not saved["use_distributed_optimizer"]:
        return None  # kept per model parameter: it loads under any TP/PP
    layout = "TP {tensor_model_parallel_size} x PP {pipeline_model_parallel_size}"
    return (f"checkpoint {checkpoint} holds optimizer state saved by the distributed optimizer under "
            f"{layout.format(**saved)}, which loads only under that layout (its dp_reshardable format keeps each "
            f"model-parallel rank's buffers as they are), and this run is {layout.format(**current)}: resume with "
            f"--tensor-model-parallel-size {saved['tensor_model_parallel_size']} --pipeline-model-parallel-size "
            f"{saved['pipeline_model_parallel_size']}, {fallback}")


def load_trainer_state(checkpoint: str | Path) -> dict | None:
    path = resolve_checkpoint(checkpoint) / TRAINER_STATE
    return torch.load(path, weights_only=False) if path.is_file() else None

"""The embedded default: everything the no-argument CPU run needs, built locally and cached.

    character tokenizer + tiny Qwen2-style config ─► random HF model (the engine's starting point)
    ─► supervised warm start on the synthetic task's targets (worked solutions, or answers) ─► Megatron checkpoint,
       cached ─► the RL run loads it and pushes it to the embedded engine before the first evaluation

The warm start sees a limited set on purpose (--warm-start-problems problems from --warm-start-cells) and stops at a
fixed step count, so held-out accuracy starts well below what RL on every cell's answer-only prompts can reach
(docs/trainer.md, calibration). Its cache key covers every setting that changes its result, so a changed setting
trains a new warm start and an unchanged one is reused.
"""

import hashlib
import json
import time
from pathlib import Path

import torch.distributed as dist

from megatron_dppo.actor.actor import Actor, OptimConfig
from megatron_dppo.actor.checkpoint import complete_checkpoints, save_checkpoint
from megatron_dppo.actor.step import next_token_targets
from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
from megatron_dppo.convert.mapping import model_shape
from megatron_dppo.data.synthetic import TASK_CELLS, WarmStartData, format_target, max_prompt_length, max_target_length
from megatron_dppo.data.tokenizer import CharTokenizer
from megatron_dppo.launch.arguments import EMBEDDED_HEAD_DIM
from megatron_dppo.pipeline.packing import TrainingSample, build_thd_batch, pack

POSITION_MULTIPLE = 64
WARM_START_RECORD = "warm_start.json"  # beside the warm-start checkpoint: its steps and training seconds


def rl_cells(args) -> tuple[str, ...]:
    return tuple(args.data_synthetic_cells or TASK_CELLS[args.synthetic_task])


def warm_start_cells(args) -> tuple[str, ...]:
    return tuple(args.warm_start_cells or rl_cells(args))


def tiny_model(args) -> dict:
    """The tiny Qwen2-style model's shape; its context fits the longest prompt and response of any cell in use."""
    cells = rl_cells(args) + warm_start_cells(args)
    longest = max_prompt_length(cells) + max(args.rollout_max_response_len,
                                             max_target_length(cells, args.synthetic_task))
    heads = args.embedded_hidden_size // EMBEDDED_HEAD_DIM
    return dict(architecture="qwen2", hidden_size=args.embedded_hidden_size, num_layers=args.embedded_num_layers,
                num_heads=heads, num_kv_heads=heads, ffn_hidden_size=4 * args.embedded_hidden_size,
                tie_word_embeddings=True, max_position_embeddings=-(-longest // POSITION_MULTIPLE) * POSITION_MULTIPLE)


def cache_key(args, vocab_size: int, world_size: int) -> str:
    """A short hash of every setting that changes the initial model or the warm start trained from it."""
    settings = {"model": tiny_model(args), "vocab": vocab_size, "steps": args.warm_start_steps,
                "lr": args.warm_start_lr, "batch": args.warm_start_batch_size, "seed": args.seed,
                "tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
                "world": world_size, "task": args.synthetic_task, "cells": warm_start_cells(args),
                "problems": args.warm_start_problems, "version": 2}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def prepare(args) -> tuple[Path, CharTokenizer, Path]:
    """(HF model dir for the engine and the actor, tokenizer, warm-start checkpoint dir); every rank calls."""
    tokenizer = CharTokenizer.for_synthetic_task()
    root = Path(args.cache_dir) / f"embedded_{cache_key(args, tokenizer.vocab_size, dist.get_world_size())}"
    model_dir = root / "init"
    if dist.get_rank() == 0 and not (model_dir / "config.json").is_file():
        tokenizer.save_random_model(model_dir, seed=args.seed, **tiny_model(args))
    dist.barrier()
    warm_dir = root / "warm_start"
    if not complete_checkpoints(warm_dir):
        supervised_warm_start(args, model_dir, tokenizer, warm_dir)
    return model_dir, tokenizer, warm_dir


def supervised_warm_start(args, model_dir: Path, tokenizer: CharTokenizer, out_dir: Path) -> None:
    """Next-token cross-entropy on the targets (worked solutions, or answers) of the warm start's problems, then a
    model-only checkpoint."""
    from megatron.core import parallel_state

    hf_config = json.loads((model_dir / "config.json").read_text())
    checkpoint = HFCheckpoint(model_dir)
    actor = Actor(model_shape(hf_config), args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  "fp32", OptimConfig(lr=args.warm_start_lr, lr_warmup_iters=100, clip_grad=1.0,
                                      lr_decay_iters=args.warm_start_steps), checkpoint,
                  transformer_impl=args.transformer_impl)
    problems = WarmStartData(args.seed, warm_start_cells(args), args.warm_start_problems)  # the same on every rank
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    progress = None
    if dist.get_rank() == 0:
        from tqdm import tqdm

        progress = tqdm(total=args.warm_start_steps, desc="warm start", unit="step")
    start = time.perf_counter()
    for _ in range(args.warm_start_steps):
        samples = [TrainingSample(tokenizer.encode(p.prompt), tokenizer.encode(format_target(p, args.synthetic_task)))
                   for p in problems.sample(args.warm_start_batch_size)]
        total_tokens = sum(len(s.response_ids) for s in samples)
        bins = pack([s.num_tokens for s in samples], args.max_tokens_per_gpu, args.packing_window, dp_size)[dp_rank]
        batches = [build_thd_batch(samples, b, pad_token_id=tokenizer.pad_token_id) for b in bins]

        def loss_fn(batch, output, total_tokens=total_tokens):
            logprobs, _ = output.logprobs(next_token_targets(batch))
            return -(logprobs * batch.loss_mask).sum() / total_tokens, {}

        actor.train_step(batches, loss_fn)
        if progress is not None:
            progress.update(1)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress.close()
    save_checkpoint(out_dir, 0, {"model": actor.model.sharded_state_dict()}, hf_config)
    if dist.get_rank() == 0:  # its own cost, for a supervised control that spends the same time (bench/)
        (out_dir / WARM_START_RECORD).write_text(json.dumps({"steps": args.warm_start_steps, "seconds": seconds}))

"""The embedded default: everything the no-argument CPU run needs, built locally and cached.

    character tokenizer + tiny Qwen2-style config ─► random HF model (the engine's starting point)
    ─► supervised warm start on the synthetic task (stopped early on purpose) ─► Megatron checkpoint, cached
    ─► the RL run loads it and pushes it to the embedded engine before the first evaluation

The warm start is stopped at a fixed step count that leaves the model around 20-25% held-out accuracy, where RL has
room to climb (../shared research notes: calibration). Its cache key covers every setting that changes its result,
so a changed setting trains a new warm start and an unchanged one is reused.
"""

import hashlib
import json
from pathlib import Path

import torch.distributed as dist

from megatron_dppo.actor.actor import Actor, OptimConfig
from megatron_dppo.actor.checkpoint import complete_checkpoints, save_checkpoint
from megatron_dppo.actor.step import next_token_targets
from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
from megatron_dppo.convert.mapping import model_shape
from megatron_dppo.data.synthetic import DEFAULT_CELLS, SyntheticArithmetic, format_target
from megatron_dppo.data.tokenizer import CharTokenizer
from megatron_dppo.packing import TrainingSample, build_thd_batch, pack

TINY_MODEL = dict(architecture="qwen2", hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=4,
                  ffn_hidden_size=512, tie_word_embeddings=True, max_position_embeddings=64)


def _cache_key(args, tokenizer: CharTokenizer) -> str:
    settings = {"model": TINY_MODEL, "vocab": tokenizer.vocab_size, "steps": args.warm_start_steps,
                "lr": args.warm_start_lr, "batch": args.warm_start_batch_size, "seed": args.seed,
                "tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
                "world": dist.get_world_size(), "cells": args.data_synthetic_cells, "version": 1}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def prepare(args) -> tuple[Path, CharTokenizer, Path]:
    """(HF model dir for the engine and the actor, tokenizer, warm-start checkpoint dir); every rank calls."""
    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config

    tokenizer = CharTokenizer.for_synthetic_task()
    root = Path(args.cache_dir) / f"embedded_{_cache_key(args, tokenizer)}"
    model_dir = root / "init"
    if dist.get_rank() == 0 and not (model_dir / "config.json").is_file():
        config = tiny_hf_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                **TINY_MODEL)
        save_random_hf_model(config, model_dir, seed=args.seed)
        tokenizer.save_pretrained(model_dir)
    dist.barrier()
    warm_dir = root / "warm_start"
    if not complete_checkpoints(warm_dir):
        supervised_warm_start(args, model_dir, tokenizer, warm_dir)
    return model_dir, tokenizer, warm_dir


def supervised_warm_start(args, model_dir: Path, tokenizer: CharTokenizer, out_dir: Path) -> None:
    """Next-token cross-entropy on the answers of fresh synthetic problems, then a model-only checkpoint."""
    from megatron.core import parallel_state

    hf_config = json.loads((model_dir / "config.json").read_text())
    checkpoint = HFCheckpoint(model_dir)
    actor = Actor(model_shape(hf_config), args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  "fp32", OptimConfig(lr=args.warm_start_lr, lr_warmup_iters=100, clip_grad=1.0,
                                      lr_decay_iters=args.warm_start_steps), checkpoint)
    problems = SyntheticArithmetic(args.seed, args.data_synthetic_cells or DEFAULT_CELLS)  # the same on every rank
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    progress = None
    if dist.get_rank() == 0:
        from tqdm import tqdm

        progress = tqdm(total=args.warm_start_steps, desc="warm start", unit="step")
    for _ in range(args.warm_start_steps):
        samples = [TrainingSample(tokenizer.encode(p.prompt), tokenizer.encode(format_target(p)))
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
    if progress is not None:
        progress.close()
    save_checkpoint(out_dir, 0, {"model": actor.model.sharded_state_dict()}, hf_config)

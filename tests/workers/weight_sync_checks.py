"""Megatron actor (torchrun, 2 ranks) → embedded rollout engine in another process, end to end.

Usage: torchrun --nproc-per-node 2 weight_sync_checks.py --models DIR --tp 2 --pp 1 --checks engine_sync
       [--layouts 2x1,1x2]
The model is DIR/qwen3 (tied embeddings, q/k norm, head_dim != hidden / heads). Rank 0 starts the embedded engine
from the ORIGINAL HF directory once. For each TP x PP layout of --layouts (default: --tp x --pp), in order:
  build the Actor from HF_DIR, take one optimizer step (every weight moves away from the engine's),
  every rank iterates actor.hf_tensors() while rank 0 runs WeightSyncer.sync(version = layout index),
  then the engine's probe log-probs, its greedy and sampled generations and its weight version are checked
  against the Megatron actor's own forward pass (log-probs and argmax, every rank participating).
Each passing check prints `CHECK <name> ok <details>` on rank 0; any failure raises.
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.workers.common import log, run_checks

LOGPROB_TOL = 1e-5  # fp32, the same model computed by Megatron (TP/PP) and transformers: observed ~1e-7
LR = 1e-2  # one Adam step moves every weight by ~LR, far above the tolerance in the log-probs
PROBES = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [99, 0, 17]]
GENERATE_PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]
NEW_TOKENS = 6
BUCKET_BYTES = 64 * 1024  # the tiny model then needs several buckets


def packed_batch(sequences):
    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    return SimpleNamespace(tokens=torch.tensor([t for s in sequences for t in s])[None], cu_seqlens=cu_seqlens)


def megatron_scores(actor, sequences, vocab):
    """Per sequence: (next-token log-probs [len-1], argmax over the real vocabulary [len-1]) from the Megatron
    actor; every rank calls this (TP/PP collectives); the result is returned on every rank."""
    from megatron.core import parallel_state

    from megatron_dppo.actor.step import next_token_targets, run_micro_batches

    def loss_fn(micro_batch, output):
        logprobs, _ = output.logprobs(next_token_targets(micro_batch))
        logits = output.logits()[0]  # [T, V/tp]
        group = parallel_state.get_tensor_model_parallel_group()
        shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, logits.contiguous(), group=group)
        argmax = torch.cat(shards, dim=-1)[:, :vocab].argmax(dim=-1)
        return logprobs.sum() * 0.0, {"logprobs": logprobs, "argmax": argmax}

    batch = packed_batch(sequences)
    actor.model.eval()
    with torch.no_grad():
        outputs = run_micro_batches([actor.ddp], [batch], loss_fn, forward_only=True)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outputs[0] if outputs else None)
    result = next(item for item in gathered if item is not None)
    bounds = batch.cu_seqlens.tolist()
    return [(result["logprobs"][a:b - 1], result["argmax"][a:b - 1]) for a, b in zip(bounds[:-1], bounds[1:])]


def engine_probe_logprobs(url):
    """The engine's input log-probs of PROBES: position i scores token i given tokens < i (position 0 has none)."""
    from megatron_dppo.rollout.client import control_request

    body = control_request(url, "/generate", {"input_ids": PROBES, "sampling_params": {"max_new_tokens": 0},
                                              "return_logprob": True, "logprob_start_len": 0})
    return [torch.tensor([entry[0] for entry in output["meta_info"]["input_token_logprobs"][1:]]) for output in body]


def engine_generate(url, temperature):
    from megatron_dppo.rollout.client import control_request

    params = {"temperature": temperature, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "sampling_seed": 7}
    return control_request(url, "/generate", {"input_ids": GENERATE_PROMPTS, "sampling_params": params,
                                              "return_logprob": True})


def train_one_step(actor, vocab, seed):
    from megatron_dppo.actor.step import next_token_targets

    def loss_fn(micro_batch, output):
        logprobs, _ = output.logprobs(next_token_targets(micro_batch))
        return -logprobs.sum() / logprobs.numel(), {}

    generator = torch.Generator().manual_seed(seed)  # a batch per layout: each sync brings new weights
    sequences = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (7, 4, 10, 6)]
    actor.train_step([packed_batch(sequences)], loss_fn)


def sync_from_actor(actor, syncer, version):
    """Every rank iterates actor.hf_tensors() (TP gathers and PP sends run inside the generator) while the rank that
    exports runs syncer.sync; returns its SyncStats there, None elsewhere."""
    from megatron_dppo.actor.export import is_export_source

    tensors = actor.hf_tensors()
    stats = None
    if is_export_source():
        stats = syncer.sync(tensors, version)
    else:
        for _ in tensors:
            pass
    dist.barrier()
    return stats


def check_layout(model_dir, tp, pp, version, engine, syncer, hf_tensor_count):
    """One layout: train, sync, and compare the engine with the Megatron actor (see the module docstring)."""
    from megatron.core import parallel_state

    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
    from megatron_dppo.rollout.client import control_request

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    checkpoint = HFCheckpoint(model_dir)
    vocab = checkpoint.shape.vocab_size
    actor = Actor(checkpoint.shape, tp, pp, "fp32", OptimConfig(lr=LR), hf_checkpoint=checkpoint)
    train_one_step(actor, vocab, seed=version)
    trained = megatron_scores(actor, PROBES, vocab)
    rank0 = dist.get_rank() == 0
    before = engine_probe_logprobs(engine.url) if rank0 else None

    stats = sync_from_actor(actor, syncer, version)
    if rank0:
        assert stats.tensors == hf_tensor_count and stats.buckets > 1, stats
        after = engine_probe_logprobs(engine.url)
        worst, moved = 0.0, 0.0
        for got, old, (want, _) in zip(after, before, trained):
            worst = max(worst, (got - want).abs().max().item())
            moved = max(moved, (old - want).abs().max().item())
        assert worst < LOGPROB_TOL, f"tp={tp} pp={pp}: engine vs Megatron probe log-probs differ by {worst}"
        assert moved > 100 * LOGPROB_TOL, f"the optimizer step moved the probe log-probs by only {moved}"
        info = control_request(engine.url, "/model_info", None, "GET")
        assert info["weight_version"] == str(version), (info["weight_version"], version)
        log(f"CHECK synced_logprobs_tp{tp}_pp{pp} ok max_abs_diff={worst:.1e} before_sync_diff={moved:.1e} "
            f"{stats.tensors} tensors in {stats.buckets} buckets, weight_version={info['weight_version']}")
    generated = [engine_generate(engine.url, temperature) if rank0 else None for temperature in (0.0, 1.0)]
    dist.broadcast_object_list(generated, src=0)
    for temperature, outputs in zip((0.0, 1.0), generated):
        sequences = [prompt + out["output_ids"] for prompt, out in zip(GENERATE_PROMPTS, outputs)]
        scores = megatron_scores(actor, sequences, vocab)
        if not rank0:
            continue
        worst = 0.0
        for prompt, out, (logprobs, argmax) in zip(GENERATE_PROMPTS, outputs, scores):
            assert len(out["output_ids"]) == NEW_TOKENS, out
            assert out["meta_info"]["weight_version"] == str(version), out["meta_info"]
            positions = slice(len(prompt) - 1, len(prompt) - 1 + NEW_TOKENS)
            engine_logprobs = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
            # greedy log-probs are the raw logits' log-softmax, sampled ones log_softmax(logits / 1.0): both are
            # the model's own log-probs, which the trainer recomputes
            worst = max(worst, (engine_logprobs - logprobs[positions]).abs().max().item())
            if temperature == 0.0:
                assert out["output_ids"] == argmax[positions].tolist(), (out["output_ids"], argmax[positions])
        assert worst < LOGPROB_TOL, f"temperature {temperature}: generated-token log-probs differ by {worst}"
        kind = "greedy_equals_megatron_argmax" if temperature == 0.0 else "sampled_logprobs"
        log(f"CHECK generation_{kind}_tp{tp}_pp{pp} ok max_abs_diff={worst:.1e}")
    del actor


def check_engine_sync(args):
    """Every layout's trained weights reach the engine, which then scores and generates as the actor does."""
    from safetensors import safe_open

    from megatron_dppo.rollout.launcher import launch_embedded_engine
    from megatron_dppo.rollout.weight_sync import WeightSyncer

    model_dir = f"{args.models}/qwen3"
    layouts = [tuple(map(int, layout.split("x"))) for layout in (args.layouts or f"{args.tp}x{args.pp}").split(",")]
    engine = syncer = None
    if dist.get_rank() == 0:
        engine = launch_embedded_engine(model_dir, startup_timeout_s=120, threads=1)
        syncer = WeightSyncer([engine.url], bucket_bytes=BUCKET_BYTES, timeout_s=120)
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        hf_tensor_count = len(list(f.keys()))
    try:
        for version, (tp, pp) in enumerate(layouts, start=1):
            check_layout(model_dir, tp, pp, version, engine, syncer, hf_tensor_count)
    finally:
        if engine is not None:
            syncer.destroy_group()
            engine.stop()


CHECKS = {"engine_sync": check_engine_sync}


if __name__ == "__main__":
    run_checks(CHECKS, ("--layouts",))

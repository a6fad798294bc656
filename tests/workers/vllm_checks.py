"""Megatron actor (torchrun, TP=2) → a real vLLM server started by the test, through vLLM's worker-extension path.

Usage: torchrun --nproc-per-node 2 vllm_checks.py --models MODEL_DIR --tp 2 --checks vllm_sync --vllm-url URL
For versions 1 and 2, in order: one optimizer step of the TP=2 actor (every weight moves), then
  - before the sync, vLLM's prompt log-probs of fixed probes differ from the trained actor's;
  - every rank iterates actor.hf_tensors() while rank 0 runs WeightSyncer(control=VLLMControl()).sync;
  - after it, vLLM's probe log-probs equal the actor's, vLLM's workers report the new version;
  - seeded sampling (n=3): vLLM's per-token log-probs equal the actor's log-probs of the same tokens, the same seeds
    give the same tokens again; greedy generation equals Megatron's argmax.
Each passing check prints `CHECK <name> ok <details>` on rank 0; any failure raises.
"""

import torch
import torch.distributed as dist

from tests.workers.common import log, run_checks
from tests.workers.weight_sync_checks import (
    GENERATE_PROMPTS,
    NEW_TOKENS,
    PROBES,
    megatron_scores,
    sync_from_actor,
    train_one_step,
)

# fp32 on both sides: Megatron's TP=2 forward vs vLLM's CPU kernels (oneDNN GEMMs, its own attention); the same
# comparison against transformers is ~5e-7 here, so 1e-5 leaves a wide margin and is still far below what one
# optimizer step moves (checked: > 100x the tolerance)
LOGPROB_TOL = 1e-5
LR = 1e-2
BUCKET_BYTES = 64 * 1024  # several buckets for the tiny model
SAMPLES = 3


def vllm_probe_logprobs(url):
    """vLLM's prompt log-probs of PROBES: position i scores token i given tokens < i (position 0 has none)."""
    from megatron_dppo.rollout.client import control_request

    scores = []
    for probe in PROBES:
        body = control_request(url, "/v1/completions", {"prompt": probe, "max_tokens": 1, "prompt_logprobs": 0})
        entries = body["choices"][0]["prompt_logprobs"][1:]
        scores.append(torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(entries, probe[1:])]))
    return scores


def max_gap(left, right):
    return max((a - b).abs().max().item() for a, b in zip(left, right))


def check_version(version, actor, vocab, syncer, client, url, hf_tensor_count):
    from megatron_dppo.rollout.client import SamplingParams

    rank0 = dist.get_rank() == 0
    train_one_step(actor, vocab, seed=version)
    trained = [logprobs for logprobs, _ in megatron_scores(actor, PROBES, vocab)]
    before = vllm_probe_logprobs(url) if rank0 else None

    stats = sync_from_actor(actor, syncer, version)
    if rank0:
        assert stats.tensors == hf_tensor_count and stats.buckets > 1, stats
        moved = max_gap(before, trained)
        worst = max_gap(vllm_probe_logprobs(url), trained)
        assert moved > 100 * LOGPROB_TOL, f"before the sync vLLM and the trained actor differ by only {moved}"
        assert worst < LOGPROB_TOL, f"after the sync vLLM's probe log-probs differ from the actor's by {worst}"
        reported = syncer.engines.control(url, "/model_info", None, "GET")["weight_version"]
        assert reported == str(version) == stats.weight_version, (reported, version, stats)
        log(f"CHECK vllm_synced_logprobs_v{version} ok max_abs_diff={worst:.1e} before_sync_diff={moved:.1e} "
            f"{stats.tensors} tensors in {stats.buckets} buckets, weight_version={reported}")

    sampled = greedy = None
    if rank0:
        seeded = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=100 + version)
        sampled = client.generate(GENERATE_PROMPTS, seeded, n=SAMPLES)
        again = client.generate(GENERATE_PROMPTS, seeded, n=SAMPLES)
        assert [c.output_ids for c in again] == [c.output_ids for c in sampled], "same seeds, different tokens"
        assert len({tuple(c.output_ids) for c in sampled}) > len(GENERATE_PROMPTS), "the n samples do not differ"
        greedy = client.generate(GENERATE_PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS), n=1)
    outputs = [sampled, greedy]
    dist.broadcast_object_list(outputs, src=0)
    sampled, greedy = outputs
    for kind, completions in (("sampled", sampled), ("greedy", greedy)):
        prompts = [GENERATE_PROMPTS[c.prompt_index] for c in completions]
        scores = megatron_scores(actor, [p + c.output_ids for p, c in zip(prompts, completions)], vocab)
        if not rank0:
            continue
        worst = 0.0
        for prompt, completion, (logprobs, argmax) in zip(prompts, completions, scores):
            assert len(completion.output_ids) == NEW_TOKENS, completion
            positions = slice(len(prompt) - 1, len(prompt) - 1 + NEW_TOKENS)
            worst = max(worst, (torch.tensor(completion.output_logprobs) - logprobs[positions]).abs().max().item())
            if kind == "greedy":
                assert completion.output_ids == argmax[positions].tolist(), (completion.output_ids, argmax[positions])
        assert worst < LOGPROB_TOL, f"{kind}: vLLM's generated-token log-probs differ from the actor's by {worst}"
        extra = "_equals_megatron_argmax" if kind == "greedy" else f"_n{SAMPLES}_seeded_reproducible"
        log(f"CHECK vllm_generation_{kind}{extra}_v{version} ok max_abs_diff={worst:.1e}")


def check_vllm_sync(args):
    from safetensors import safe_open

    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
    from megatron_dppo.rollout.client import RolloutClient
    from megatron_dppo.rollout.vllm import VLLMCompletionsAPI, VLLMControl
    from megatron_dppo.rollout.weight_sync import WeightSyncer

    checkpoint = HFCheckpoint(args.models)
    vocab = checkpoint.shape.vocab_size
    actor = Actor(checkpoint.shape, args.tp, args.pp, "fp32", OptimConfig(lr=LR), hf_checkpoint=checkpoint)
    with safe_open(f"{args.models}/model.safetensors", "pt") as f:
        hf_tensor_count = len(list(f.keys()))
    syncer = client = None
    if dist.get_rank() == 0:
        syncer = WeightSyncer([args.vllm_url], bucket_bytes=BUCKET_BYTES, timeout_s=120, control=VLLMControl())
        client = RolloutClient([args.vllm_url], api=VLLMCompletionsAPI(), request_timeout_s=120)
    try:
        for version in (1, 2):
            check_version(version, actor, vocab, syncer, client, args.vllm_url, hf_tensor_count)
    finally:
        if syncer is not None:
            syncer.destroy_group()


CHECKS = {"vllm_sync": check_vllm_sync}


if __name__ == "__main__":
    run_checks(CHECKS, ("--vllm-url",))

"""The trainer's log-probs at the rollout temperature against a rollout engine's, for tests/test_rollout_temperature.py
and tests/test_vllm_backend.py.

Usage: torchrun --nproc-per-node 2 temperature_checks.py --models MODEL_DIR --tp 2 --checks engine_temperature
       --engine-url URL --api sglang|vllm
The engine serves MODEL_DIR's weights, which the Megatron actor (TP=2, fp32) loads too. For temperatures 0.6, 1.0
and 0 (greedy), rank 0 samples seeded responses through RolloutClient (the trainer's client, with the backend's API);
every rank then computes the responses' log-probs as the trainer does (actor.forward with
logprob_loss_fn(temperature=t), the pass compute_old_logprobs runs; the update's loss calls the same
OutputLayerInput.logprobs). Checks, on rank 0:
  - at each temperature the engine's per-token log-probs equal the trainer's to LOGPROB_TOL;
  - at 0.6 the untempered log-probs (what the trainer computed before it divided by the temperature) differ from the
    engine's by more than 100 x LOGPROB_TOL: the check sees a trainer that ignores the temperature.
Each passing check prints `CHECK <name> ok <details>`; any failure raises.
"""

import torch
import torch.distributed as dist

from tests.workers.common import log, run_checks
from tests.workers.weight_sync_checks import GENERATE_PROMPTS, packed_batch

# fp32 on both sides, the same tolerance as the other engine-vs-trainer log-prob checks (weight_sync_checks.py,
# vllm_checks.py): observed ~1e-7 (embedded) and ~5e-7 (vLLM's CPU kernels)
LOGPROB_TOL = 1e-5
NEW_TOKENS = 8
SAMPLES = 3
TEMPERATURES = (0.6, 1.0, 0.0)


def trainer_logprobs(actor, sequences, temperature):
    """Per sequence: the next-token log-probs [len - 1] at `temperature`, as the trainer's forward-only pass computes
    them; returned on every rank."""
    from megatron_dppo.actor.step import logprob_loss_fn

    batch = packed_batch(sequences)
    actor.model.eval()
    with torch.no_grad():
        outputs = actor.forward([batch], logprob_loss_fn(temperature=temperature))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outputs[0]["logprobs"] if outputs else None)
    logprobs = next(item for item in gathered if item is not None)
    bounds = batch.cu_seqlens.tolist()
    return [logprobs[a:b - 1] for a, b in zip(bounds[:-1], bounds[1:])]


def response_gap(completions, logprobs) -> float:
    """The largest |engine - trainer| over every response token."""
    worst = 0.0
    for completion, sequence_logprobs in zip(completions, logprobs):
        prompt_length = len(GENERATE_PROMPTS[completion.prompt_index])
        trainer = sequence_logprobs[prompt_length - 1:prompt_length - 1 + len(completion.output_ids)]
        worst = max(worst, (torch.tensor(completion.output_logprobs) - trainer).abs().max().item())
    return worst


def check_engine_temperature(args):
    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
    from megatron_dppo.rollout.client import RolloutClient, SamplingParams, SGLangGenerateAPI
    from megatron_dppo.rollout.vllm import VLLMCompletionsAPI

    checkpoint = HFCheckpoint(args.models)
    actor = Actor(checkpoint.shape, args.tp, args.pp, "fp32", OptimConfig(lr=1e-3), hf_checkpoint=checkpoint)
    rank0 = dist.get_rank() == 0
    api = VLLMCompletionsAPI() if args.api == "vllm" else SGLangGenerateAPI()
    client = RolloutClient([args.engine_url], api=api, request_timeout_s=120) if rank0 else None
    for temperature in TEMPERATURES:
        samples = SAMPLES if temperature > 0 else 1  # vLLM refuses n > 1 with greedy sampling
        completions = [client.generate(GENERATE_PROMPTS, SamplingParams(temperature=temperature,
                                                                        max_new_tokens=NEW_TOKENS, seed=21),
                                       n=samples) if rank0 else None]
        dist.broadcast_object_list(completions, src=0)
        completions = completions[0]
        sequences = [GENERATE_PROMPTS[c.prompt_index] + c.output_ids for c in completions]
        tempered = trainer_logprobs(actor, sequences, temperature)
        untempered = trainer_logprobs(actor, sequences, 1.0) if temperature == 0.6 else None
        if not rank0:
            continue
        assert all(c.output_ids for c in completions), "the engine returned an empty response"
        gap = response_gap(completions, tempered)
        assert gap < LOGPROB_TOL, (f"{args.api} at temperature {temperature}: the engine's log-probs differ from the "
                                   f"trainer's by {gap}")
        details = f"max_abs_diff={gap:.1e} over {sum(len(c.output_ids) for c in completions)} tokens"
        if untempered is not None:
            ignored = response_gap(completions, untempered)
            assert ignored > 100 * LOGPROB_TOL, f"the untempered log-probs differ by only {ignored}: the check is blind"
            details += f", untempered trainer's max_abs_diff={ignored:.1e}"
        log(f"CHECK {args.api}_temperature_{temperature}_trainer_equals_engine ok {details}")


CHECKS = {"engine_temperature": check_engine_temperature}


if __name__ == "__main__":
    run_checks(CHECKS, ("--engine-url", "--api"))

"""Activation recompute (Megatron-LM's --recompute-granularity/-method/-num-layers) against none, at TP 1 and TP 2.

Usage: torchrun --nproc-per-node 2 recompute_checks.py --models DIR --checks recompute_equals_none

For each layout (TP 1 = DP 2, then TP 2), an actor without recompute and one per recompute setting load the same
Qwen3 weights and run forward and backward on the same packed micro-batches (two, so gradients accumulate); the loss
and every parameter's gradient (DDP's main_grad, after the data-parallel reduction) must be equal, and the recompute
must have happened: forward hooks count the runs of the first layer and of its core attention per micro-batch (2
where recomputed, 1 where kept). Prints
`CHECK recompute_equals_none_tp<T> ok <settings>` on rank 0; a difference raises, naming the parameter.
"""

import torch

from tests.workers.actor_checks import packed_batch, random_sequences, reset_parallel
from tests.workers.common import run_checks

SETTINGS = {  # name: (granularity, method, num_layers), and the forward runs per micro-batch of (layer 0, layer 1,
    # layer 0's core attention) that prove the recompute happened (the model has 2 layers)
    "full-uniform-1": (("full", "uniform", 1), (2, 2, 2)),
    "full-uniform-2": (("full", "uniform", 2), (2, 2, 2)),
    "full-block-1": (("full", "block", 1), (2, 1, 2)),
    "selective": (("selective", None, None), (1, 1, 2)),
}
KEPT = (1, 1, 1)  # without recompute
# fp32 on the CPU: the recomputed forward runs the same kernels on the same inputs in the same order, so the loss and
# the gradients are bitwise those of the run that kept its activations (any tolerance would hide a wrong RNG or input)
TOLERANCE = 0.0


def loss_and_gradients(model_dir, tp: int, recompute) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple]:
    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.step import next_token_targets, run_micro_batches
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint

    checkpoint = HFCheckpoint(model_dir)
    actor = Actor(checkpoint.shape, tp, 1, "fp32", OptimConfig(), checkpoint, recompute=recompute)
    vocab = checkpoint.shape.vocab_size
    batches = [packed_batch(random_sequences(lengths, vocab, seed)) for seed, lengths in ((1, [5, 9, 3]), (2, [12, 4]))]
    tokens = sum(batch.tokens.shape[1] for batch in batches)

    def loss_fn(micro_batch, output):
        logprobs, entropy = output.logprobs(next_token_targets(micro_batch))
        loss = -(logprobs.sum() + 0.1 * entropy.sum()) / tokens
        return loss, {"loss": loss.detach()}

    layers = actor.model.decoder.layers
    counted = (layers[0], layers[1], layers[0].self_attention.core_attention)
    runs = [0] * len(counted)
    for index, module in enumerate(counted):
        module.register_forward_hook(lambda *_, index=index: runs.__setitem__(index, runs[index] + 1))
    actor.model.train()
    actor.ddp.zero_grad_buffer()
    outputs = run_micro_batches([actor.ddp], batches, loss_fn, forward_only=False)
    loss = sum(output["loss"] for output in outputs)
    grads = {name: param.main_grad.detach().clone() for name, param in actor.model.named_parameters()}
    return loss, grads, tuple(count // len(batches) for count in runs)


def check_recompute_equals_none(args):
    import torch.distributed as dist

    from megatron_dppo.actor.model import Recompute

    model_dir = f"{args.models}/qwen3"
    for tp in (1, 2):
        reset_parallel(tp, 1)
        loss, grads, runs = loss_and_gradients(model_dir, tp, Recompute())
        assert runs == KEPT, f"tp {tp}: without recompute the forward runs were {runs}"
        assert any(grad.abs().max() > 0 for grad in grads.values()), "no gradient reached the parameters"
        for name, (setting, expected_runs) in SETTINGS.items():
            recomputed_loss, recomputed, runs = loss_and_gradients(model_dir, tp, Recompute(*setting))
            assert runs == expected_runs, f"tp {tp} {name}: forward runs {runs}, expected {expected_runs}"
            assert (recomputed_loss - loss).abs() <= TOLERANCE, f"tp {tp} {name}: loss {recomputed_loss} != {loss}"
            for param, grad in grads.items():
                difference = (recomputed[param] - grad).abs().max().item()
                assert difference <= TOLERANCE, f"tp {tp} {name}: gradient of {param} differs by {difference}"
        if dist.get_rank() == 0:
            print(f"CHECK recompute_equals_none_tp{tp} ok {', '.join(SETTINGS)}: loss {loss.item():.6f} and "
                  f"{len(grads)} gradients equal", flush=True)


if __name__ == "__main__":
    run_checks({"recompute_equals_none": check_recompute_equals_none})

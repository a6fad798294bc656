"""Activation recompute (Megatron-LM's --recompute-granularity/-method/-num-layers) against none, and the memory plan's
activation count against what autograd saves, at TP 1 and TP 2.

Usage: torchrun --nproc-per-node 2 recompute_checks.py --models DIR --checks recompute_equals_none,saved_activations

recompute_equals_none:
For each layout (TP 1 = DP 2, then TP 2), an actor without recompute and one per recompute setting load the same
Qwen3 weights and run forward and backward on the same packed micro-batches (two, so gradients accumulate); the loss
and every parameter's gradient (DDP's main_grad, after the data-parallel reduction) must be equal, and the recompute
must have happened: forward hooks count the runs of the first layer and of its core attention per micro-batch (2
where recomputed, 1 where kept). Prints
`CHECK recompute_equals_none_tp<T> ok <settings>` on rank 0; a difference raises, naming the parameter.

saved_activations: the bytes autograd keeps for backward after one micro-batch's forward (saved-tensor hooks; each
storage once, parameters left out), on every rank, for a Qwen3 shape of 2 and of 4 layers, without recompute and
with each setting: what one more layer adds (the difference, per layer and token) must equal the memory plan's
per-layer figure (launch/memory_plan.py, the CPU's composite RMSNorm, local spec), and what the 2-layer model keeps
beyond its layers must equal the plan's embedding and output-layer terms (both up to FIXED_BYTES a layer, tensors
whose size does not grow with the tokens, and RELATIVE). Prints `CHECK saved_activations_tp<T> ok`.
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
# The plan counts bytes per token; a layer may also keep a few tensors of fixed size (selective recompute's checkpoint
# keeps a scalar), and the vocabulary-parallel log-probs a byte a token at TP 2 that the plan leaves out: the count
# allows FIXED_BYTES a layer (or outside the layers) and RELATIVE of the planned bytes
FIXED_BYTES, RELATIVE = 64, 1e-3


def close(found: float, planned: float, tokens: int) -> bool:
    return abs(found - planned) <= RELATIVE * planned + FIXED_BYTES / tokens
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


def saved_bytes(shape, tp: int, recompute, tokens: int) -> int:
    """Bytes of the storages autograd saves in one micro-batch's forward and loss (parameters left out)."""
    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.step import _forward_step, next_token_targets

    actor = Actor(shape, tp, 1, "bf16", OptimConfig(), recompute=recompute)
    parameters = {param.untyped_storage().data_ptr() for param in actor.model.parameters()}
    storages = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    lengths = [tokens // 4, tokens // 2, tokens - tokens // 4 - tokens // 2]  # three sequences of two lengths
    batch = packed_batch(random_sequences(lengths, shape.vocab_size, seed=3))
    actor.model.train()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        hidden, loss_func = _forward_step(lambda micro_batch, output: (
            output.logprobs(next_token_targets(micro_batch))[0].float().sum(), {}), iter([batch]), actor.ddp)
        loss_func(hidden)
    return sum(storages.values())


def check_saved_activations(args):
    import torch.distributed as dist

    from megatron_dppo.actor.model import Recompute
    from megatron_dppo.convert.mapping import model_shape
    from megatron_dppo.convert.tiny import tiny_hf_config
    from megatron_dppo.launch.memory_plan import (
        TrainerLayout,
        checkpoint_input_per_token,
        outside_layers_per_token,
        saved_per_token,
        selective_saving_per_token,
    )

    tokens = 512
    shapes = {layers: model_shape(tiny_hf_config(
        "qwen3", vocab_size=300, hidden_size=128, num_layers=layers, num_heads=8, num_kv_heads=2, ffn_hidden_size=384,
        head_dim=32, tie_word_embeddings=True).to_dict()) for layers in (2, 4)}
    for tp in (1, 2):
        reset_parallel(tp, 1)
        plan = TrainerLayout(shapes[2], tp=tp, dtype="bf16", tokens=tokens, transformer_impl="local", norms="composite")
        layer = sum(saved_per_token(plan).values())
        # what one more layer keeps after the forward (the recomputed unit of full recompute is alive in backward only)
        expected_per_layer = {"none": layer, "selective": layer - selective_saving_per_token(plan),
                              "full-uniform-1": checkpoint_input_per_token(plan),
                              "full-uniform-2": checkpoint_input_per_token(plan) / 2,
                              "full-block-1": layer}
        settings = {"none": (None, None, None), **{name: setting for name, (setting, _) in SETTINGS.items()}}
        found = {}
        for name, setting in settings.items():
            small, large = (saved_bytes(shapes[layers], tp, Recompute(*setting), tokens) for layers in (2, 4))
            found[name] = (large - small) / 2 / tokens
            assert close(found[name], expected_per_layer[name], tokens), (
                f"tp {tp} {name}: one layer keeps {found[name]} bytes a token, the plan says "
                f"{expected_per_layer[name]}")
            if name == "none":
                outside = small / tokens - 2 * layer
                planned = outside_layers_per_token(plan, stage=0)
                assert close(outside, planned, tokens), (
                    f"tp {tp}: outside the layers {outside} bytes a token, the plan says {planned}")
        if dist.get_rank() == 0:
            print(f"CHECK saved_activations_tp{tp} ok bytes per token and layer: "
                  + ", ".join(f"{name} {value:g}" for name, value in found.items()), flush=True)


if __name__ == "__main__":
    run_checks({"recompute_equals_none": check_recompute_equals_none, "saved_activations": check_saved_activations})

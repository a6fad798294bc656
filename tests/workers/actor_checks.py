"""Multi-process checks of the Megatron actor, grouped so one torchrun launch proves several things.

Usage: torchrun --nproc-per-node 2 actor_checks.py --models DIR --tp T --pp P --checks a,b,c [--ckpt DIR]
Each passing check prints `CHECK <name> ok <details>` on the rank(s) that verified it; any failure raises.
"""

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.workers.common import log, run_checks

ARCHS = ("qwen2", "qwen3", "llama")
LOGITS_TOL = 1e-5  # fp32, same math in a different order (TP/PP splits, fused QKV): observed ~2e-7
GRAD_RTOL = 1e-5
# The distributed optimizer supports Adam only. Adam with a tiny eps is invariant to the gradient's scale and would
# hide a wrong clip factor; with eps well above the clipped gradient elements (~1e-4) the update is nearly linear in
# the gradient, so clipping and the DP/TP/PP gradient sums show in the weights.
LR, CLIP, ADAM_EPS = 1e-3, 0.05, 1e-3



def build(model_dir, tp, pp):
    from megatron_dppo.actor.model import build_gpt_model, build_transformer_config, load_hf_weights
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint

    checkpoint = HFCheckpoint(model_dir)
    model = build_gpt_model(checkpoint.shape, build_transformer_config(checkpoint.shape, tp, pp))
    load_hf_weights(model, checkpoint)
    return model, checkpoint


def reset_parallel(tp, pp):
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def random_sequences(lengths, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=generator) for length in lengths]


def packed_batch(sequences):
    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    return SimpleNamespace(tokens=torch.cat(sequences)[None], cu_seqlens=cu_seqlens)


def padded_batch(sequences, pad_id=0):
    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = seq
    return SimpleNamespace(tokens=tokens)


def gather_tp(tensor, dim=-1):
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def check_hf_logits(args):
    """Megatron logits (packed THD input) equal transformers' per-sequence logits, for every architecture."""
    from megatron_dppo.actor.step import run_micro_batches

    for arch in ARCHS:
        reset_parallel(args.tp, args.pp)
        model, checkpoint = build(f"{args.models}/{arch}", args.tp, args.pp)
        vocab = checkpoint.shape.vocab_size
        sequences = random_sequences([5, 11, 3, 8], vocab, seed=1)
        model.eval()
        with torch.no_grad():
            outputs = run_micro_batches(model, [packed_batch(sequences)], lambda mb, output: (
                output.hidden.sum() * 0, {"logits": gather_tp(output.logits()[0])}), True)
        if outputs:
            logits = outputs[0]["logits"][:, :vocab]
            with torch.no_grad():
                reference = torch.cat([hf_model(f"{args.models}/{arch}")(s[None]).logits[0] for s in sequences])
            diff = (logits - reference).abs().max().item()
            assert diff < LOGITS_TOL, f"{arch}: megatron vs transformers logits differ by {diff}"
            log(f"CHECK hf_logits_{arch} ok max_abs_diff={diff:.2e}")


def _next_token_logprob_loss(weights, sequences, packed):
    """A weighted sum of next-token log-probs over every real position (the same terms packed or padded)."""
    from megatron_dppo.actor.step import next_token_targets

    def loss_fn(micro_batch, output):
        if packed:
            logprobs, _ = output.logprobs(next_token_targets(micro_batch), chunk_size=5)
            bounds = micro_batch.cu_seqlens.tolist()
            per_seq = [logprobs[start:stop - 1] for start, stop in zip(bounds[:-1], bounds[1:])]
        else:
            logprobs, _ = output.logprobs(torch.roll(micro_batch.tokens, -1, dims=1), chunk_size=5)  # [b, s]
            per_seq = [logprobs[row, : len(seq) - 1] for row, seq in enumerate(sequences)]
        flat = torch.cat(per_seq)
        return (flat * weights).sum(), {"logprobs": flat.detach()}

    return loss_fn


def check_packed_equals_padded(args):
    """Packed THD log-probs and their parameter gradients equal those of a padded BSHD batch."""
    from megatron_dppo.actor.step import run_micro_batches

    reset_parallel(args.tp, args.pp)
    results = {}
    sequences = random_sequences([6, 13, 2, 9], 128, seed=2)
    weights = torch.randn(sum(len(s) - 1 for s in sequences), generator=torch.Generator().manual_seed(3))
    for packed in (True, False):
        model, _ = build(f"{args.models}/qwen2", args.tp, args.pp)
        batch = packed_batch(sequences) if packed else padded_batch(sequences)
        outputs = run_micro_batches(model, [batch], _next_token_logprob_loss(weights, sequences, packed),
                                    forward_only=False)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[packed] = (outputs[0]["logprobs"] if outputs else None, grads)
    if results[True][0] is not None:
        diff = (results[True][0] - results[False][0]).abs().max().item()
        assert diff < 1e-5, f"packed vs padded log-probs differ by {diff}"
        log(f"CHECK packed_logprobs ok max_abs_diff={diff:.2e}")
    worst = 0.0
    for name, grad in results[True][1].items():
        reference = results[False][1][name]
        rel = ((grad - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, rel)
        assert rel < GRAD_RTOL, f"packed vs padded gradient of {name} differs by relative {rel}"
    log(f"CHECK packed_grads ok max_rel_diff={worst:.2e}")


def check_vocab_parallel_logprobs(args):
    """The fused output layer's log-probs and entropy, and the gradients of the hidden states (summed over the TP
    group, as Megatron's mapping sums them) and of this rank's weight slice, equal a float64 full softmax over the
    gathered logits; vocabulary padding rows take no part and get no gradient."""
    from megatron.core import parallel_state

    from megatron_dppo.actor.logprobs import output_layer_logprobs

    reset_parallel(args.tp, 1)
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    tokens, hidden_size, vocab, padded_vocab = 37, 16, 250, 256
    generator = torch.Generator().manual_seed(4)
    full_hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float64)
    full_weight = torch.randn(padded_vocab, hidden_size, generator=generator, dtype=torch.float64) * 0.8
    full_weight[vocab:] = 0.0
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    grad_lp, grad_h = torch.randn(tokens, generator=generator), torch.randn(tokens, generator=generator)

    reference_hidden = full_hidden.clone().requires_grad_(True)
    reference_weight = full_weight.clone().requires_grad_(True)
    log_softmax = torch.log_softmax((reference_hidden @ reference_weight.T)[:, :vocab], dim=-1)
    reference_lp = log_softmax.gather(1, targets[:, None]).squeeze(1)
    reference_h = -(log_softmax.exp() * log_softmax).sum(-1)
    ((reference_lp * grad_lp).sum() + (reference_h * grad_h).sum()).backward()

    width = padded_vocab // tp
    hidden = full_hidden.float().requires_grad_(True)
    weight = full_weight[rank * width:(rank + 1) * width].float().requires_grad_(True)
    logprobs, entropy = output_layer_logprobs(hidden, weight, targets, vocab, group, rank * width, chunk_size=8)
    ((logprobs * grad_lp).sum() + (entropy * grad_h).sum()).backward()
    dist.all_reduce(hidden.grad, group=group)
    diffs = {"logprob": (logprobs - reference_lp).abs().max().item(),
             "entropy": (entropy - reference_h).abs().max().item(),
             "grad_hidden": relative_diff(hidden.grad, reference_hidden.grad),
             "grad_weight": relative_diff(weight.grad, reference_weight.grad[rank * width:(rank + 1) * width])}
    assert max(diffs.values()) < 1e-5, diffs
    padding_rows = torch.arange(rank * width, (rank + 1) * width) >= vocab
    assert weight.grad[padding_rows].abs().sum() == 0, "vocabulary padding rows got a gradient"
    log(f"CHECK vocab_parallel_logprobs_tp{tp} ok " + " ".join(f"{k}={v:.1e}" for k, v in diffs.items()))


def relative_diff(tensor, reference) -> float:
    """max |tensor - reference| over max |reference|: gradients of different scales compared alike."""
    return ((tensor.double() - reference.double()).abs().max() / reference.abs().max().clamp_min(1e-12)).item()


def check_output_layer_input(args):
    """`OutputLayerInput.logprobs` against a float64 full softmax, through a real ColumnParallelLinear (the output
    layer the hidden states would meet): log-probs, entropy and the gradients of this rank's hidden states and weight
    slice, with and without sequence parallelism (the hidden states split over the sequence and gathered, their
    gradient reduce-scattered back) and with several sequences side by side ([s, b, H], b = 3). `logits()` is
    checked too: it is the unfused reference the model-level check compares with."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import custom_backward
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dppo.actor.logprobs import OutputLayerInput

    reset_parallel(args.tp, 1)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    length, batch, hidden_size, vocab, padded_vocab = 6, 3, 16, 120, 128
    generator = torch.Generator().manual_seed(10)
    full_hidden = torch.randn(length, batch, hidden_size, generator=generator, dtype=torch.float64)
    full_weight = torch.randn(padded_vocab, hidden_size, generator=generator, dtype=torch.float64) * 0.8
    full_weight[vocab:] = 0.0
    targets = torch.randint(0, vocab, (batch, length), generator=generator)
    grad_lp, grad_h = torch.randn(2, batch, length, generator=generator, dtype=torch.float64)

    reference_hidden = full_hidden.clone().requires_grad_(True)
    reference_weight = full_weight.clone().requires_grad_(True)
    reference_logits = (reference_hidden @ reference_weight.T).transpose(0, 1)  # [b, s, V]
    log_softmax = torch.log_softmax(reference_logits[..., :vocab], dim=-1)
    reference_lp = log_softmax.gather(-1, targets[..., None]).squeeze(-1)
    reference_h = -(log_softmax.exp() * log_softmax).sum(-1)
    ((reference_lp * grad_lp).sum() + (reference_h * grad_h).sum()).backward()

    width = padded_vocab // tp
    columns = slice(rank * width, (rank + 1) * width)
    for sequence_parallel in ((False, True) if tp > 1 else (False,)):
        config = TransformerConfig(num_layers=1, hidden_size=hidden_size, num_attention_heads=tp,
                                   tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                                   use_cpu_initialization=True)
        layer = ColumnParallelLinear(hidden_size, padded_vocab, config=config, init_method=config.init_method,
                                     bias=False, gather_output=False)
        with torch.no_grad():
            layer.weight.copy_(full_weight[columns])
        rows = slice(rank * length // tp, (rank + 1) * length // tp) if sequence_parallel else slice(None)
        hidden = full_hidden[rows].float().requires_grad_(True)
        output = OutputLayerInput(hidden, layer, layer.weight, vocab)
        logprobs, entropy = output.logprobs(targets, chunk_size=4)
        # Straight into the autograd engine, as Megatron's schedule can (custom_backward): torch's backward() entry
        # points run inside the CPU mode's own handler, where the mode is off, and the sequence-parallel
        # reduce-scatter's buffer would ask for a CUDA device.
        custom_backward((logprobs * grad_lp.float()).sum() + (entropy * grad_h.float()).sum(), None)
        diffs = {"logprob": (logprobs - reference_lp).abs().max().item(),
                 "entropy": (entropy - reference_h).abs().max().item(),
                 "grad_hidden": relative_diff(hidden.grad, reference_hidden.grad[rows]),
                 "grad_weight": relative_diff(layer.weight.grad, reference_weight.grad[columns]),
                 "logits": (output.logits().detach() - reference_logits[..., columns]).abs().max().item()}
        assert max(diffs.values()) < 1e-5, (sequence_parallel, diffs)
        log(f"CHECK output_layer_input_sp{int(sequence_parallel)} ok tp={tp} "
            + " ".join(f"{k}={v:.1e}" for k, v in diffs.items()))


def check_fused_equals_unfused(args):
    """The actor's fused output layer and log-probs equal GPTModel's own output layer (logits [T, V/tp], gathered
    over TP) followed by a full log-softmax: per-token log-probs, entropy and every parameter's gradient, for an
    untied (qwen2) and a tied (qwen3) model. (Sequence parallelism is checked at the output layer by
    check_output_layer_input: megatron's local layer spec, the CPU one, refuses it.)"""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_dppo.actor.step import next_token_targets, run_micro_batches

    def fused(micro_batch, output):
        return output.logprobs(next_token_targets(micro_batch), chunk_size=7)

    def unfused(micro_batch, output):
        logits = gather_from_tensor_model_parallel_region(output.logits()[0])[:, :output.vocab_size]  # [T, V]
        log_softmax = torch.log_softmax(logits, dim=-1)
        logprobs = log_softmax.gather(1, next_token_targets(micro_batch)[:, None]).squeeze(1)
        return logprobs, -(log_softmax.exp() * log_softmax).sum(-1)

    sequences = random_sequences([6, 13, 3, 8], 100, seed=9)
    weights = torch.randn(2, sum(len(s) for s in sequences), generator=torch.Generator().manual_seed(8))
    for arch in ("qwen2", "qwen3"):
        reset_parallel(args.tp, args.pp)
        results = {}
        for name, head in (("fused", fused), ("unfused", unfused)):
            model, _ = build(f"{args.models}/{arch}", args.tp, args.pp)

            def loss_fn(micro_batch, output, head=head):
                logprobs, entropy = head(micro_batch, output)
                loss = (logprobs * weights[0]).sum() + (entropy * weights[1]).sum()
                return loss, {"logprobs": logprobs.detach(), "entropy": entropy.detach()}

            outputs = run_micro_batches(model, [packed_batch(sequences)], loss_fn, forward_only=False)
            results[name] = (outputs[0] if outputs else None,
                             {key: p.grad.clone() for key, p in model.named_parameters()})
        what = f"{arch} tp={args.tp} pp={args.pp}"
        (fused_out, fused_grads), (unfused_out, unfused_grads) = results["fused"], results["unfused"]
        value_diff = 0.0
        if fused_out is not None:
            value_diff = max((fused_out[key] - unfused_out[key]).abs().max().item() for key in fused_out)
            assert value_diff < 1e-5, f"{what}: fused vs unfused log-probs/entropy differ by {value_diff}"
        assert fused_grads.keys() == unfused_grads.keys()
        grad_diff = max(relative_diff(fused_grads[key], unfused_grads[key]) for key in fused_grads)
        assert grad_diff < GRAD_RTOL, f"{what}: fused vs unfused gradients differ by relative {grad_diff}"
        log(f"CHECK fused_equals_unfused_{arch} ok {what} values={value_diff:.1e} grads_rel={grad_diff:.1e}")


def export_hf_state(model):
    """The model as HF-named full tensors on the export source rank ({} elsewhere), through actor/export.py."""
    from megatron_dppo.actor.export import iter_hf_tensors

    return dict(iter_hf_tensors(model))


def check_training_matches_reference(args):
    """Megatron DDP + distributed optimizer + grad clipping over TP/PP/DP on the CPU takes the same Adam steps as a
    single-process transformers model trained on the full batch; then dist_checkpointing saves the result."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dppo.actor.step import finalize_grads_without_token_scaling, next_token_targets, run_micro_batches

    reset_parallel(args.tp, args.pp)
    model_dir = f"{args.models}/qwen3"
    model, checkpoint = build(model_dir, args.tp, args.pp)
    vocab = checkpoint.shape.vocab_size
    config = model.config
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    config.finalize_model_grads_func = finalize_grads_without_token_scaling
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, adam_eps=ADAM_EPS, weight_decay=0.0, clip_grad=CLIP,
                        params_dtype=torch.float32, use_distributed_optimizer=True), [ddp])
    all_sequences = random_sequences([7, 4, 10, 6, 5, 9, 3, 8], vocab, seed=5)
    total_tokens = sum(len(s) - 1 for s in all_sequences)
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = [all_sequences[i] for i in range(len(all_sequences)) if i % dp_size == dp_rank]
    micro_batches = [packed_batch(mine[i:i + 2]) for i in range(0, len(mine), 2)]

    def loss_fn(micro_batch, output):
        logprobs, _ = output.logprobs(next_token_targets(micro_batch))
        bounds = micro_batch.cu_seqlens.tolist()
        kept = torch.cat([logprobs[a:b - 1] for a, b in zip(bounds[:-1], bounds[1:])])
        return -kept.sum() / total_tokens, {}

    steps, grad_norms = 3, []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run_micro_batches([ddp], micro_batches, loss_fn, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        grad_norms.append(grad_norm)

    reference = hf_model(model_dir).train()
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=LR, eps=ADAM_EPS)
    for step in range(steps):
        reference_optimizer.zero_grad()
        loss = sum(-torch.log_softmax(reference(s[None]).logits[0, :-1], -1).gather(1, s[1:, None]).sum()
                   for s in all_sequences) / total_tokens
        loss.backward()
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP).item()
        assert abs(reference_norm - grad_norms[step]) < 1e-5 * reference_norm, (reference_norm, grad_norms[step])
        assert reference_norm > CLIP, "the clipping check needs gradients above the clip threshold"
        reference_optimizer.step()
    reference_state = dict(reference.named_parameters())
    exported = export_hf_state(model)
    assert not exported or set(exported) == set(reference_state), set(reference_state) ^ set(exported)
    worst = 0.0
    for name, tensor in exported.items():
        diff = (tensor - reference_state[name].detach()).abs().max().item()
        worst = max(worst, diff)
        assert diff < 1e-6, f"{name} after {steps} steps differs from the reference by {diff}"
    if exported:
        log(f"CHECK training_matches_reference ok tp={args.tp} pp={args.pp} dp={dp_size} max_abs_diff={worst:.1e} "
            f"grad_norms={[round(n, 4) for n in grad_norms]}")

    if args.save_ckpt:
        os.makedirs(args.save_ckpt, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), args.save_ckpt)
        if exported:
            torch.save(exported, f"{args.save_ckpt}/expected_hf_state.pt")
        dist.barrier()
        log("CHECK dist_checkpoint_saved ok")


def check_resharded_load(args):
    """A dist checkpoint saved under another TP/PP layout loads into this one with identical weights."""
    from megatron.core import dist_checkpointing

    reset_parallel(args.tp, args.pp)
    model, _ = build(f"{args.models}/qwen3", args.tp, args.pp)
    state = dist_checkpointing.load(model.sharded_state_dict(), args.load_ckpt)
    model.load_state_dict(state)
    loaded = export_hf_state(model)
    if loaded:
        expected = torch.load(f"{args.load_ckpt}/expected_hf_state.pt")
        assert set(loaded) == set(expected)
        for name, tensor in loaded.items():
            assert torch.equal(tensor, expected[name]), f"{name} differs after resharded load"
        log(f"CHECK resharded_load ok {len(loaded)} tensors bit-identical")


def declared_nccl_twin(group):
    """A ProcessGroup with `group`'s ranks, declared NCCL and with no communicator behind it (nothing can pass through
    it): the group as it is on GPUs, where NCCL carries CUDA tensors only."""
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import _world

    twin = ProcessGroup(dist.HashStore(), group.rank(), group.size())
    twin._set_default_backend(ProcessGroup.BackendType.NCCL)
    _world.pg_group_ranks[twin] = dict(_world.pg_group_ranks[group])  # rank queries work as on the real group
    return twin


def check_d3s_tokens_over_data_parallel(args):
    """D3S's token level selects over the whole step at DP=2: each rank's share of the selection equals the share of
    a one-process selection over both ranks' tokens, and both ranks read that selection's normaliser counts. The
    data-parallel group is declared NCCL, as on GPUs: the step's host tensors must not be handed to it."""
    from megatron.core import parallel_state

    from megatron_dppo.algo import build_pruner
    from megatron_dppo.pipeline.trainer import select_step_tokens

    assert parallel_state.get_data_parallel_world_size() == 2, "this check runs at DP=2 (tp = pp = 1)"
    generator = torch.Generator().manual_seed(0)
    step, first_sample = {}, 0
    for rank, sizes in enumerate(([7, 12], [9, 30])):  # unequal token counts per rank
        for micro_batch, size in enumerate(sizes):
            step[rank, micro_batch] = SimpleNamespace(
                advantages=torch.randn(size, generator=generator), old_entropy=torch.rand(size, generator=generator),
                loss_mask=(torch.rand(size, generator=generator) > 0.2).float(),
                sample_index=first_sample + torch.arange(size) // 4, num_tokens=size)
            first_sample += -(-size // 4)
    pruner = build_pruner("d3s")
    everything = {name: torch.cat([getattr(batch, name) for batch in step.values()])
                  for name in ("advantages", "old_entropy", "loss_mask", "sample_index")}
    expected, expected_counts = pruner.select_tokens(everything["advantages"], everything["old_entropy"],
                                                     everything["loss_mask"], everything["sample_index"], 0.3)
    rank = parallel_state.get_data_parallel_rank()
    mine = [SimpleNamespace(**vars(step[rank, m])) for m in range(2)]
    data_parallel = parallel_state._DATA_PARALLEL_GROUP
    parallel_state._DATA_PARALLEL_GROUP = declared_nccl_twin(data_parallel)
    try:
        counts = select_step_tokens(pruner, mine, progress=0.3)
    finally:
        parallel_state._DATA_PARALLEL_GROUP = data_parallel
    offset = sum(batch.num_tokens for (r, _), batch in step.items() if r < rank)
    selected = torch.cat([batch.loss_mask for batch in mine])
    assert torch.equal(selected, expected[offset:offset + len(selected)].float()), "this rank's share differs"
    assert counts == expected_counts, (counts, expected_counts)
    per_rank = torch.cat([pruner.select_tokens(*(torch.cat([getattr(step[r, m], name) for m in range(2)])
                                                 for name in ("advantages", "old_entropy", "loss_mask",
                                                              "sample_index")), 0.3)[0] for r in range(2)])
    assert not torch.equal(per_rank, expected), "these tokens do not tell a per-rank selection from the step's"
    log(f"CHECK d3s_tokens_over_data_parallel ok rank {rank} kept {int(selected.sum())} of its "
        f"{int(torch.cat([step[rank, m].loss_mask for m in range(2)]).sum())}; step {expected_counts}")


def check_device_move(args):
    """Every tensor the actor hands the model (tokens, positions, cu_seqlens) or the loss (labels, advantages, masks,
    weights, log-probs) was moved to the model's device, in the forward-only pass and in the update; what the actor
    returns is back on the host. The device is tests/workers/emulated_device.py's stand-in for CUDA."""
    import dataclasses

    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.step import logprob_loss_fn, next_token_targets
    from megatron_dppo.algo.losses import LossConfig, packed_policy_loss
    from megatron_dppo.algo.rollout_correction import RolloutCorrection
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
    from megatron_dppo.pipeline.packing import TrainingSample, build_thd_batch
    from tests.workers.emulated_device import (
        EmulatedDevice,
        parameter_on_device,
        require_on_device,
        strict,
        watch_model,
    )

    reset_parallel(args.tp, args.pp)
    checkpoint = HFCheckpoint(f"{args.models}/qwen3")
    vocab = checkpoint.shape.vocab_size
    actor = Actor(checkpoint.shape, args.tp, args.pp, "fp32", OptimConfig(lr=LR), hf_checkpoint=checkpoint)
    watch_model(actor.model)
    generator = torch.Generator().manual_seed(7)

    def sample(prompt, response):
        ids = torch.randint(0, vocab, (prompt + response,), generator=generator).tolist()
        logprobs = lambda: (-torch.rand(response, generator=generator)).tolist()  # noqa: E731
        return TrainingSample(ids[:prompt], ids[prompt:], advantage=float(torch.randn((), generator=generator)),
                              sample_weight=1.5, old_logprobs=logprobs(), ref_logprobs=logprobs(),
                              rollout_logprobs=logprobs())

    samples = [sample(3, 4), sample(2, 6), sample(5, 2)]
    batches = [build_thd_batch(samples, [0, 1], pad_multiple=4), build_thd_batch(samples, [2], pad_multiple=4)]
    config = LossConfig(kl_coef=0.1, entropy_coef=0.01, rollout_correction=RolloutCorrection("token-tis", cap=2.0))

    def checked(loss_fn):
        def loss_on_device(micro_batch, output):
            require_on_device("loss input", [output.hidden, *vars(micro_batch).values()])
            output = dataclasses.replace(output, weight=parameter_on_device(output.weight))
            with strict():
                return loss_fn(micro_batch, output)
        return loss_on_device

    def update_loss(micro_batch, output):  # the trainer's update loss
        logprobs, entropy = output.logprobs(next_token_targets(micro_batch))
        return packed_policy_loss(config, micro_batch, logprobs, 4.0, entropy)

    with EmulatedDevice():
        forward = actor.forward(batches, checked(logprob_loss_fn(with_entropy=True)))
        _, update = actor.train_step(batches, checked(update_loss))
    for output in forward + update:
        host = [key for key, value in output.items() if isinstance(value, torch.Tensor)
                and type(value) is not torch.Tensor]
        assert not host, f"the actor returned {host} on the device; its outputs must come back to the host"
    if forward:
        assert [len(o["logprobs"]) for o in forward] == [b.num_tokens for b in batches]
        log(f"CHECK device_move ok {len(batches)} micro-batches, forward and update")


# fp16 against fp32, one Adam step from the same weights: fp16 rounds activations and gradients to 11 significant bits
# (relative 2^-11 ~ 5e-4 per operation) through a few layers and a log-softmax, so the gradient (and, with the eps
# above, the step) differs by ~1e-3 of its size; 2% of the largest fp32 step bounds that with room, while an unscaled
# gradient (divided by the loss scale, 2^16 here) or a clip factor computed on scaled gradients moves the weights by a
# tiny or a wrong fraction of it and fails. The fp16 model holds its weights rounded to fp16, so each element may also
# differ by half an fp16 ulp before and after the step (2^-11 of |w| each), which the bound adds per element.
FP16_STEP_RTOL = 0.02
FP16_LOSS_SCALE = 2.0**16


def check_fp16_loss_scaling(args):
    """--fp16: one loss-scaled step (Megatron's dynamic grad scaler, the loss scaled through config.grad_scale_func,
    gradients unscaled before clipping) moves the weights as the fp32 step does; a step whose gradients overflow is
    skipped (weights kept, LR schedule not advanced, loss scale not raised) and reported, not raised."""
    from megatron.core import parallel_state

    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.step import next_token_targets
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint

    reset_parallel(args.tp, args.pp)
    checkpoint = HFCheckpoint(f"{args.models}/qwen3")
    optim = OptimConfig(lr=LR, clip_grad=CLIP, adam_eps=ADAM_EPS, initial_loss_scale=FP16_LOSS_SCALE)
    sequences = random_sequences([7, 4, 10, 6], checkpoint.shape.vocab_size, seed=5)
    batches = [packed_batch(sequences[parallel_state.get_data_parallel_rank()::
                                      parallel_state.get_data_parallel_world_size()])]
    total_tokens = sum(len(s) - 1 for s in sequences)

    def loss_fn(micro_batch, output):
        logprobs, _ = output.logprobs(next_token_targets(micro_batch))
        bounds = micro_batch.cu_seqlens.tolist()
        kept = torch.cat([logprobs[a:b - 1] for a, b in zip(bounds[:-1], bounds[1:])])
        return -kept.float().sum() / total_tokens, {}

    def overflowing(micro_batch, output):
        loss, outputs = loss_fn(micro_batch, output)
        return loss * float("inf"), outputs

    moved, rounding = {}, {}
    for dtype in ("fp32", "fp16"):
        actor = Actor(checkpoint.shape, args.tp, args.pp, dtype, optim, hf_checkpoint=checkpoint)
        before = {name: tensor.float() for name, tensor in export_hf_state(actor.model).items()}
        grad_norm, _ = actor.train_step(batches, loss_fn)
        assert grad_norm is not None and grad_norm > CLIP, f"{dtype}: the step must clip (grad norm {grad_norm})"
        after = {name: tensor.float() for name, tensor in export_hf_state(actor.model).items()}
        moved[dtype] = {name: after[name] - before[name] for name in before}
        rounding = {name: (before[name].abs() + after[name].abs()) * 2.0**-11 for name in before}
        if dtype == "fp16":
            scale, lr = actor.loss_scale, actor.lr
            kept = export_hf_state(actor.model)
            skipped_norm, _ = actor.train_step(batches, overflowing)
            assert skipped_norm is None, "an overflowing fp16 step must be skipped"
            for name, tensor in export_hf_state(actor.model).items():
                assert torch.equal(tensor, kept[name]), f"{name} changed in a skipped step"
            assert actor.loss_scale <= scale and actor.lr == lr, (actor.loss_scale, scale, actor.lr, lr)
    if moved["fp32"]:
        largest = max(delta.abs().max().item() for delta in moved["fp32"].values())
        worst = max(((moved["fp16"][name] - delta).abs() - rounding[name]).max().item()
                    for name, delta in moved["fp32"].items())
        assert largest > 0 and worst <= FP16_STEP_RTOL * largest, f"fp16 step differs by {worst} of {largest}"
        log(f"CHECK fp16_loss_scaling ok largest fp32 step {largest:.2e}, fp16 differs by {worst / largest:.1e} of "
            "it; an overflowing step was skipped")


def off_device_or_dtype(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> list[str]:
    return [f"{name}: {tensor.dtype} on {tensor.device}"
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]
            if tensor.device.type != device.type or (tensor.is_floating_point() and tensor.dtype != dtype)]


def check_model_placement(args):
    """The actor and the frozen reference are built as Megatron-LM builds a model: every parameter and buffer on the
    actor's device and, in bf16 and fp16, in that dtype (the local spec's torch RMSNorm weights are built fp32 on
    the host; megatron-core's modules place themselves). On the CPU the device that proves the move is `meta`: the
    modules allocate on the host, so a parameter the build leaves behind stays there and is named."""
    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.model import DTYPES, build_gpt_model, build_transformer_config
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint

    reset_parallel(args.tp, args.pp)
    checkpoint = HFCheckpoint(f"{args.models}/qwen3")
    for dtype in ("bf16", "fp16"):
        built = build_gpt_model(checkpoint.shape, build_transformer_config(checkpoint.shape, args.tp, args.pp, dtype))
        left = [name for name, param in built.named_parameters() if param.dtype != DTYPES[dtype]]
        assert left, "the test's premise: a built local-spec model has fp32 parameters (its norms)"
        reference = Actor(checkpoint.shape, args.tp, args.pp, dtype, None, hf_checkpoint=checkpoint, device="meta")
        assert not off_device_or_dtype(reference.model, torch.device("meta"), DTYPES[dtype])
        actor = Actor(checkpoint.shape, args.tp, args.pp, dtype, OptimConfig(lr=LR), hf_checkpoint=checkpoint)
        for model in (actor.model, actor.ddp):
            wrong = off_device_or_dtype(model, actor.device, DTYPES[dtype])
            assert not wrong, f"{dtype}: {wrong[:4]} off the actor's device or dtype"
    log(f"CHECK model_placement ok bf16 and fp16 actor and reference on their device in their dtype (built: "
        f"{len(left)} fp32 parameters, such as {left[0]})")


CHECKS = {
    "model_placement": check_model_placement,
    "fp16_loss_scaling": check_fp16_loss_scaling,
    "device_move": check_device_move,
    "hf_logits": check_hf_logits,
    "packed_equals_padded": check_packed_equals_padded,
    "vocab_parallel_logprobs": check_vocab_parallel_logprobs,
    "output_layer_input": check_output_layer_input,
    "fused_equals_unfused": check_fused_equals_unfused,
    "training": check_training_matches_reference,
    "resharded_load": check_resharded_load,
    "d3s_tokens_over_data_parallel": check_d3s_tokens_over_data_parallel,
}


def main():
    run_checks(CHECKS, ("--save-ckpt", "--load-ckpt"))


if __name__ == "__main__":
    main()

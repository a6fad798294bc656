"""Run packed THD micro-batches through Megatron's pipeline schedule (forward only, or forward and backward).

A packed micro-batch has `tokens [1, T]` and `cu_seqlens [n+1]` (int32), optionally `cu_seqlens_padded`
(`megatron_dppo.pipeline.packing.THDBatch` is one). Token t is scored against token t+1 of the stream; the last token of
every sequence therefore has a meaningless target, and the packer's loss mask excludes it. A micro-batch without
`cu_seqlens` is a padded BSHD batch `tokens [b, s]` run with a causal mask (the baseline packing is compared with).

On the last stage the model returns the final hidden states, and the loss meets them with the output layer's weight
(`OutputLayerInput`: `.logprobs(targets)` is the fused output layer and log-softmax of actor/logprobs.py), never
logits: the forward-only pass, the update's loss and the supervised warm start all take that one path.

Micro-batches arrive on the host; `to_device` is the one place that moves one to the model's device (every tensor
field, so `cu_seqlens`, from which TE attention takes its device, and the labels, advantages, masks, weights and
log-probs the loss meets the hidden states with). The model and the loss only ever see the moved batch; what the loss
returns comes back to the host (`to_host`) once the schedule has run.

Our loss functions return values already divided by their global normalisers (computed once per step), so the
schedule must neither average over micro-batches nor DDP over data-parallel ranks: the model config is built with
`calculate_per_token_loss=True` (no averaging anywhere), `loss_fn` results go back in the 3-tuple form, and the
gradients are finalised without the per-token rescaling (`finalize_grads_without_token_scaling`).
"""

import copy
from collections.abc import Callable, Sequence
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_attr_wrapped_model

from megatron_dppo.actor.logprobs import OutputLayerInput

# loss_fn(micro_batch, output: the last hidden states and output weight) -> (scalar loss to backpropagate,
# dict of detached outputs)
LossFn = Callable[[object, OutputLayerInput], tuple[torch.Tensor, dict]]


def to_device(micro_batch, device: torch.device):
    """A shallow copy of `micro_batch` with every tensor attribute on `device` (copies start without waiting)."""
    moved = copy.copy(micro_batch)
    for name, value in vars(micro_batch).items():
        if isinstance(value, torch.Tensor):
            setattr(moved, name, value.to(device, non_blocking=True))
    return moved


def to_host(outputs: dict) -> dict:
    """loss_fn's output dict with its tensors on the host, as the trainer's pure-PyTorch side expects them."""
    return {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in outputs.items()}


def packed_seq_params(micro_batch) -> PackedSeqParams:
    """THD attention parameters from the micro-batch's `cu_seqlens` (and `cu_seqlens_padded`), on their device.
    The longest span is read from the batch's `max_seqlen` when it has one, so no device value is read back."""
    cu_seqlens = micro_batch.cu_seqlens.to(torch.int32)
    padded = getattr(micro_batch, "cu_seqlens_padded", None)
    spans = (padded if padded is not None else cu_seqlens).to(torch.int32)
    max_seqlen = getattr(micro_batch, "max_seqlen", None)
    if max_seqlen is None:
        max_seqlen = int((spans[1:] - spans[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=None if padded is None else spans, cu_seqlens_kv_padded=None if padded is None else spans,
        max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
    )


def next_token_targets(micro_batch) -> torch.Tensor:
    """[T]: the token each position predicts. A THDBatch carries them (`labels`); otherwise the stream shifted by
    one (wrapping at sequence ends and at the end, positions every loss mask excludes)."""
    labels = getattr(micro_batch, "labels", None)
    return labels[0] if labels is not None else torch.roll(micro_batch.tokens[0], shifts=-1)


def _wrapped_in_float16_module(model) -> bool:
    while not isinstance(model, Float16Module) and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return isinstance(model, Float16Module)


def _forward_step(loss_fn: LossFn, data_iterator, model):
    micro_batch = to_device(next(data_iterator), next(model.parameters()).device)
    packed = getattr(micro_batch, "cu_seqlens", None) is not None
    # Float16Module would upcast the last stage's output to fp32, a copy of the hidden states that the fused
    # log-probs would cast back: they meet the output weight in the model's dtype.
    keep_dtype = {"fp32_output": False} if _wrapped_in_float16_module(model) else {}
    hidden = model(micro_batch.tokens, getattr(micro_batch, "position_ids", None), None,
                   packed_seq_params=packed_seq_params(micro_batch) if packed else None, **keep_dtype)
    output_layer_input = get_attr_wrapped_model(model, "output_layer_input")

    def loss_func(hidden_states):  # [s, b, H] (packed: b = 1), on the last stage only
        loss, outputs = loss_fn(micro_batch, output_layer_input(hidden_states))
        return loss, torch.ones((), dtype=torch.int), outputs

    return hidden, loss_func


def run_micro_batches(model, micro_batches: Sequence, loss_fn: LossFn, forward_only: bool) -> list[dict]:
    """Run every micro-batch through the schedule; returns loss_fn's output dicts (tensors on the host) on the last
    PP stage, [] elsewhere.

    Backward (when not forward_only) accumulates into the parameters' grads (or DDP's buffers)."""
    models = model if isinstance(model, list) else [model]
    max_tokens = max(mb.tokens.shape[1] for mb in micro_batches)
    forward_backward = get_forward_backward_func()
    outputs = forward_backward(
        forward_step_func=partial(_forward_step, loss_fn),
        data_iterator=iter(micro_batches),
        model=models,
        num_microbatches=len(micro_batches),
        seq_length=max_tokens,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return [to_host(output) for output in outputs] if parallel_state.is_pipeline_last_stage() else []


def finalize_grads_without_token_scaling(model, num_tokens=None, *args, **kwargs):
    """`config.finalize_model_grads_func`: Megatron's DP/embedding grad reduction, without dividing by token counts
    (our losses are already normalised globally, so summing over micro-batches and DP ranks is exact)."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, *args, **kwargs)


def logprob_loss_fn(with_entropy: bool = False, chunk_size: int | None = None, temperature: float = 1.0) -> LossFn:
    """A forward-only loss_fn that returns each micro-batch's per-token log-probs (and entropy) of the next token, at
    the sampling `temperature` (the rollout's)."""

    def loss_fn(micro_batch, output: OutputLayerInput):
        logprobs, entropy = output.logprobs(next_token_targets(micro_batch), chunk_size, temperature)
        outputs = {"logprobs": logprobs.detach()}
        if with_entropy:
            outputs["entropy"] = entropy.detach()
        return logprobs.sum() * 0.0, outputs

    return loss_fn

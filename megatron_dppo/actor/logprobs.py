"""Per-token log-probs and entropy straight from the last hidden states and the vocab-parallel output weight, fused
with the output layer, so that no [T, V/tp] logits tensor (nor its gradient) ever exists.

    hidden [T, H], W [V/tp, H] (this TP rank's vocabulary slice), targets [T], the sampling temperature t
    forward, per chunk of tokens:   x = (h_chunk @ W^T) / t                        [chunk, V/tp], fp32
                                    m = max over the whole vocabulary              (all-reduce MAX)
                                    s = sum exp(x - m), sum exp(x - m)(x - m), x[target]   (all-reduce SUM)
                                    logZ = m + log s,  E[x] = m + sum exp(x - m)(x - m) / s
                                    logp = x[target] - logZ,  H = logZ - E[x]      (= -sum p log p)
        keeps only h, W, the targets and the per-token logZ and E[x]
    backward, per slice of the vocabulary:  x = (h @ W_slice^T) / t  (recomputed)  [T, slice], fp32
                                    dx_j = g_logp (1[j = target] - p_j) - g_H p_j (x_j - E[x])
                                    dW_slice = (dx / t)^T h,  dh += (dx / t) W_slice

The backward runs over vocabulary slices rather than token chunks so that each slice of dW is one GEMM over all
tokens, written once as the unfused output layer writes it; over token chunks the whole [V/tp, H] dW would be summed
chunk by chunk (an fp32 accumulator the size of the weight for bf16 models). What is summed here instead is dh,
[T, H], in fp32 (float64 for float64 inputs, as every softmax quantity). Every temporary holds about
`chunk_size x V/tp` elements (2^25 by default), whatever T is.

Vocabulary padding rows (ids >= the real vocabulary size) are excluded from every softmax, so the result equals the
unpadded model's. `OutputLayerInput` is what the actor's last pipeline stage hands a loss in place of logits.

Temperature: the log-probs are those of the distribution the rollout engine samples from, softmax(logits / t) (verl
divides the actor's logits by the rollout temperature alike), and so is the entropy; the engines report the same
(SGLang and the embedded engine always, vLLM as the trainer starts it: docs/rollout.md), so that the rollout
correction's ratios carry only the gap between engine and trainer. t = 0 (greedy) is t = 1, as SGLang and vLLM treat
a greedy row's log-probs. The division is done in fp32 after the GEMM, as the engines divide their fp32 logits.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_dppo.platform import collectives

# Logits elements in one chunk or slice by default: 128 MiB in fp32, a fraction of dW (0.7 GiB in bf16 at V = 151936,
# H = 2560); forward chunks of V/tp = 151936 still hold 220 tokens, a GEMM that reads the weight once per 220 tokens.
CHUNK_ELEMENTS = 2**25


def _padding_columns(first: int, stop: int, vocab_start: int, vocab_size: int, device) -> torch.Tensor | None:
    """[stop - first] True where local column first.. of this rank's slice is vocabulary padding; None if none is."""
    if vocab_start + stop <= vocab_size:
        return None
    return torch.arange(vocab_start + first, vocab_start + stop, device=device) >= vocab_size


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        collectives.all_reduce(tensor, op, group, "a vocabulary-parallel reduction of the log-softmax")
    return tensor


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32, bf16 and fp16 inputs; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def logit_temperature(temperature: float) -> float:
    """What the logits are divided by for sampling temperature `temperature`: itself, or 1 for greedy (0)."""
    if temperature < 0:
        raise ValueError(f"temperature {temperature} must be >= 0 (0: greedy)")
    return temperature if temperature > 0 else 1.0


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[rows, columns] logits / temperature in the softmax dtype, from the GEMM in the weights' dtype as the output
    layer computes them."""
    logits = (hidden @ weight.T).to(_softmax_dtype(hidden.dtype))
    return logits if temperature == 1.0 else logits.div_(temperature)


class _OutputLayerLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, vocab_size, chunk_size, group, temperature):
        tokens, local_vocab = hidden.shape[0], weight.shape[0]
        padding = _padding_columns(0, local_vocab, vocab_start, vocab_size, hidden.device)
        local_targets = targets - vocab_start
        in_slice = (local_targets >= 0) & (local_targets < local_vocab)
        gather_index = local_targets.clamp(0, local_vocab - 1)[:, None]
        logprobs, entropy, log_normalizer, mean_logit = (
            torch.empty(tokens, dtype=_softmax_dtype(hidden.dtype), device=hidden.device) for _ in range(4))
        for start in range(0, tokens, chunk_size):
            stop = min(start + chunk_size, tokens)
            x = _logits(hidden[start:stop], weight, temperature)  # [chunk, V/tp]
            target_logit = torch.where(in_slice[start:stop], x.gather(1, gather_index[start:stop]).squeeze(1), 0.0)
            if padding is not None:
                x.masked_fill_(padding, float("-inf"))
            chunk_max = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, group)
            shifted = x.sub_(chunk_max[:, None])
            exp = shifted.exp()
            if padding is not None:
                shifted.masked_fill_(padding, 0.0)  # exp is 0 there; keeps 0 * -inf out of the sum below
            sums = torch.stack([exp.sum(-1), torch.einsum("ij,ij->i", exp, shifted), target_logit], dim=1)
            sums = _all_reduce(sums, dist.ReduceOp.SUM, group)  # [chunk, 3]
            log_z = chunk_max + sums[:, 0].log()
            log_normalizer[start:stop] = log_z
            mean_logit[start:stop] = chunk_max + sums[:, 1] / sums[:, 0]
            logprobs[start:stop] = sums[:, 2] - log_z
            entropy[start:stop] = log_z - mean_logit[start:stop]
        ctx.save_for_backward(hidden, weight, local_targets, log_normalizer, mean_logit)
        ctx.vocab_start, ctx.vocab_size, ctx.chunk_size = vocab_start, vocab_size, chunk_size
        ctx.temperature = temperature
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local_targets, log_normalizer, mean_logit = ctx.saved_tensors
        tokens, local_vocab = hidden.shape[0], weight.shape[0]
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(log_normalizer)
        grad_hidden = torch.zeros(hidden.shape, dtype=log_normalizer.dtype, device=hidden.device) \
            if want_hidden else None
        grad_weight = torch.empty_like(weight) if want_weight else None
        width = max(1, ctx.chunk_size * local_vocab // max(tokens, 1))  # slice [T, width] ~ a forward chunk
        for first in range(0, local_vocab, width):
            stop = min(first + width, local_vocab)
            weight_slice = weight[first:stop]
            x = _logits(hidden, weight_slice, ctx.temperature)  # [T, slice]
            padding = _padding_columns(first, stop, ctx.vocab_start, ctx.vocab_size, hidden.device)
            if grad_entropy is None:  # -g_logp p_j, built in x's buffer
                grad = x.sub_(log_normalizer[:, None]).exp_()
                if padding is not None:
                    grad.masked_fill_(padding, 0.0)
                grad.mul_(-grad_logprobs[:, None])
            else:  # -p_j (g_logp + g_H (x_j - E[x])), built in x's buffer
                probs = (x - log_normalizer[:, None]).exp_()
                if padding is not None:
                    probs.masked_fill_(padding, 0.0)
                grad = x.sub_(mean_logit[:, None]).mul_(grad_entropy[:, None]).add_(grad_logprobs[:, None])
                grad.mul_(probs).neg_()
                del probs
            in_range = (local_targets >= first) & (local_targets < stop)
            grad.scatter_add_(1, (local_targets - first).clamp(0, stop - first - 1)[:, None],
                              torch.where(in_range, grad_logprobs, 0.0)[:, None])
            if ctx.temperature != 1.0:  # d(x / t) / dx
                grad.div_(ctx.temperature)
            grad = grad.to(weight.dtype)
            if want_weight:
                torch.mm(grad.T, hidden, out=grad_weight[first:stop])
            if want_hidden:
                grad_hidden += grad @ weight_slice
        if want_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def output_layer_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                          tp_group=None, vocab_start: int = 0, chunk_size: int | None = None,
                          temperature: float = 1.0):
    """Log-prob of `targets` and entropy, per token, of the softmax over `hidden @ weight^T / temperature` (0:
    greedy, as 1), never materialised.

    hidden: [T, H], the same on every rank of `tp_group`. weight: [V/tp, H], the slice [vocab_start,
    vocab_start + V/tp) of the padded vocabulary. targets: [T] global token ids. vocab_size: the real (unpadded)
    vocabulary size. chunk_size: tokens per forward chunk (default: CHUNK_ELEMENTS / (V/tp)).
    Returns (logprobs [T], entropy [T]) in fp32 (float64 for float64 inputs), differentiable with respect to hidden
    and weight. Under TP the gradient reaching `hidden` is this rank's share (its vocabulary slice's): the caller sums
    it over the TP group, as Megatron's copy-to-TP-region mapping does (`OutputLayerInput.logprobs`).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [T, H] and weight [V/tp, H]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [T] = {tuple(hidden.shape[:1])}; got {tuple(targets.shape)}")
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _OutputLayerLogProbEntropy.apply(hidden, weight, targets.long(), vocab_start, vocab_size, chunk_size,
                                            tp_group, float(logit_temperature(temperature)))


@dataclass
class OutputLayerInput:
    """What the actor's last pipeline stage hands the loss in place of logits: the final (normed) hidden states as
    GPTModel's output layer would take them, that layer, and its weight (the embedding's when they are tied)."""

    hidden: torch.Tensor  # [s, b, H]; [s / tp, b, H] under sequence parallelism
    output_layer: ColumnParallelLinear
    weight: torch.Tensor  # [V/tp, H]
    vocab_size: int  # real (unpadded)

    def logprobs(self, targets: torch.Tensor, chunk_size: int | None = None,
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused log-probs and entropy of `targets` ([b, s], or [s] for one packed stream), in that shape, fp32, at
        the sampling `temperature` (the rollout's; 1: the model's own distribution).

        The hidden states reach every TP rank as they reach ColumnParallelLinear: gathered over the sequence under
        sequence parallelism (the gradient is reduce-scattered back), otherwise as they are (the gradient is
        all-reduced)."""
        layer, hidden = self.output_layer, self.hidden
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                          group=layer.tp_group)
        hidden = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])  # [b * s, H], batch-major as the targets
        if not layer.sequence_parallel:
            # After the reshape, so that the gradient it all-reduces is contiguous: megatron-core 0.16's all-reduce
            # of a non-contiguous gradient reduces a contiguous copy and returns the original unreduced.
            hidden = copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group)
        vocab_start = dist.get_rank(layer.tp_group) * self.weight.shape[0]
        logprobs, entropy = output_layer_logprobs(hidden, self.weight, targets.reshape(-1), self.vocab_size,
                                                  layer.tp_group, vocab_start, chunk_size, temperature)
        return logprobs.view(targets.shape), entropy.view(targets.shape)

    def logits(self) -> torch.Tensor:
        """[b, s, V/tp]: GPTModel's own output layer, the model's logits before any temperature. It materialises
        them: for checks against the fused path and for callers that need the logits themselves."""
        logits, _ = self.output_layer(self.hidden, weight=self.weight)
        return logits.transpose(0, 1)


def unfused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     chunk_size: int | None = None, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The path `output_layer_logprobs` replaces, at its leanest, for measuring and checking the fused one against
    (bench/logprob_memory.py, tools/gpu_check.py): the output layer's [T, V] logits materialised whole, as GPTModel
    gives them, then log-probs and entropy of logits / temperature in fp32 per chunk of tokens under activation
    checkpointing, so that only the logits and their gradient are whole. One rank, no vocabulary padding."""
    from torch.utils.checkpoint import checkpoint

    chunk_size = chunk_size or max(1, CHUNK_ELEMENTS // weight.shape[0])
    temperature = logit_temperature(temperature)

    def log_softmax_terms(logits, chunk_targets):  # [chunk, V] -> logprobs, entropy [chunk], in fp32
        log_softmax = torch.log_softmax(logits.float() / temperature, dim=-1)
        return (log_softmax.gather(1, chunk_targets[:, None]).squeeze(1),
                -(log_softmax.exp() * log_softmax).sum(-1))

    logits = hidden @ weight.T  # [T, V], kept whole for backward, as the output layer's output is
    terms = [checkpoint(log_softmax_terms, chunk, chunk_targets, use_reentrant=False)
             for chunk, chunk_targets in zip(logits.split(chunk_size), targets.split(chunk_size))]
    return torch.cat([lp for lp, _ in terms]), torch.cat([h for _, h in terms])

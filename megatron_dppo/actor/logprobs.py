"""Per-token log-probs and entropy from vocab-parallel logits, chunked over tokens, never gathering the vocabulary.

Each TP rank holds logits [T, V/tp] for its vocabulary slice. Per chunk of tokens, in fp32:
    m      = max over the whole vocabulary          (all-reduce MAX)
    s, sx  = sum exp(x - m), sum exp(x - m) * x     (all-reduce SUM, with the target logit)
    logZ   = m + log s
    logp   = x[target] - logZ
    H      = logZ - sx / s                          (= -sum p log p)
Backward recomputes softmax per chunk from the saved logits and per-token (logZ, E[x]):
    d logp / dx_j = 1[j = target] - p_j
    d H    / dx_j = -p_j (x_j - E[x])
so peak extra memory is a few [chunk, V/tp] fp32 buffers, whatever T is. Vocabulary padding rows (ids >= the real
vocab size) are excluded from the softmax, so the result equals the unpadded model's.
"""

import torch
import torch.distributed as dist


def _vocab_mask(local_vocab: int, vocab_start: int, vocab_size: int, device) -> torch.Tensor | None:
    """[V/tp] True where the column is vocabulary padding, or None when this slice has none."""
    if vocab_start + local_vocab <= vocab_size:
        return None
    return torch.arange(vocab_start, vocab_start + local_vocab, device=device) >= vocab_size


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, chunk_size, group):
        tokens, local_vocab = logits.shape
        padding = _vocab_mask(local_vocab, vocab_start, vocab_size, logits.device)
        logprobs = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logprobs)
        log_normalizer = torch.empty_like(logprobs)
        mean_logit = torch.empty_like(logprobs)
        for start in range(0, tokens, chunk_size):
            stop = min(start + chunk_size, tokens)
            x = logits[start:stop].float()  # [chunk, V/tp]
            if padding is not None:
                x = x.masked_fill(padding, float("-inf"))
            chunk_max = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, group)
            shifted = x - chunk_max[:, None]
            exp = shifted.exp_()
            finite_x = x if padding is None else x.masked_fill(padding, 0.0)
            local_target = targets[start:stop] - vocab_start
            in_slice = (local_target >= 0) & (local_target < local_vocab)
            target_logit = finite_x.gather(1, local_target.clamp(0, local_vocab - 1)[:, None]).squeeze(1)
            sums = torch.stack([exp.sum(-1), (exp * finite_x).sum(-1), target_logit * in_slice], dim=1)
            sums = _all_reduce(sums, dist.ReduceOp.SUM, group)  # [chunk, 3]
            log_z = chunk_max + sums[:, 0].log()
            log_normalizer[start:stop] = log_z
            mean_logit[start:stop] = sums[:, 1] / sums[:, 0]
            logprobs[start:stop] = sums[:, 2] - log_z
            entropy[start:stop] = log_z - mean_logit[start:stop]
        ctx.save_for_backward(logits, targets, log_normalizer, mean_logit)
        ctx.vocab_start, ctx.vocab_size, ctx.chunk_size = vocab_start, vocab_size, chunk_size
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, log_normalizer, mean_logit = ctx.saved_tensors
        tokens, local_vocab = logits.shape
        padding = _vocab_mask(local_vocab, ctx.vocab_start, ctx.vocab_size, logits.device)
        grad_logits = torch.empty_like(logits)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(tokens, dtype=torch.float32, device=logits.device)
        for start in range(0, tokens, ctx.chunk_size):
            stop = min(start + ctx.chunk_size, tokens)
            x = logits[start:stop].float()
            if padding is not None:
                x = x.masked_fill(padding, float("-inf"))
            probs = (x - log_normalizer[start:stop, None]).exp_()  # [chunk, V/tp]
            grad = probs * (-grad_logprobs[start:stop, None])
            if grad_entropy is not None:
                finite_x = x if padding is None else x.masked_fill(padding, 0.0)
                grad -= grad_entropy[start:stop, None] * probs * (finite_x - mean_logit[start:stop, None])
            local_target = targets[start:stop] - ctx.vocab_start
            in_slice = (local_target >= 0) & (local_target < local_vocab)
            rows = torch.nonzero(in_slice).squeeze(1)
            grad[rows, local_target[rows]] += grad_logprobs[start:stop][rows]
            grad_logits[start:stop] = grad.to(logits.dtype)
        return grad_logits, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp_group=None,
                            vocab_start: int = 0, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy, per token, from this rank's vocabulary slice of the logits.

    logits: [T, V/tp] (any float dtype), the slice [vocab_start, vocab_start + V/tp) of the padded vocabulary.
    targets: [T] int64 global token ids. vocab_size: the real (unpadded) vocabulary size.
    Returns (logprobs [T], entropy [T]) in fp32, differentiable with respect to the logits.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [T, V/tp] and targets [T]; got {tuple(logits.shape)}, {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _VocabParallelLogProbEntropy.apply(logits, targets.long(), vocab_start, vocab_size, chunk_size, tp_group)


def tensor_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk_size: int = 1024):
    """`vocab_parallel_logprobs` on Megatron's TP group, with this rank's vocabulary offset."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return vocab_parallel_logprobs(logits, targets, vocab_size, group, rank * logits.shape[-1], chunk_size)

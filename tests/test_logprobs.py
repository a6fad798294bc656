"""Chunked log-probs and entropy (single rank) against a full-softmax reference, gradients included.
The TP=2 case runs in tests/workers/actor_checks.py. Tolerance 1e-5 absolute in fp32 (observed ~1e-6)."""

import pytest
import torch

from megatron_dppo.actor.logprobs import vocab_parallel_logprobs


def reference(logits, targets, vocab):
    log_softmax = torch.log_softmax(logits[:, :vocab], dim=-1)
    return log_softmax.gather(1, targets[:, None]).squeeze(1), -(log_softmax.exp() * log_softmax).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
@pytest.mark.parametrize("padded_vocab", [96, 128])  # 128: 32 padding columns that must not count
def test_chunked_logprobs_and_entropy_equal_full_softmax_with_gradients(chunk_size, padded_vocab):
    generator = torch.Generator().manual_seed(0)
    tokens, vocab = 50, 96
    logits = (torch.randn(tokens, padded_vocab, generator=generator) * 4).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    weights_lp, weights_h = torch.randn(tokens, generator=generator), torch.randn(tokens, generator=generator)

    logprobs, entropy = vocab_parallel_logprobs(logits, targets, vocab, chunk_size=chunk_size)
    ((logprobs * weights_lp).sum() + (entropy * weights_h).sum()).backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref_lp, ref_h = reference(logits, targets, vocab)
    ((ref_lp * weights_lp).sum() + (ref_h * weights_h).sum()).backward()

    assert (logprobs - ref_lp).abs().max() < 1e-5
    assert (entropy - ref_h).abs().max() < 1e-5
    assert (ours - logits.grad).abs().max() < 1e-5
    if padded_vocab > vocab:
        assert ours[:, vocab:].abs().max() == 0


def test_entropy_only_and_logprob_only_backward():
    logits = torch.randn(9, 20, requires_grad=True)
    targets = torch.randint(0, 20, (9,))
    _, entropy = vocab_parallel_logprobs(logits, targets, 20, chunk_size=4)
    entropy.sum().backward()
    grad_entropy_only = logits.grad.clone()
    logits.grad = None
    reference(logits, targets, 20)[1].sum().backward()
    assert torch.allclose(grad_entropy_only, logits.grad, atol=1e-6)


def test_bf16_logits_are_computed_in_fp32_and_return_bf16_grads():
    logits = torch.randn(12, 32).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 32, (12,))
    logprobs, _ = vocab_parallel_logprobs(logits, targets, 32, chunk_size=5)
    assert logprobs.dtype == torch.float32
    logprobs.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_lp, _ = reference(logits.float(), targets, 32)
    assert (logprobs - ref_lp).abs().max() < 1e-5


def test_bad_shapes_are_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match=r"logits must be \[T, V/tp\]"):
        vocab_parallel_logprobs(torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long), 4)

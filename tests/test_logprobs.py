"""The fused output layer and log-probs (single rank) against the unfused path, a full softmax over materialised
logits, computed in float64: values and the gradients of the hidden states and of the weight. The TP=2 case and the
model-level comparison with GPTModel's own output layer run in tests/workers/actor_checks.py.

Tolerances (fp32): values 1e-5 absolute, gradients 1e-5 relative to their largest element (the same sums in
another order; observed ~1e-6). bf16: see the test."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dppo.actor.logprobs import output_layer_logprobs, unfused_logprobs


def unfused(hidden, weight, targets, vocab, temperature=1.0):
    """Per-token log-probs and entropy through the [T, V] logits / temperature and a full log-softmax (in fp32 at
    least)."""
    logits = hidden @ weight.T
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))[:, :vocab] / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    return log_softmax.gather(1, targets[:, None]).squeeze(1), -(log_softmax.exp() * log_softmax).sum(-1)


def problem(tokens=50, hidden_size=16, vocab=96, padded_vocab=128, seed=0):
    """float64 hidden states and weight (zero padding rows, as the model's), targets and loss weights."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float64)
    weight = torch.randn(padded_vocab, hidden_size, generator=generator, dtype=torch.float64)
    weight[vocab:] = 0.0
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    return hidden, weight, targets, torch.randn(2, tokens, generator=generator, dtype=torch.float64)


def gradients(function, hidden, weight, targets, vocab, loss_weights, dtype):
    hidden = hidden.to(dtype).requires_grad_(True)
    weight = weight.to(dtype).requires_grad_(True)
    logprobs, entropy = function(hidden, weight, targets, vocab)
    ((logprobs * loss_weights[0]).sum() + (entropy * loss_weights[1]).sum()).backward()
    return logprobs.detach(), entropy.detach(), hidden.grad, weight.grad


def relative(tensor, reference):
    return ((tensor.double() - reference.double()).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])  # None: the default, every token in one chunk here
@pytest.mark.parametrize("padded_vocab", [96, 128])  # 128: 32 padding rows that must not count
def test_fused_logprobs_entropy_and_gradients_equal_the_unfused_full_softmax(chunk_size, padded_vocab):
    hidden, weight, targets, loss_weights = problem(padded_vocab=padded_vocab)
    fused = lambda h, w, t, v: output_layer_logprobs(h, w, t, v, chunk_size=chunk_size)  # noqa: E731
    logprobs, entropy, grad_hidden, grad_weight = gradients(fused, hidden, weight, targets, 96, loss_weights.float(),
                                                            torch.float32)
    ref_lp, ref_h, ref_grad_hidden, ref_grad_weight = gradients(unfused, hidden, weight, targets, 96, loss_weights,
                                                                torch.float64)

    assert (logprobs - ref_lp).abs().max() < 1e-5
    assert (entropy - ref_h).abs().max() < 1e-5
    assert relative(grad_hidden, ref_grad_hidden) < 1e-5
    assert relative(grad_weight, ref_grad_weight) < 1e-5
    assert grad_weight[96:].abs().sum() == 0


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_logprobs_at_a_sampling_temperature_are_those_of_logits_over_temperature_on_the_fused_and_full_paths(
        temperature):
    """The trainer's log-probs at the rollout temperature: the fused path (values and both gradients) and the full
    path (actor/logprobs.py's unfused_logprobs, materialised logits) equal a float64 log-softmax of logits / t; at
    0.6 they differ from the untempered ones by far more than the tolerance, so a path that ignored t would fail."""
    hidden, weight, targets, loss_weights = problem(padded_vocab=128)
    fused = lambda h, w, t, v: output_layer_logprobs(h, w, t, v, chunk_size=7, temperature=temperature)  # noqa: E731
    reference = lambda h, w, t, v: unfused(h, w, t, v, temperature)  # noqa: E731
    logprobs, entropy, grad_hidden, grad_weight = gradients(fused, hidden, weight, targets, 96, loss_weights.float(),
                                                            torch.float32)
    ref_lp, ref_h, ref_grad_hidden, ref_grad_weight = gradients(reference, hidden, weight, targets, 96, loss_weights,
                                                                torch.float64)
    assert (logprobs - ref_lp).abs().max() < 1e-5 and (entropy - ref_h).abs().max() < 1e-5
    assert relative(grad_hidden, ref_grad_hidden) < 1e-5 and relative(grad_weight, ref_grad_weight) < 1e-5

    full = lambda h, w, t, v: unfused_logprobs(h, w[:v], t, chunk_size=5, temperature=temperature)  # noqa: E731
    full_lp, full_h, full_grad_hidden, full_grad_weight = gradients(full, hidden.detach(), weight.detach(), targets,
                                                                    96, loss_weights.float(), torch.float32)
    assert (full_lp - ref_lp).abs().max() < 1e-5 and (full_h - ref_h).abs().max() < 1e-5
    assert relative(full_grad_hidden, ref_grad_hidden) < 1e-5
    assert relative(full_grad_weight[:96], ref_grad_weight[:96]) < 1e-5
    if temperature != 1.0:
        untempered, _ = unfused(hidden.detach(), weight.detach(), targets, 96)
        assert (untempered - ref_lp).abs().max() > 1e3 * 1e-5


def test_greedy_temperature_zero_gives_the_untempered_logprobs_and_a_negative_one_is_refused():
    """Greedy evaluation or rollouts (temperature 0): the engines report the model's own distribution there (SGLang
    and vLLM treat a greedy row as temperature 1), and nothing divides by 0."""
    hidden, weight, targets, _ = problem(tokens=9, hidden_size=8, vocab=20, padded_vocab=20)
    for path in (lambda t: output_layer_logprobs(hidden, weight, targets, 20, temperature=t),
                 lambda t: unfused_logprobs(hidden, weight, targets, temperature=t)):
        greedy, untempered = path(0.0), path(1.0)
        assert torch.isfinite(greedy[0]).all() and torch.equal(greedy[0], untempered[0])
        assert torch.equal(greedy[1], untempered[1])
        with pytest.raises(ValueError, match="temperature -0.5 must be >= 0"):
            path(-0.5)


def test_entropy_only_and_logprob_only_backward_match_the_unfused_path():
    hidden, weight, targets, _ = problem(tokens=9, hidden_size=8, vocab=20, padded_vocab=20)
    for output in (0, 1):  # 0: log-probs only, 1: entropy only (the other output gets no gradient)
        grads = {}
        for name, function in (("fused", lambda *a: output_layer_logprobs(*a, chunk_size=4)), ("unfused", unfused)):
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            function(h, w, targets, 20)[output].sum().backward()
            grads[name] = (h.grad, w.grad)
        for fused_grad, unfused_grad in zip(grads["fused"], grads["unfused"]):
            assert relative(fused_grad, unfused_grad) < 1e-12  # float64 throughout


def test_bf16_is_computed_in_fp32_returns_bf16_grads_and_matches_the_unfused_bf16_path():
    """bf16 hidden states and weight, as a GPU run has them: both paths form the logits by the same bf16 GEMM and
    take the softmax in fp32, so the values agree to 1e-5; gradients pass through bf16 GEMMs in a different grouping
    (the fused backward sums dh over vocabulary slices), so they agree to one bf16 rounding step (2^-7 ~ 7.8e-3)
    relative: 1e-2 (observed 4e-3 for dh; dW identical)."""
    hidden, weight, targets, loss_weights = problem(tokens=40, hidden_size=32, vocab=96, padded_vocab=128)
    fused = lambda h, w, t, v: output_layer_logprobs(h, w, t, v, chunk_size=5)  # noqa: E731
    logprobs, entropy, grad_hidden, grad_weight = gradients(fused, hidden, weight, targets, 96, loss_weights.float(),
                                                            torch.bfloat16)
    ref_lp, ref_h, ref_grad_hidden, ref_grad_weight = gradients(unfused, hidden, weight, targets, 96,
                                                                loss_weights.float(), torch.bfloat16)
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert grad_hidden.dtype == grad_weight.dtype == torch.bfloat16
    assert (logprobs - ref_lp).abs().max() < 1e-5 and (entropy - ref_h).abs().max() < 1e-5
    assert relative(grad_hidden, ref_grad_hidden) < 1e-2
    assert relative(grad_weight, ref_grad_weight) < 1e-2


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation creates (forward and backward, the autograd engine included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in result if isinstance(result, tuple | list) else [result]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return result


def test_no_tokens_by_vocabulary_tensor_is_ever_formed_forward_or_backward():
    """What 'fused' promises: with T x V far above both the weight and a chunk, no operation of the forward or the
    backward creates a tensor larger than the weight [V, H] or a chunk of logits [chunk, V]."""
    tokens, hidden_size, vocab, chunk_size = 512, 8, 1000, 16
    hidden, weight, targets, loss_weights = problem(tokens, hidden_size, vocab, vocab)
    hidden, weight = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
    bound = max(weight.numel(), chunk_size * vocab)
    assert tokens * vocab >= 16 * bound
    with LargestTensor() as recorder:
        logprobs, entropy = output_layer_logprobs(hidden, weight, targets, vocab, chunk_size=chunk_size)
        ((logprobs * loss_weights[0].float()).sum() + (entropy * loss_weights[1].float()).sum()).backward()
    assert recorder.largest <= bound, f"a tensor of {recorder.largest} elements was formed (bound {bound})"
    with LargestTensor() as recorder:  # the unfused path does form them: the recorder sees them
        unfused(hidden, weight, targets, vocab)[0].sum().backward()
    assert recorder.largest >= tokens * vocab


def test_bad_shapes_are_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match=r"hidden must be \[T, H\] and weight \[V/tp, H\]"):
        output_layer_logprobs(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), 5)
    with pytest.raises(ValueError, match=r"targets must be \[T\]"):
        output_layer_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        output_layer_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), 5, chunk_size=0)

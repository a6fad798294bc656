import math
from dataclasses import dataclass

import pytest
import torch

from megatron_dppo.algo.losses import (
    AGGREGATIONS,
    FullBatchInfo,
    LossConfig,
    kl_penalty,
    loss_normalizer,
    policy_loss,
)
from megatron_dppo.algo.rollout_correction import RolloutCorrection

VOCAB, FEATURES = 6, 4


@dataclass
class TinyPolicyBatch:
    """A batch of sampled responses scored by a tiny softmax policy (logits = features @ W + b), in float64.

    Every response token t has a feature row, a sampled token and the sample it belongs to; old, reference and
    rollout log-probs are the policy's own plus fixed noise, so ratios differ from 1 and clipping is active.
    """

    weight: torch.Tensor  # [FEATURES, VOCAB], requires grad
    bias: torch.Tensor  # [VOCAB], requires grad
    features: torch.Tensor  # [tokens, FEATURES]
    tokens: torch.Tensor  # [tokens]
    sample_ids: torch.Tensor  # [tokens]
    lengths: torch.Tensor  # [samples]
    sample_advantages: torch.Tensor  # [samples]
    old_logprobs: torch.Tensor  # [tokens]
    ref_logprobs: torch.Tensor  # [tokens]
    rollout_logprobs: torch.Tensor  # [tokens]

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.weight, self.bias]

    def loss(self, config: LossConfig, sample_weights, normalizer: float, samples=None):
        """policy_loss over the tokens of `samples` (all if None) with per-sample weights [samples]."""
        if samples is None:
            selected = torch.ones_like(self.sample_ids, dtype=torch.bool)
        else:
            selected = torch.isin(self.sample_ids, torch.as_tensor(samples))
        logits = self.features[selected] @ self.weight + self.bias  # [tokens, VOCAB]
        log_probs = torch.log_softmax(logits, dim=-1)
        ids = self.sample_ids[selected]
        return policy_loss(
            config,
            logprobs=log_probs.gather(1, self.tokens[selected, None]).squeeze(1),
            old_logprobs=self.old_logprobs[selected],
            advantages=self.sample_advantages[ids],
            loss_mask=torch.ones(len(ids)),
            sample_weights=torch.as_tensor(sample_weights, dtype=torch.float64)[ids],
            sample_ids=ids,
            normalizer=normalizer,
            ref_logprobs=self.ref_logprobs[selected],
            rollout_logprobs=self.rollout_logprobs[selected],
            entropy=-(log_probs.exp() * log_probs).sum(-1),
        )

    def gradient(self, loss: torch.Tensor) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, self.params)])

    def per_sample_gradients(self, config: LossConfig) -> torch.Tensor:
        """[samples, params]: gradient of each sample's loss term with weight 1 and normaliser 1."""
        num_samples = len(self.lengths)
        return torch.stack([
            self.gradient(self.loss(config, torch.ones(num_samples), 1.0, samples=[i])[0]) for i in range(num_samples)
        ])


def make_policy_batch(lengths: torch.Tensor, sample_advantages: torch.Tensor, seed: int = 0) -> TinyPolicyBatch:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=generator, dtype=torch.float64)

    weight, bias = normal(FEATURES, VOCAB).requires_grad_(), normal(VOCAB, scale=0.5).requires_grad_()
    num_tokens = int(lengths.sum())
    features = normal(num_tokens, FEATURES)
    tokens = torch.randint(0, VOCAB, (num_tokens,), generator=generator)
    with torch.no_grad():
        logprobs = torch.log_softmax(features @ weight + bias, -1).gather(1, tokens[:, None]).squeeze(1)
    old_logprobs = logprobs + normal(num_tokens, scale=0.3)
    return TinyPolicyBatch(
        weight=weight, bias=bias, features=features, tokens=tokens,
        sample_ids=torch.repeat_interleave(torch.arange(len(lengths)), lengths),
        lengths=lengths, sample_advantages=sample_advantages.to(torch.float64),
        old_logprobs=old_logprobs, ref_logprobs=logprobs + normal(num_tokens, scale=0.3),
        rollout_logprobs=old_logprobs + normal(num_tokens, scale=0.5),
    )


FULL_CONFIG = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_coef=0.05, kl_type="k3", entropy_coef=0.01,
                   rollout_correction=RolloutCorrection("token-tis", cap=2.0), max_response_length=12)


def flat_inputs(logprobs, old_logprobs, advantages, sample_ids, **extra):
    return dict(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                loss_mask=torch.ones_like(logprobs), sample_weights=torch.ones_like(logprobs),
                sample_ids=sample_ids, **extra)


def test_clip_higher_and_dual_clip_match_hand_computation():
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.7, 5.0], dtype=torch.float64)
    logprobs = ratios.log().requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    inputs = flat_inputs(logprobs, torch.zeros(5, dtype=torch.float64), advantages, torch.arange(5))
    config = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, aggregation="token-mean")
    loss, metrics = policy_loss(config, normalizer=5.0, **inputs)
    # per token: clipped at 1.28; unclipped; unclipped; clipped at 0.8; dual-clipped at 3 (instead of 5)
    expected = [-1.28, -0.5, 1.1, 0.8, 3.0]
    assert loss.item() == pytest.approx(sum(expected) / 5)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 5)
    (gradient,) = torch.autograd.grad(loss, logprobs)
    # d/dlogp of -A·ρ is -A·ρ where unclipped, 0 where a clip is active
    torch.testing.assert_close(gradient, torch.tensor([0.0, -0.5, 1.1, 0.0, 0.0], dtype=torch.float64) / 5)


def test_gspo_uses_one_sequence_level_ratio():
    logprobs = torch.tensor([0.1, -0.3, 0.2, 0.05, 0.0], dtype=torch.float64, requires_grad=True)
    sample_ids = torch.tensor([7, 7, 7, 9, 9])  # global ids, not 0-based
    advantages = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0], dtype=torch.float64)
    config = LossConfig(eps_low=0.2, eps_high=0.2, importance_level="sequence")
    inputs = flat_inputs(logprobs, torch.zeros(5, dtype=torch.float64), advantages, sample_ids)
    loss, _ = policy_loss(config, normalizer=2.0, **inputs)
    first, second = torch.exp(logprobs[:3].mean()), torch.exp(logprobs[3:].mean())
    expected = (-1.0 * first + 2.0 * second) / 2  # both sequence ratios lie inside the clip range
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(*(torch.autograd.grad(value, logprobs)[0] for value in (loss, expected)))


def test_kl_estimators_match_their_formulas():
    logprobs = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    log_ratio = math.log(0.5)  # log π_ref/π_θ
    assert kl_penalty(logprobs, ref, "k1").item() == pytest.approx(-log_ratio)
    assert kl_penalty(logprobs, ref, "k2").item() == pytest.approx(0.5 * log_ratio**2)
    assert kl_penalty(logprobs, ref, "k3").item() == pytest.approx(0.5 - log_ratio - 1)
    assert kl_penalty(logprobs, ref, "low_var_kl").item() == pytest.approx(0.5 - log_ratio - 1)
    far_ref = torch.tensor([30.0], dtype=torch.float64)
    assert kl_penalty(torch.zeros(1, dtype=torch.float64), far_ref, "low_var_kl").item() == 10.0
    assert kl_penalty(torch.zeros(1, dtype=torch.float64), far_ref, "k3").item() > 1e12


def test_truncated_importance_weight_caps_at_c_and_kl_entropy_terms_add():
    logprobs = torch.tensor([0.1, -0.2], dtype=torch.float64)
    old = torch.zeros(2, dtype=torch.float64)
    inputs = flat_inputs(logprobs, old, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.tensor([0, 0]))
    base, _ = policy_loss(LossConfig(aggregation="token-mean"), normalizer=2.0, **inputs)
    rollout = torch.tensor([-math.log(3.0), -math.log(1.5)], dtype=torch.float64)  # weights 3 → capped 2, and 1.5
    token_tis = RolloutCorrection("token-tis", cap=2.0)
    capped, metrics = policy_loss(LossConfig(aggregation="token-mean", rollout_correction=token_tis), normalizer=2.0,
                                  rollout_logprobs=rollout, **inputs)
    pg = torch.tensor([-math.exp(0.1), math.exp(-0.2)], dtype=torch.float64)
    assert base.item() == pytest.approx(pg.sum().item() / 2)
    assert capped.item() == pytest.approx((2.0 * pg[0] + 1.5 * pg[1]).item() / 2)
    assert metrics["rollout_correction_capped_fraction"] == 0.5
    ref, entropy = torch.tensor([0.3, 0.0], dtype=torch.float64), torch.tensor([1.0, 3.0], dtype=torch.float64)
    config = LossConfig(aggregation="token-mean", kl_coef=0.1, kl_type="k1", entropy_coef=0.01)
    total, metrics = policy_loss(config, normalizer=2.0, ref_logprobs=ref, entropy=entropy, **inputs)
    kl_k1 = (logprobs - ref).sum().item()
    assert total.item() == pytest.approx(base.item() + (0.1 * kl_k1 - 0.01 * 4.0) / 2)
    assert metrics["kl"] == pytest.approx(kl_k1 / 2) and metrics["entropy"] == pytest.approx(2.0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_aggregation_modes_match_their_definitions(aggregation):
    # with ratio 1, no KL and no entropy, every token's term is -A of its sample
    lengths = torch.tensor([3, 1, 5, 2])
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    weights = torch.tensor([1.0, 2.0, 0.5, 4.0], dtype=torch.float64)
    sample_ids = torch.repeat_interleave(torch.arange(4), lengths)
    logprobs = torch.zeros(int(lengths.sum()), dtype=torch.float64)
    config = LossConfig(aggregation=aggregation, max_response_length=8)
    normalizer = loss_normalizer(config, FullBatchInfo.from_lengths(lengths))
    inputs = flat_inputs(logprobs, logprobs, advantages[sample_ids], sample_ids)
    inputs["sample_weights"] = weights[sample_ids]
    loss, _ = policy_loss(config, normalizer=normalizer, **inputs)
    terms = -advantages * weights
    expected = {
        "seq-mean-token-mean": terms.mean(),
        "token-mean": (terms * lengths).sum() / lengths.sum(),
        "seq-mean-token-sum-norm": (terms * lengths).sum() / (4 * 8),
    }[aggregation]
    assert loss.item() == pytest.approx(expected.item())


# thresholds at which each correction caps, masks or rejects part of make_policy_batch's tokens (ratios e^N(0, 0.5²))
SPLIT_CORRECTIONS = [RolloutCorrection("none"), RolloutCorrection("token-tis", cap=1.5),
                     RolloutCorrection("seq-tis", cap=2.0), RolloutCorrection("seq-mis", cap=2.0),
                     RolloutCorrection("geo-rs", band=(0.8, 1.25)), RolloutCorrection("icepop", band=(0.6, 1.7))]


@pytest.mark.parametrize("correction", SPLIT_CORRECTIONS, ids=lambda correction: correction.name)
@pytest.mark.parametrize("importance_level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradient_summed_over_microbatches_and_dp_shards_equals_full_batch(aggregation, importance_level, correction):
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 12, (20,), generator=generator)
    batch = make_policy_batch(lengths, torch.randn(20, generator=generator), seed=2)
    weights = torch.rand(20, generator=generator, dtype=torch.float64) * 3  # pruner weights, any positive values
    config = LossConfig(**{**FULL_CONFIG, "rollout_correction": correction}, aggregation=aggregation,
                        importance_level=importance_level)
    normalizer = loss_normalizer(config, FullBatchInfo.from_lengths(lengths))
    full = batch.gradient(batch.loss(config, weights, normalizer)[0])
    for _ in range(3):
        order = torch.randperm(20, generator=generator)
        shards = order.tensor_split(2)  # data-parallel ranks
        total = torch.zeros_like(full)
        for shard in shards:
            cuts = sorted(torch.randint(1, len(shard), (2,), generator=generator).tolist())
            for micro_batch in shard.tensor_split(cuts):  # up to three micro-batches, one may be empty
                total += batch.gradient(batch.loss(config, weights, normalizer, samples=micro_batch)[0])
        assert (total - full).abs().max().item() < 1e-6


def test_empty_microbatch_contributes_zero_loss_and_gradient():
    batch = make_policy_batch(torch.tensor([3, 2]), torch.tensor([1.0, -1.0]))
    config = LossConfig(**FULL_CONFIG)
    loss, metrics = batch.loss(config, torch.ones(2), 2.0, samples=[])
    assert loss.item() == 0.0 and metrics["num_tokens"] == 0.0
    assert torch.equal(batch.gradient(loss), torch.zeros(FEATURES * VOCAB + VOCAB, dtype=torch.float64))


def test_bad_loss_config_and_missing_inputs_are_rejected():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        LossConfig(aggregation="sum")
    with pytest.raises(ValueError, match="max_response_length"):
        LossConfig(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        LossConfig(dual_clip_c=0.5)
    with pytest.raises(ValueError, match="nothing to train on"):
        loss_normalizer(LossConfig(), FullBatchInfo(0.0, 0.0))
    inputs = flat_inputs(torch.zeros(2), torch.zeros(2), torch.ones(2), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="no ref_logprobs"):
        policy_loss(LossConfig(kl_coef=0.1), normalizer=1.0, **inputs)
    with pytest.raises(ValueError, match="no rollout_logprobs"):
        policy_loss(LossConfig(rollout_correction=RolloutCorrection("token-tis")), normalizer=1.0, **inputs)
    with pytest.raises(ValueError, match="no entropy"):
        policy_loss(LossConfig(entropy_coef=0.1), normalizer=1.0, **inputs)

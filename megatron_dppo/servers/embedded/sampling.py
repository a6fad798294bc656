"""The embedded engine's sampler: one token per row from fp32 logits, every row at once.

logits [B, V] ─► / temperature ─► log-softmax (the log-probs reported, SGLang's default) ─► top-k / top-p filter
(only when a row asks for one) ─► inverse CDF at one uniform per row ─► tokens [B]; greedy rows take the argmax
(computed only when a row is greedy). RowSampler prepares a batch's per-row settings once; a step only samples.

Uniforms: a seeded row (SGLang's `sampling_seed` under --enable-deterministic-inference) draws its uniform from
MurmurHash3 of (seed, position), the hash SGLang's deterministic sampler uses (sglang/kernels/ops/sampling/
murmur_hash.py: seed low word, seed high word, position, column, then fmix32). SGLang hashes every (token, position)
into Gumbel noise; here one hash per row feeds an inverse-CDF draw, which is the same law at 1/V of the hashing.
Either way a row's sample depends on its seed, its position and its own logits only: never on the other rows of the
batch, on how the batch was split, or on a retract and resume in between. Unseeded rows draw from the engine's
torch generator.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
TWO_TO_32 = float(2**32)


def mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 tensors of values in [0, 2**32), without ever overflowing int64."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def rotl32(x: torch.Tensor, bits: int) -> torch.Tensor:
    return ((x << bits) | (x >> (32 - bits))) & MASK32


def murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One MurmurHash3 (32-bit) block: mixes the 32-bit word k into the state h."""
    k = rotl32(mul32(k, 0xCC9E2D51), 15)
    k = mul32(k, 0x1B873593)
    h = rotl32(h ^ k, 13)
    return (mul32(h, 5) + 0xE6546B64) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seed_words(seed: int) -> tuple[int, int]:
    """A sampling seed as SGLang hashes it: its 64 bits (uint64), low word first."""
    seed &= 2**64 - 1
    return seed & MASK32, seed >> 32


def murmur_hash32(seed_low: torch.Tensor, seed_high: torch.Tensor, positions: torch.Tensor,
                  columns: torch.Tensor) -> torch.Tensor:
    """SGLang's murmur_hash32 of (seed, position, column), elementwise over int64 tensors; values in [0, 2**32)."""
    h = murmur3_mix(torch.zeros_like(seed_low), seed_low)
    h = murmur3_mix(h, seed_high)
    h = murmur3_mix(h, positions & MASK32)
    h = murmur3_mix(h, columns & MASK32)
    return fmix32(h ^ 16)  # the key is 16 bytes long


def sample_uniforms(seed_low: torch.Tensor, seed_high: torch.Tensor, seeded: torch.Tensor,
                    first_position: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """The uniforms in (0, 1) of `count` consecutive positions per row [B, count] float64: row r's j-th is hashed
    from (seed, first_position[r] + j) where the row is seeded, else drawn from `generator`."""
    positions = first_position[:, None] + torch.arange(count)  # [B, count]
    hashed = murmur_hash32(seed_low[:, None].expand_as(positions), seed_high[:, None].expand_as(positions),
                           positions, torch.zeros_like(positions))
    uniforms = (hashed.double() + 0.5) / TWO_TO_32
    unseeded = ~seeded
    if unseeded.any():
        uniforms[unseeded] = torch.rand((int(unseeded.sum()), count), generator=generator, dtype=torch.float64)
    return uniforms


class RowSampler:
    """One token per row from fp32 logits [B, V], with each row's settings prepared once per batch (and selected
    again by keep() when the batch drops rows), so that a step runs only what its rows need: the filter only when a
    row asks for one, the argmax only when a row is greedy.

    temperature/top_p [B] float; top_k [B] long (-1 = all). Rows with temperature 0 are greedy. A row keeps the
    tokens of its top-k that make the smallest prefix of mass >= top_p."""

    def __init__(self, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, vocab: int):
        self.vocab = vocab
        self.greedy = temperature == 0
        self.divisor = torch.where(self.greedy, torch.ones_like(temperature), temperature)[:, None]
        self.top_p = top_p
        self.top_k = torch.where(top_k < 1, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
        self.any_greedy = bool(self.greedy.any())
        self.filters = bool((self.top_k < vocab).any() or (top_p < 1).any())

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the settings of rows `rows` (long indices, in that order)."""
        self.greedy, self.divisor = self.greedy[rows], self.divisor[rows]
        self.top_p, self.top_k = self.top_p[rows], self.top_k[rows]
        self.any_greedy = bool(self.greedy.any())
        self.filters = bool((self.top_k < self.vocab).any() or (self.top_p < 1).any())

    def sample(self, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B], SGLang-style log-probs of those tokens [B]) for logits [B, V] and uniforms [B] in (0, 1)."""
        logprobs = torch.log_softmax(logits / self.divisor, dim=-1)  # [B, V]; the distribution reported
        weights = logprobs.exp()
        if self.filters:
            vocab = self.vocab
            sorted_weights, order = weights.sort(dim=-1, descending=True)
            drop = torch.arange(vocab)[None, :] >= self.top_k[:, None]
            in_top_k = sorted_weights.masked_fill(drop, 0.0)
            in_top_k = in_top_k / in_top_k.sum(dim=-1, keepdim=True)
            drop |= in_top_k.cumsum(dim=-1) - in_top_k > self.top_p[:, None]  # the smallest prefix reaching top_p
            weights = torch.zeros_like(weights).scatter_(-1, order, sorted_weights.masked_fill(drop, 0.0))
        cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)  # [B, V]
        tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp_(
            max=self.vocab - 1)
        if self.any_greedy:
            tokens = torch.where(self.greedy, logits.argmax(dim=-1), tokens)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def sample_next_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens [B], SGLang-style log-probs of those tokens [B]): RowSampler's
    draw, for settings used once."""
    return RowSampler(temperature, top_p, top_k, logits.shape[-1]).sample(logits, uniforms)

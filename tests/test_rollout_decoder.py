"""The embedded engine's own decode path computes what HF's forward computes, and its sampler draws what it should."""

import struct

import pytest
import torch

from megatron_dppo.convert.tiny import tiny_hf_config
from megatron_dppo.servers.embedded.decoder import BLOCK, KVCacheDecoder
from megatron_dppo.servers.embedded.sampling import murmur_hash32, sample_next_tokens, sample_uniforms, seed_words

ARCHITECTURES = {
    "qwen2": {},  # q/k/v biases
    "qwen3": {},  # per-head q/k RMSNorm
    # Llama 3's scaled RoPE comes from HF's own rotary module
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
}


def random_model(architecture: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_hf_config(architecture, vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_hidden_size=96, **ARCHITECTURES[architecture])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb them so a mix-up cannot pass
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return model


def hf_last_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    """Each sequence alone (no padding) through HF's forward: the logits of its last position."""
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([sequence])).logits[0, -1] for sequence in sequences])


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_prefill_and_steps_equal_hf_forward_with_padding_growth_and_dropped_rows(architecture):
    """fp32, tolerance 1e-5: the same arithmetic in another order (batched, padded) differs by ~1e-7. The steps run
    past two cache growths; rows are duplicated (equal contexts prefilled once) and later dropped."""
    model = random_model(architecture)
    decoder = KVCacheDecoder(model)
    contexts = [[1, 2, 3, 4, 5], [7, 8], [1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14, 15, 16]]
    with torch.no_grad():
        state, hidden = decoder.prefill(contexts)
        for row, context in enumerate(contexts):  # every prompt position, as prompt log-probs need them
            expected = model(input_ids=torch.tensor([context])).logits[0]
            got = decoder.logits(hidden[row, hidden.shape[1] - len(context):])
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        sequences = [list(context) for context in contexts]
        logits = decoder.logits(hidden[:, -1])
        # HF's forward is slow on whole sequences: compare around each cache growth (the 8-token prefill leaves
        # BLOCK - 8 empty slots) and around the drop
        growths = [BLOCK - 8, 2 * BLOCK - 8]
        checked = {0, BLOCK, BLOCK + 1, 2 * BLOCK + 2} | {step + offset for step in growths for offset in (-1, 0, 1)}
        for step in range(2 * BLOCK + 3):
            if step in checked:
                torch.testing.assert_close(logits, hf_last_logits(model, sequences), atol=1e-5, rtol=0)
            tokens = logits.argmax(dim=-1) if step % 2 else torch.randint(0, 50, (len(sequences),))
            for sequence, token in zip(sequences, tokens.tolist()):
                sequence.append(token)
            if step == BLOCK:  # keep rows 3 and 0, in that order
                kept = torch.tensor([3, 0])
                decoder.keep(state, kept)
                sequences, tokens = [sequences[3], sequences[0]], tokens[kept]
            logits = decoder.logits(decoder.step(state, tokens))


def unfused_logits(model, sequences: list[list[int]], steps: int, seed: int) -> tuple[torch.Tensor, list]:
    """The decode computed projection by projection, the way the engine computed it before its step was fused: each
    sequence alone, HF's own modules (q/k/v, o, gate/up/down as separate linear layers, its RMSNorm modules, its
    rotary module and rotate_half), softmax(q·kᵀ·scale + mask)·v over a K/V cache that grows by concatenation.
    Feeds `steps` seeded random tokens after each sequence; returns the logits of every step [steps + 1, B, V]
    and the tokens fed."""
    from transformers.models.llama.modeling_llama import rotate_half

    generator = torch.Generator().manual_seed(seed)
    fed = torch.randint(0, model.config.vocab_size, (steps, len(sequences)), generator=generator)
    layers, all_logits = model.model.layers, []
    for row, sequence in enumerate(sequences):
        cache = [([], []) for _ in layers]
        row_logits = []
        tokens = list(sequence)
        for position in range(len(sequence) + steps):
            if position >= len(sequence):
                tokens.append(int(fed[position - len(sequence), row]))
            hidden = model.model.embed_tokens(torch.tensor([[tokens[position]]]))  # [1, 1, hidden]
            cos, sin = model.model.rotary_emb(hidden, torch.tensor([[position]]))
            for layer, (keys, values) in zip(layers, cache):
                attention, mlp = layer.self_attn, layer.mlp
                normed = layer.input_layernorm(hidden)
                shape = (1, 1, -1, attention.head_dim)
                query = attention.q_proj(normed).view(shape)
                key = attention.k_proj(normed).view(shape)
                if hasattr(attention, "q_norm"):
                    query, key = attention.q_norm(query), attention.k_norm(key)
                query, key = query.transpose(1, 2), key.transpose(1, 2)  # [1, heads, 1, D]
                query = query * cos[:, None] + rotate_half(query) * sin[:, None]
                keys.append(key * cos[:, None] + rotate_half(key) * sin[:, None])
                values.append(attention.v_proj(normed).view(shape).transpose(1, 2))
                groups = query.shape[1] // keys[0].shape[1]
                all_keys = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)
                all_values = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
                scores = torch.softmax(query @ all_keys.transpose(2, 3) * attention.scaling, dim=-1)
                hidden = hidden + attention.o_proj((scores @ all_values).transpose(1, 2).reshape(1, 1, -1))
                normed = layer.post_attention_layernorm(hidden)
                hidden = hidden + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))
            if position >= len(sequence) - 1:
                row_logits.append(model.lm_head(model.model.norm(hidden))[0, 0])
        all_logits.append(torch.stack(row_logits))
    return torch.stack(all_logits, dim=1), fed


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_fused_steps_equal_the_unfused_step_with_padding_and_cache_growth(architecture):
    """The fused step (one q/k/v multiply, one gate/up multiply, the RoPE table, 2-D activations, SDPA for decode
    attention) gives the logits of the step computed projection by projection, fp32, within the engine's 1e-5
    (the same arithmetic in another order: ~1e-7 apart), over a cache growth, for rows of different lengths."""
    model = random_model(architecture)
    decoder = KVCacheDecoder(model)
    sequences = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    steps = BLOCK + 2
    with torch.no_grad():
        expected, fed = unfused_logits(model, sequences, steps, seed=3)
        state, hidden = decoder.prefill(sequences)
        got = [decoder.logits(hidden[:, -1])]
        for step in range(steps):
            got.append(decoder.logits(decoder.step(state, fed[step])))
    torch.testing.assert_close(torch.stack(got), expected, atol=1e-5, rtol=0)


def test_the_rope_table_holds_exactly_what_the_rotary_module_gives_and_dynamic_rope_calls_the_module():
    """Per position, the table's cos equals the module's, and its signed sin is the module's sin with rotate_half's
    signs, bit for bit. A RoPE type whose frequencies depend on the sequence length (dynamic) is not tabled: the
    module computes every step, and the logits still equal HF's."""
    model = random_model("llama")
    decoder = KVCacheDecoder(model)
    positions = torch.arange(40)
    cos, sin = model.model.rotary_emb(torch.empty(0), positions[None])
    table_cos, table_signed_sin = decoder.rope.lookup(positions)
    half = cos.shape[-1] // 2
    assert decoder.rope.by_position
    assert torch.equal(table_cos, cos[0]) and torch.equal(table_signed_sin[:, half:], sin[0, :, half:])
    assert torch.equal(table_signed_sin[:, :half], -sin[0, :, :half])

    from transformers import AutoModelForCausalLM

    config = tiny_hf_config("llama", vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_hidden_size=96, max_position_embeddings=16,
                            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    torch.manual_seed(0)
    dynamic = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    decoder = KVCacheDecoder(dynamic)
    assert not decoder.rope.by_position
    sequences = [[1, 2, 3] + list(range(4, 14))]  # within max_position_embeddings, where HF's forward and a cache agree
    with torch.no_grad():
        state, hidden = decoder.prefill([sequences[0][:3]])
        for token in sequences[0][3:]:
            hidden = decoder.step(state, torch.tensor([token]))
        torch.testing.assert_close(decoder.logits(hidden), hf_last_logits(dynamic, sequences), atol=1e-5, rtol=0)


def test_weights_loaded_by_hf_name_reach_the_fused_matrices_written_in_place_or_rebuilt_when_re_pointed():
    """The engine's load path by HF name: a fused part (q_proj) is written into, so its fused matrix holds the new
    weights with no rebuild; a load that re-points a part (adopting a received buffer) makes the next prefill rebuild
    that fused matrix. Either way the logits are HF's with the new weights."""
    from megatron_dppo.servers.embedded.prefix_cache import PrefixCache
    from megatron_dppo.servers.embedded.weights import WeightUpdates

    model = random_model("qwen2")
    decoder = KVCacheDecoder(model)
    assert "model.layers.0.self_attn.q_proj.weight" in decoder.fused_parameter_names
    assert "model.layers.0.self_attn.o_proj.weight" not in decoder.fused_parameter_names  # a matrix of its own
    contexts = [[3, 4, 5]]
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.1.self_attn.k_proj.bias"]
    parameters = dict(model.named_parameters())
    for in_place in (decoder.fused_parameter_names, frozenset()):
        updates = WeightUpdates(model, PrefixCache(0), None, in_place)
        new = [(name, torch.randn_like(parameters[name])) for name in names]
        with torch.no_grad():
            before = decoder.logits(decoder.prefill(contexts)[1][:, -1])
            updates.load_named_tensors(new, adopt=True)
            assert all(torch.equal(parameters[name], tensor) for name, tensor in new)
            assert decoder.refresh() == (0 if in_place else 3)  # rebuilt only where a part was re-pointed
            after = decoder.logits(decoder.prefill(contexts)[1][:, -1])
        assert not torch.allclose(before, after)
        torch.testing.assert_close(after, hf_last_logits(model, contexts), atol=1e-5, rtol=0)


def test_decoder_reads_weights_at_call_time():
    """The engine loads new weights into the model's parameters (in place or by re-pointing .data): the decoder must
    compute with them from its next call, with nothing cached across weight versions."""
    model = random_model("qwen2")
    decoder = KVCacheDecoder(model)
    contexts = [[3, 4, 5]]
    with torch.no_grad():
        before = decoder.logits(decoder.prefill(contexts)[1][:, -1])
        layer = model.model.layers[0]
        layer.mlp.up_proj.weight.mul_(2.0)  # in place
        layer.self_attn.q_proj.weight.data = torch.randn_like(layer.self_attn.q_proj.weight)  # re-pointed
        after = decoder.logits(decoder.prefill(contexts)[1][:, -1])
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, hf_last_logits(model, contexts), atol=1e-5, rtol=0)


def test_unsupported_models_are_refused_with_the_reason():
    from transformers import AutoModelForCausalLM, GPT2Config

    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        KVCacheDecoder(AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))
    config = tiny_hf_config("qwen2", vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_hidden_size=96, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        KVCacheDecoder(AutoModelForCausalLM.from_config(config))


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """The reference MurmurHash3_x86_32, byte by byte (Austin Appleby's algorithm)."""
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    h, length = seed, len(data)
    for block in range(length // 4):
        k = struct.unpack_from("<I", data, 4 * block)[0]
        k = rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    tail, k = data[4 * (length // 4):], 0
    for index, byte in enumerate(tail):
        k |= byte << (8 * index)
    if tail:
        h ^= rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
    h ^= length
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_seed_hash_is_murmur3_of_seed_position_column_as_sglang_lays_them_out():
    """SGLang hashes the 16 bytes (seed as uint64, position as uint32, column as uint32), little-endian, with
    MurmurHash3_x86_32 and hash seed 0; the reference implementation is checked on a published test vector first."""
    assert murmur3_x86_32(b"The quick brown fox jumps over the lazy dog") == 0x2E4FF723
    cases = [(42, 0, 0), (7, 19, 0), (2**63 - 25, 1_000_003, 5), (2**64 - 1, 2**32 - 1, 2**32 - 1), (123456789, 3, 17)]
    for seed, position, column in cases:
        low, high = seed_words(seed)
        got = murmur_hash32(*(torch.tensor([value]) for value in (low, high, position, column)))
        assert int(got) == murmur3_x86_32(struct.pack("<QII", seed, position, column)), (seed, position, column)


def test_seeded_uniforms_depend_on_seed_and_position_only_and_are_uniform():
    generator = torch.Generator().manual_seed(0)
    seeds = torch.arange(1000, 1000 + 2000)
    words = torch.tensor([seed_words(int(seed)) for seed in seeds])
    seeded = torch.ones(len(seeds), dtype=torch.bool)
    first = torch.randint(0, 500, (len(seeds),), generator=generator)
    table = sample_uniforms(words[:, 0], words[:, 1], seeded, first, 8, generator)  # [2000, 8]
    alone = sample_uniforms(words[5:6, 0], words[5:6, 1], seeded[5:6], first[5:6] + 3, 5, generator)
    assert torch.equal(alone[0], table[5, 3:])  # another batch, another starting point: the same draws
    assert 0 < table.min() and table.max() < 1
    # 16,000 draws: each decile holds 1,600 ± 40 (one standard deviation); 200 is five of them
    counts = torch.histc(table.float(), bins=10, min=0, max=1)
    assert (counts - 1600).abs().max() < 200, counts
    unseeded = sample_uniforms(words[:4, 0], words[:4, 1], torch.zeros(4, dtype=torch.bool), first[:4], 8, generator)
    assert not torch.equal(unseeded, table[:4])


def test_inverse_cdf_draws_follow_the_filtered_law():
    """50,000 draws per law: a frequency's standard deviation is at most 0.0023; the tolerance is 0.01."""
    uniforms = torch.rand(50_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15]])).repeat(len(uniforms), 1)
    ones, every = torch.ones(len(uniforms)), torch.full((len(uniforms),), -1)
    laws = {(1.0, -1): [0.1, 0.4, 0.05, 0.3, 0.15], (1.0, 2): [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7, 0.0],
            (0.75, -1): [0.0, 0.4 / 0.85, 0.0, 0.3 / 0.85, 0.15 / 0.85]}
    for (top_p, top_k), law in laws.items():
        tokens, _ = sample_next_tokens(logits, ones, torch.full_like(ones, top_p), torch.full_like(every, top_k),
                                       uniforms)
        frequencies = torch.bincount(tokens, minlength=5).double() / len(tokens)
        torch.testing.assert_close(frequencies, torch.tensor(law, dtype=torch.float64), atol=0.01, rtol=0)

"""Batched KV-cache decoding for the embedded engine, computed from an HF Qwen2 / Qwen3 / Llama model's own parameters.

contexts ──► prefill: [B, T] left-padded, one pass with a causal + padding mask; K/V written into a contiguous cache
             [B, kv_heads, slots, head_dim] per layer ──► final hidden states [B, T, hidden]. A context whose first
             tokens the prefix cache holds (prefix_cache.py) has their K/V copied in, and the pass runs only
             over the last W positions, W the longest uncached part of any row ──► hidden states [B, W, hidden]
tokens   ──► step: one position per row, K/V written in place at the next slot (the cache grows by BLOCK slots when
             full), attention over every slot of the cache, empty and padding slots masked ──► hidden [B, hidden]
finished rows ──► keep(rows): the cache shrinks to the rows still generating

Why not the HF module's forward: at the engine's batch sizes on CPU, HF's generic path (a causal mask built per
call, a DynamicCache that concatenates every layer's K/V at every step, module dispatch) costs more than the
matmuls. A cache sliced to its filled part would be a strided operand, which CPU batched matmul copies first (slower
than the contiguous case: docs/rollout.md gives the command and its figure); so the cache grows in blocks and
attention reads all of it. The arithmetic
here is HF's own, op for op: RMSNorm in fp32 then cast, q/k norms (Qwen3), the model's own
rotary module (so every RoPE type HF implements), SDPA with a boolean mask for the prefill, softmax(q·kᵀ·scale)·v
for single-position steps, SiLU-gated MLP. tests/test_rollout_decoder.py checks it against HF's forward.

The decoder runs where the model's parameters are (the engine's --device): the CPU, or a GPU, where a decode step
costs about the same for 1 row as for 64 (bench/step_cost.py measures what that does to partial rollouts). Its
callers stay on the host: prefill and step take host token ids, keep takes host row indices, and logits come back
to the host, where sampling draws from its seeded uniforms alike on either device.

Invariants:
- the parameters are read through the model's Parameter objects on every call, so a weight update (in place or by
  re-pointing `.data`) is seen by the next step, and nothing is cached across weight versions;
- a pad slot is never attended to by a real position; a pad position attends to itself only (never to nothing, which
  would make NaNs that then reach real positions through 0 x NaN);
- a model outside what this implements (another architecture, sliding-window layers, another activation) is
  refused when the decoder is built, naming what is unsupported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_dppo.servers.embedded.prefix_cache import CachedPrefix

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# Cache slots added at a time: an empty slot costs one masked read per step, a growth copies the cache once.
BLOCK = 16


def unsupported_reason(config) -> str | None:
    """Why the decoder cannot run a model with this HF config, or None."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    layer_types = getattr(config, "layer_types", None) or []
    if any(layer_type != "full_attention" for layer_type in layer_types):
        return f"layer_types {sorted(set(layer_types))} (only full_attention; no sliding-window layers)"
    return None


@dataclass
class Layer:
    """One decoder layer's modules (their parameters are read at call time)."""

    input_norm: torch.nn.Module
    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    q_norm: torch.nn.Module | None  # Qwen3's per-head RMSNorm on queries and keys
    k_norm: torch.nn.Module | None
    o_proj: torch.nn.Module
    post_norm: torch.nn.Module
    gate_proj: torch.nn.Module
    up_proj: torch.nn.Module
    down_proj: torch.nn.Module


@dataclass
class DecodeState:
    """The KV cache of one batch. Rows are the live sequences, in the order given to prefill, minus those dropped."""

    keys: list[torch.Tensor]  # per layer [B, kv_heads, slots, head_dim], contiguous
    values: list[torch.Tensor]
    attention_bias: torch.Tensor  # [B, 1, 1, slots] float: 0 at filled slots, -inf at left padding and empty slots
    positions: torch.Tensor  # [B] long, the position id of each row's next token
    length: int  # slots filled so far (the same for every row: left padding aligns the ends)
    starts: torch.Tensor  # [B] long, each row's first filled slot (its left padding ends there)

    def grow(self, slots: int) -> None:
        """Room for `slots` more positions: new contiguous tensors, the filled part copied."""
        def extended(tensor: torch.Tensor) -> torch.Tensor:
            filled = tensor.shape[-2]
            grown = tensor.new_empty((*tensor.shape[:-2], filled + slots, tensor.shape[-1]))
            grown[..., :filled, :] = tensor
            grown[..., filled:, :] = 0.0  # an empty slot is read (and masked): its score must stay finite
            return grown

        self.keys = [extended(keys) for keys in self.keys]
        self.values = [extended(values) for values in self.values]
        bias = self.attention_bias
        self.attention_bias = torch.cat([bias, bias.new_full((*bias.shape[:-1], slots), float("-inf"))], dim=-1)

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]


def rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """HF's Qwen2/Qwen3/Llama RMSNorm: statistics in fp32, the weight applied in the input dtype."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


def linear(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, module.weight, module.bias)


def select_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor[rows] along dim 0, as whole rows: index_select on the 2-D view copies each row in one piece (on the 4-D
    tensor it is several times slower, measured)."""
    return tensor.flatten(1).index_select(0, rows).view(len(rows), *tensor.shape[1:])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCacheDecoder:
    """Prefill and single-position steps of an HF causal LM (see the module docstring)."""

    def __init__(self, model):
        reason = unsupported_reason(model.config)
        if reason is not None:
            raise ValueError(f"the embedded engine cannot serve this model: {reason}")
        config = model.config
        self.model = model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.final_norm = model.model.norm
        self.layers = [Layer(layer.input_layernorm, layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj, getattr(layer.self_attn, "q_norm", None),
                             getattr(layer.self_attn, "k_norm", None), layer.self_attn.o_proj,
                             layer.post_attention_layernorm, layer.mlp.gate_proj, layer.mlp.up_proj,
                             layer.mlp.down_proj)
                       for layer in model.model.layers[:config.num_hidden_layers]]
        self.scaling = model.model.layers[0].self_attn.scaling

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token of one sequence takes (keys and values of every layer)."""
        return 2 * len(self.layers) * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer on final hidden states [..., hidden] → fp32 logits [..., vocab], on the host."""
        return self.device_logits(hidden).cpu()

    def device_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The fp32 logits [..., vocab] where the model is (tools/gpu_check.py times them apart from their copy)."""
        return F.linear(hidden, self.model.lm_head.weight).float()

    def prefill(self, contexts: list[list[int]], pad_token_id: int = 0,
                prefixes: list[CachedPrefix | None] | None = None) -> tuple[DecodeState, torch.Tensor]:
        """Run the left-padded contexts; returns the cache and the final hidden states [B, W, hidden] of each row's
        last W positions (row r's context ends at W - 1): W is the longest context, or, with `prefixes` (per
        context, the cached K/V of its first tokens or None), the longest part of a context that no prefix covers.
        Equal contexts (the n samples of one prompt) are run once and their cache rows copied."""
        distinct: dict[tuple[int, ...], int] = {}
        source = torch.tensor([distinct.setdefault(tuple(context), len(distinct)) for context in contexts])
        first = {}
        for row, index in enumerate(source.tolist()):
            first.setdefault(index, row)
        distinct_prefixes = [prefixes[first[index]] if prefixes else None for index in range(len(distinct))]
        state, hidden = self._prefill_distinct([list(context) for context in distinct], pad_token_id,
                                               distinct_prefixes)
        if len(distinct) < len(contexts):
            self.keep(state, source)
            hidden = hidden.index_select(0, source.to(self.device))
        return state, hidden

    def _prefill_distinct(self, contexts: list[list[int]], pad_token_id: int,
                          prefixes: list[CachedPrefix | None]) -> tuple[DecodeState, torch.Tensor]:
        width = max(map(len, contexts))
        slots = -(-(width + 1) // BLOCK) * BLOCK
        batch = len(contexts)
        starts = torch.tensor([width - len(context) for context in contexts])
        cached = torch.tensor([prefix.length if prefix else 0 for prefix in prefixes])
        window = int((width - starts - cached).max())  # the positions computed: the last `window` of every row
        input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
        valid = torch.zeros(batch, slots, dtype=torch.bool)
        for row, context in enumerate(contexts):
            input_ids[row, width - len(context):] = torch.tensor(context, dtype=torch.long)
            valid[row, width - len(context):width] = True
        input_ids, valid, starts, cached = (tensor.to(self.device) for tensor in (input_ids, valid, starts, cached))
        position_ids = (valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)  # [B, T], as HF numbers left padding
        query_slots = torch.arange(width - window, width, device=self.device)  # [W]
        key_slots = torch.arange(width, device=self.device)
        # [B, 1, W, T]: causal and not padding; a pad position sees itself so that its row of scores is not empty
        mask = ((key_slots[None] <= query_slots[:, None])[None] & valid[:, None, :width]
                | (key_slots[None] == query_slots[:, None])[None])[:, None]
        shape = (batch, self.num_kv_heads, slots, self.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        bias = torch.zeros(batch, 1, 1, slots, dtype=self.dtype, device=self.device).masked_fill_(
            ~valid[:, None, None], float("-inf"))
        state = DecodeState(keys, values, bias, position_ids[:, -1] + 1, width, starts)
        for row, prefix in enumerate(prefixes):
            if prefix is not None:
                start = int(starts[row])
                for index in range(len(self.layers)):
                    keys[index][row, :, start:start + prefix.length] = prefix.keys[index]
                    values[index][row, :, start:start + prefix.length] = prefix.values[index]
        # [B, 1, W, 1]: the window slots whose K/V this pass writes (not those a prefix gave, nor left padding)
        computed = (query_slots[None] >= (starts + cached)[:, None])[:, None, :, None]
        from_cache = window < width or bool(cached.any())

        hidden = self.embed(input_ids[:, width - window:])  # [B, W, hidden]
        cos, sin = self.rotary(hidden, position_ids[:, width - window:])  # [B, W, head_dim]
        for index, layer in enumerate(self.layers):
            residual = hidden
            query, key, value = self._qkv(layer, rms_norm(layer.input_norm, hidden), cos, sin)  # [B, heads, W, D]
            if from_cache:  # attend over the whole context: the prefixes' K/V and this pass's
                keys[index][:, :, width - window:width] = torch.where(computed, key,
                                                                      keys[index][:, :, width - window:width])
                values[index][:, :, width - window:width] = torch.where(computed, value,
                                                                        values[index][:, :, width - window:width])
                key, value = keys[index][:, :, :width], values[index][:, :, :width]
            else:
                keys[index][:, :, :width] = key
                values[index][:, :, :width] = value
            attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scaling,
                                                      enable_gqa=self.num_kv_heads != self.num_heads)
            hidden = residual + linear(layer.o_proj, attended.transpose(1, 2).reshape(batch, window, -1))
            hidden = hidden + self._mlp(layer, rms_norm(layer.post_norm, hidden))
        return state, rms_norm(self.final_norm, hidden)

    @staticmethod
    def processed(state: DecodeState, row: int, count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the K/V of cache row `row`'s first `count` filled slots, per layer [kv_heads, count, D]."""
        start = int(state.starts[row])
        return ([keys[row, :, start:start + count].clone() for keys in state.keys],
                [values[row, :, start:start + count].clone() for values in state.values])

    def step(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row [B]; returns the final hidden states [B, hidden] at that position."""
        batch, slot = state.batch_size, state.length
        if slot == state.keys[0].shape[2]:
            state.grow(BLOCK)
        state.attention_bias[:, :, :, slot] = 0.0
        hidden = self.embed(tokens.to(self.device)[:, None])  # [B, 1, hidden]
        cos, sin = self.rotary(hidden, state.positions[:, None])
        groups = self.num_heads // self.num_kv_heads
        for index, layer in enumerate(self.layers):
            residual = hidden
            query, key, value = self._qkv(layer, rms_norm(layer.input_norm, hidden), cos, sin)  # [B, heads, 1, D]
            state.keys[index][:, :, slot:slot + 1] = key
            state.values[index][:, :, slot:slot + 1] = value
            # the query heads that share a kv head attend together: [B, kv_heads, groups, D] against [B, kv, S, D]
            query = query.reshape(batch, self.num_kv_heads, groups, self.head_dim)
            scores = torch.matmul(query, state.keys[index].transpose(2, 3)) * self.scaling + state.attention_bias
            attended = torch.matmul(torch.softmax(scores, dim=-1), state.values[index])  # [B, kv, groups, D]
            hidden = residual + linear(layer.o_proj, attended.reshape(batch, 1, -1))
            hidden = hidden + self._mlp(layer, rms_norm(layer.post_norm, hidden))
        state.length += 1
        state.positions = state.positions + 1
        return rms_norm(self.final_norm, hidden)[:, 0]

    @staticmethod
    def keep(state: DecodeState, rows: torch.Tensor) -> None:
        """Keep the cache rows `rows` (long indices, in that order; a row may appear more than once)."""
        rows = rows.to(state.positions.device)
        state.keys = [select_rows(keys, rows) for keys in state.keys]
        state.values = [select_rows(values, rows) for values in state.values]
        state.attention_bias = select_rows(state.attention_bias, rows)
        state.positions = state.positions.index_select(0, rows)
        state.starts = state.starts.index_select(0, rows)

    def _qkv(self, layer: Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projections, q/k norms (Qwen3) and RoPE: query [B, heads, T, D], key and value [B, kv_heads, T, D]."""
        batch, length = hidden.shape[:2]
        query = linear(layer.q_proj, hidden).view(batch, length, -1, self.head_dim)
        key = linear(layer.k_proj, hidden).view(batch, length, -1, self.head_dim)
        value = linear(layer.v_proj, hidden).view(batch, length, -1, self.head_dim).transpose(1, 2)
        if layer.q_norm is not None:
            query, key = rms_norm(layer.q_norm, query), rms_norm(layer.k_norm, key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin, value

    @staticmethod
    def _mlp(layer: Layer, hidden: torch.Tensor) -> torch.Tensor:
        return linear(layer.down_proj, F.silu(linear(layer.gate_proj, hidden)) * linear(layer.up_proj, hidden))

"""Batched KV-cache decoding for the embedded engine, computed from an HF Qwen2 / Qwen3 / Llama model's own parameters.

contexts ──► prefill: [B, T] left-padded, one pass with a causal + padding mask; K/V written into a contiguous cache
             [B, kv_heads, slots, head_dim] per layer ──► final hidden states [B, T, hidden]. A context whose first
             tokens the prefix cache holds (prefix_cache.py) has their K/V copied in, and the pass runs only
             over the last W positions, W the longest uncached part of any row ──► hidden states [B, W, hidden]
tokens   ──► step: one position per row on 2-D activations [B, hidden]: one q/k/v matrix multiply, RoPE from a
             table, K/V written in place at the next slot (the cache grows by BLOCK slots when full), attention over
             every slot of the cache, empty and padding slots masked, one gate/up multiply ──► hidden [B, hidden]
finished rows ──► keep(rows): the cache shrinks to the rows still generating

Why not the HF module's forward: at the engine's batch sizes on CPU, HF's generic path (a causal mask built per
call, a DynamicCache that concatenates every layer's K/V at every step, module dispatch) costs more than the
matmuls, and so does every small op of a step: a step of the tiny model is overhead-bound. So a step runs few ops
(bench/decode_step.py counts them): the q, k and v projections are one matrix (and gate and up another), whose
row blocks ARE the HF parameters (FusedMatrix: each part is a view into the fused matrix, so a weight loaded into a
part in place is loaded into the fused matrix); cos and sin come from a table computed once by the model's own
rotary module; residual adds ride on the matrix multiplies (addmm); attention is one SDPA call (its CPU kernel:
0.5-0.7x the time of matmul + softmax + matmul from 16 rows on, measured by bench/decode_step.py). A cache sliced to
its filled part would be a strided operand, which CPU batched matmul copies first (slower than the contiguous case:
docs/rollout.md gives the command and its figure); so the cache grows in blocks and attention reads all of it.
The arithmetic is HF's, in another order at most: RMSNorm in fp32 then cast, q/k norms (Qwen3), the model's own
rotary module (so every RoPE type HF implements), SDPA with a boolean mask for the prefill and an additive one
(-inf at padding and empty slots) for single-position steps, SiLU-gated MLP. tests/test_rollout_decoder.py checks
it against HF's forward and against the step computed projection by projection.

The decoder runs where the model's parameters are (the engine's --device): the CPU, or a GPU, where a decode step
costs about the same for 1 row as for 64 (bench/step_cost.py measures what that does to partial rollouts). Its
callers stay on the host: prefill and step take host token ids, keep takes host row indices, and logits come back
to the host, where sampling draws from its seeded uniforms alike on either device.

Invariants:
- every call computes with the model's current parameters: the fused matrices' parts are the parameters
  themselves, and a part re-pointed elsewhere (a load that adopts a received buffer, a test that assigns `.data`)
  is found at the next prefill, which rebuilds its fused matrix from the parts (refresh); weight loads never
  overlap generation (the engine's model lock), so a batch never sees two weight versions;
- the RoPE table holds what the model's rotary module gives for each position, rebuilt when its inv_freq changes;
  RoPE types whose cos/sin depend on more than the position (dynamic, longrope) call the module at every step;
- a pad slot is never attended to by a real position; a pad position attends to itself only (never to nothing, which
  would make NaNs that then reach real positions through 0 x NaN);
- a model outside what this implements (another architecture, sliding-window layers, another activation) is
  refused when the decoder is built, naming what is unsupported.
"""

from __future__ import annotations

import threading
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


class FusedMatrix:
    """The parameters `attribute` (weight or bias) of `modules`, stacked along dim 0 into one tensor whose row blocks
    the parameters are: q/k/v or gate/up, so that one matrix multiply computes all of them (one module: its own
    parameter, kept with its transpose).

    After refresh() each part's `.data` is a view into `matrix`; a weight loaded into a part in place (copy_, a
    broadcast received into it, noise added) is therefore in the matrix at once. A part whose storage was replaced
    (`.data` re-pointed) is no longer in the matrix: refresh() finds it and builds a new matrix from the parts."""

    def __init__(self, modules: list[torch.nn.Module], attribute: str):
        self.modules = modules
        self.attribute = attribute
        self.matrix: torch.Tensor | None = None
        self.transposed: torch.Tensor | None = None  # matrix.t(), a view kept so that a step does not make it

    def parts(self) -> list[torch.Tensor]:
        return [getattr(module, self.attribute) for module in self.modules]

    def current(self) -> bool:
        """Whether every part is still the view of `matrix` at its rows (pointer arithmetic only: no tensor op)."""
        matrix = self.matrix
        if matrix is None:
            return False
        row, row_bytes = 0, matrix.stride(0) * matrix.element_size()
        for part in self.parts():
            if (part.data_ptr() != matrix.data_ptr() + row * row_bytes or part.shape[1:] != matrix.shape[1:]
                    or part.stride() != matrix.stride() or part.dtype != matrix.dtype or part.device != matrix.device):
                return False
            row += part.shape[0]
        return row == matrix.shape[0]

    @torch.no_grad()
    def refresh(self) -> bool:
        """Rebuild the matrix from the parts unless every part is its view already; returns whether it rebuilt."""
        if self.current():
            return False
        parts = self.parts()
        if len(parts) == 1:  # the parameter itself: nothing to copy
            self.matrix = parts[0].detach().contiguous()
        else:
            self.matrix = torch.cat([part.detach() for part in parts])
        row = 0
        for part in parts:
            part.data = self.matrix[row:row + part.shape[0]]
            row += part.shape[0]
        self.transposed = self.matrix.t() if self.matrix.dim() == 2 else None
        return True


class Projection:
    """The linear layers `modules` as one: their weights in one FusedMatrix, their biases (if any) in another."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.weight = FusedMatrix(modules, "weight")
        present = [module.bias is not None for module in modules]
        if any(present) and not all(present):
            raise ValueError("the embedded engine cannot serve this model: some of the projections "
                             f"{[type(module).__name__ for module in modules]} that it fuses have biases, others not")
        self.bias = FusedMatrix(modules, "bias") if all(present) else None

    def matrices(self) -> list[FusedMatrix]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., in] → [..., out], as F.linear."""
        return F.linear(hidden, self.weight.matrix, self.bias.matrix if self.bias is not None else None)

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """2-D hidden [B, in] → [B, out], the bias added by the multiply (addmm), as F.linear does."""
        if self.bias is not None:
            return torch.addmm(self.bias.matrix, hidden, self.weight.transposed)
        return torch.mm(hidden, self.weight.transposed)

    def rows_plus(self, residual: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """residual + rows(hidden), the residual added by the multiply where there is no bias."""
        if self.bias is not None:
            return residual + self.rows(hidden)
        return torch.addmm(residual, hidden, self.weight.transposed)


@dataclass
class Layer:
    """One decoder layer: its projections (q/k/v fused, gate/up fused) and norms."""

    input_norm: torch.nn.Module
    qkv: Projection  # [B, (heads + 2 kv_heads) x head_dim]
    q_norm: torch.nn.Module | None  # Qwen3's per-head RMSNorm on queries and keys
    k_norm: torch.nn.Module | None
    o_proj: Projection
    post_norm: torch.nn.Module
    gate_up: Projection  # [B, 2 x ffn]
    down_proj: Projection

    def projections(self) -> list[Projection]:
        return [self.qkv, self.o_proj, self.gate_up, self.down_proj]


def fused_layer(layer) -> Layer:
    attention, mlp = layer.self_attn, layer.mlp
    return Layer(layer.input_layernorm, Projection([attention.q_proj, attention.k_proj, attention.v_proj]),
                 getattr(attention, "q_norm", None), getattr(attention, "k_norm", None), Projection([attention.o_proj]),
                 layer.post_attention_layernorm, Projection([mlp.gate_proj, mlp.up_proj]), Projection([mlp.down_proj]))


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
    """HF's Qwen2/Qwen3/Llama RMSNorm: statistics in fp32, the weight applied in the input dtype (for fp32, where
    both casts are no-ops, F.rms_norm: the same arithmetic without a Python op per step of it)."""
    if hidden.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(hidden, (hidden.shape[-1],), norm.weight, norm.variance_epsilon)
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


def select_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor[rows] along dim 0, as whole rows: index_select on the 2-D view copies each row in one piece (on the 4-D
    tensor it is several times slower, measured)."""
    return tensor.flatten(1).index_select(0, rows).view(len(rows), *tensor.shape[1:])


class RopeTable:
    """cos and sin by position id, as the model's rotary module computes them (HF's arithmetic is elementwise per
    position, so a row of the table is exactly what the module gives at that position). The sin table carries
    rotate_half's signs: x·cos + rotate_half(x)·sin = x·cos + roll(x, D/2)·signed_sin, exactly."""

    def __init__(self, rotary: torch.nn.Module, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.rotary, self.dtype, self.device, self.half = rotary, dtype, device, head_dim // 2
        rope_type = getattr(rotary, "rope_type", "default")
        self.by_position = "dynamic" not in rope_type and rope_type != "longrope"
        self.source: tuple | None = None  # what the table was computed from (reserve)
        self.cos = self.signed_sin = None
        self.positions = 0  # rows of the table; a module that is called every time needs none
        self.lock = threading.Lock()

    def _source(self) -> tuple:
        inv_freq = self.rotary.inv_freq
        return inv_freq.data_ptr(), inv_freq._version, self.dtype, self.device

    def reserve(self, positions: int) -> None:
        """Have the rows of positions [0, positions) computed from the module's current frequencies (at least
        doubling the table when it grows)."""
        if not self.by_position:
            self.positions = 1 << 62
            return
        with self.lock:
            same = self.source == self._source()
            if same and self.positions >= positions:
                return
            size = max(positions, 1, 2 * self.positions if same else 0)
            cos, sin = self.module(torch.arange(size, device=self.device)[None])
            self.cos, self.signed_sin = cos[0], self.signed(sin[0])
            self.positions, self.source = size, self._source()

    def module(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's (cos, sin) for position_ids [1 or B, T] (it reads only the probe's dtype and device)."""
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        return self.rotary(probe, position_ids)

    def signed(self, sin: torch.Tensor) -> torch.Tensor:
        return torch.cat((-sin[..., :self.half], sin[..., self.half:]), dim=-1)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [*positions.shape, head_dim] (reserve() first)."""
        if self.by_position:
            return self.cos[positions], self.signed_sin[positions]
        cos, sin = self.module(positions.reshape(1, -1))
        return cos.view(*positions.shape, -1), self.signed(sin).view(*positions.shape, -1)


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
        self.layers = [fused_layer(layer) for layer in model.model.layers[:config.num_hidden_layers]]
        self.scaling = model.model.layers[0].self_attn.scaling
        self.max_positions = getattr(config, "max_position_embeddings", None) or 0
        self.rope = RopeTable(self.rotary, self.head_dim, self.dtype, self.device)
        self.refresh_lock = threading.Lock()
        self.refresh()
        ids = {id(part) for layer in self.layers for projection in layer.projections()
               for matrix in projection.matrices() if len(matrix.modules) > 1 for part in matrix.parts()}
        # HF names of the parameters that are views into a fused matrix of several: a load must write into them (in
        # place), not re-point them, or the fused matrix would have to be rebuilt (weights.py)
        self.fused_parameter_names = frozenset(name for name, parameter in model.named_parameters(
            remove_duplicate=False) if id(parameter) in ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def refresh(self) -> int:
        """Rebuild every fused matrix one of whose parts no longer lives in it, and the RoPE table if the rotary
        frequencies changed; returns the fused matrices rebuilt. Cheap when nothing changed (pointer checks)."""
        with self.refresh_lock:
            rebuilt = sum(matrix.refresh() for layer in self.layers for projection in layer.projections()
                          for matrix in projection.matrices())
        self.rope.dtype, self.rope.device = self.dtype, self.device
        self.rope.reserve(self.max_positions)
        return rebuilt

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
        Equal contexts (the n samples of one prompt) are run once and their cache rows copied. Refreshes the fused
        matrices and the RoPE table first (weights may have been loaded since the last batch)."""
        self.refresh()
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
        self.rope.reserve(width + BLOCK)
        cos, signed_sin = self.rope.lookup(position_ids[:, width - window:])  # [B, W, head_dim]
        for index, layer in enumerate(self.layers):
            residual = hidden
            query, key, value = self._qkv(layer, rms_norm(layer.input_norm, hidden), cos, signed_sin)
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
            hidden = residual + layer.o_proj(attended.transpose(1, 2).reshape(batch, window, -1))
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
        if slot >= self.rope.positions:  # a row's position never exceeds the slots filled
            self.rope.reserve(slot + BLOCK)
        state.attention_bias[:, :, :, slot] = 0.0
        hidden = F.embedding(tokens.to(self.device), self.embed.weight)  # [B, hidden]
        cos, signed_sin = (table[:, None] for table in self.rope.lookup(state.positions))  # [B, 1, D]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        rotated = (heads + kv_heads) * head_dim  # the q and k columns of the fused q/k/v output
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv.rows(rms_norm(layer.input_norm, hidden))  # [B, (H + 2 KV) D]
            query_key = qkv[:, :rotated].view(batch, heads + kv_heads, head_dim)
            if layer.q_norm is not None:
                query_key = torch.cat([rms_norm(layer.q_norm, query_key[:, :heads]),
                                       rms_norm(layer.k_norm, query_key[:, heads:])], dim=1)
            # x·cos + rotate_half(x)·sin, queries and keys at once
            query_key = torch.addcmul(query_key * cos, query_key.roll(head_dim // 2, dims=-1), signed_sin)
            state.keys[index].select(2, slot).copy_(query_key[:, heads:])
            state.values[index].select(2, slot).copy_(qkv[:, rotated:].view(batch, kv_heads, head_dim))
            # one query position per row against every slot of the cache: [B, H, 1, D] → [B, H x D]
            attended = F.scaled_dot_product_attention(query_key[:, :heads, None], state.keys[index],
                                                      state.values[index], attn_mask=state.attention_bias,
                                                      scale=self.scaling, enable_gqa=kv_heads != heads)
            hidden = layer.o_proj.rows_plus(hidden, attended.view(batch, heads * head_dim))
            gate, up = layer.gate_up.rows(rms_norm(layer.post_norm, hidden)).chunk(2, dim=-1)
            hidden = layer.down_proj.rows_plus(hidden, F.silu(gate) * up)
        state.length += 1
        state.positions = state.positions + 1
        return rms_norm(self.final_norm, hidden)

    @staticmethod
    def keep(state: DecodeState, rows: torch.Tensor) -> None:
        """Keep the cache rows `rows` (long indices, in that order; a row may appear more than once)."""
        rows = rows.to(state.positions.device)
        state.keys = [select_rows(keys, rows) for keys in state.keys]
        state.values = [select_rows(values, rows) for values in state.values]
        state.attention_bias = select_rows(state.attention_bias, rows)
        state.positions = state.positions.index_select(0, rows)
        state.starts = state.starts.index_select(0, rows)

    def _qkv(self, layer: Layer, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        """Projections (one fused multiply), q/k norms (Qwen3) and RoPE (cos, signed sin [B, T, D]: RopeTable):
        query [B, heads, T, D], key and value [B, kv_heads, T, D]."""
        batch, length = hidden.shape[:2]
        qkv = layer.qkv(hidden)
        query, key, value = qkv.view(batch, length, -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        if layer.q_norm is not None:
            query, key = rms_norm(layer.q_norm, query), rms_norm(layer.k_norm, key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cos, signed_sin = cos[:, None], signed_sin[:, None]
        half = self.head_dim // 2
        return (torch.addcmul(query * cos, query.roll(half, dims=-1), signed_sin),
                torch.addcmul(key * cos, key.roll(half, dims=-1), signed_sin), value)

    @staticmethod
    def _mlp(layer: Layer, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(hidden).chunk(2, dim=-1)
        return layer.down_proj(F.silu(gate) * up)

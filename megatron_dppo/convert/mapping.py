"""One name/layout table per architecture between Hugging Face and Megatron-Core parameters.

The same tables serve every caller: loading HF weights into a TP/PP-sharded actor, exporting a Megatron checkpoint
to HF, and weight sync to the rollout engines. A caller never re-implements a layout; it asks for

    hf -> megatron:  `layout.shard(read, tp_rank, tp_size)`   (reads only the slice that rank needs)
    megatron -> hf:  `layout.merge(tp_shards)`                 (the TP shards of one parameter, in rank order)

Layouts (Megatron's local and Transformer Engine specs share them):
- replicated: norms; every TP rank holds the whole tensor.
- column: output dim split over TP (dim 0). row: input dim split over TP (dim 1), e.g. linear_proj, linear_fc2.
- vocab: embedding / output layer; dim 0 split over TP after padding the vocabulary with zero rows.
- qkv: Megatron fuses q, k, v per query group: for each group g, [q heads of g; k_g; v_g]; TP splits whole groups.
- gated: linear_fc1 holds [gate; up]; each TP rank holds [gate shard; up shard] (not a slice of [gate; up]).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the layouts import torch when they move tensors: reading a config (--dry-run) stays torch-free
    import torch

# read(hf_name, dim, start, stop) -> the slice [start:stop) of that HF tensor along dim (dim=None: whole tensor).
SliceReader = Callable[[str, "int | None", "int | None", "int | None"], "torch.Tensor"]


@dataclass(frozen=True)
class ModelShape:
    """What a Megatron GPTModel needs to know of an HF decoder config."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None  # HF llama3-style scaling parameters, or None

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def check_parallel(self, tp_size: int, pp_size: int = 1) -> None:
        """Raise a clear error when this model cannot be split `tp_size` x `pp_size` ways."""
        for what, count in (("num_attention_heads", self.num_attention_heads),
                            ("num_key_value_heads (query groups)", self.num_query_groups),
                            ("intermediate_size", self.ffn_hidden_size)):
            if count % tp_size:
                raise ValueError(
                    f"tensor parallel size {tp_size} does not divide {what}={count} of this "
                    f"{self.architecture} config: choose --tensor-model-parallel-size among the divisors of {count}"
                )
        if self.num_layers % pp_size:
            raise ValueError(
                f"pipeline parallel size {pp_size} does not divide num_hidden_layers={self.num_layers}: choose "
                f"--pipeline-model-parallel-size among the divisors of {self.num_layers}"
            )


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Vocabulary rounded up to a multiple of lcm(divisible_by, tp): the same for every power-of-two TP <= 128, so a
    checkpoint reshards across TP sizes without re-padding."""
    multiple = math.lcm(divisible_by, tp_size)
    return -(-vocab_size // multiple) * multiple


VOCAB_READ_ROWS = 8192  # rows of a padded embedding slice read at a time


def _split(total: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    size = total // tp_size
    return tp_rank * size, (tp_rank + 1) * size


@dataclass(frozen=True)
class Layout:
    kind: str  # replicated | column | row | vocab | qkv | gated

    def shard(self, hf_names: Sequence[str], read: SliceReader, shape: ModelShape, tp_rank: int, tp_size: int,
              padded_vocab: int, hf_shape: Callable[[str], tuple]) -> torch.Tensor:
        """Build TP rank `tp_rank`'s shard of a Megatron parameter from the HF tensors `hf_names`."""
        import torch

        if self.kind == "replicated":
            return read(hf_names[0], None, None, None)
        if self.kind == "column":
            start, stop = _split(hf_shape(hf_names[0])[0], tp_rank, tp_size)
            return read(hf_names[0], 0, start, stop)
        if self.kind == "row":
            start, stop = _split(hf_shape(hf_names[0])[1], tp_rank, tp_size)
            return read(hf_names[0], 1, start, stop)
        if self.kind == "vocab":
            start, stop = _split(padded_vocab, tp_rank, tp_size)
            real_stop = min(stop, shape.vocab_size)
            if real_stop == stop:  # no padding in this rank's slice: the rows as read, no second copy
                return read(hf_names[0], 0, start, stop)
            dtype = read(hf_names[0], 0, 0, 0).dtype  # an empty slice: the dtype, no data
            out = torch.zeros(stop - start, shape.hidden_size, dtype=dtype)
            for block in range(start, real_stop, VOCAB_READ_ROWS):  # fill in blocks: peak ~ one slice, not two
                block_stop = min(block + VOCAB_READ_ROWS, real_stop)
                out[block - start: block_stop - start] = read(hf_names[0], 0, block, block_stop)
            return out
        if self.kind == "gated":
            start, stop = _split(shape.ffn_hidden_size, tp_rank, tp_size)
            return torch.cat([read(name, 0, start, stop) for name in hf_names], dim=0)
        if self.kind == "qkv":
            groups = shape.num_query_groups // tp_size
            g0 = tp_rank * groups
            q_rows = shape.heads_per_group * shape.head_dim
            q = read(hf_names[0], 0, g0 * q_rows, (g0 + groups) * q_rows)
            k = read(hf_names[1], 0, g0 * shape.head_dim, (g0 + groups) * shape.head_dim)
            v = read(hf_names[2], 0, g0 * shape.head_dim, (g0 + groups) * shape.head_dim)
            tail = q.shape[1:]
            fused = torch.cat([q.reshape(groups, q_rows, *tail), k.reshape(groups, shape.head_dim, *tail),
                               v.reshape(groups, shape.head_dim, *tail)], dim=1)
            return fused.reshape(groups * (q_rows + 2 * shape.head_dim), *tail)
        raise ValueError(f"unknown layout {self.kind}")

    def merge(self, hf_names: Sequence[str], shards: Sequence[torch.Tensor], shape: ModelShape) -> list:
        """Rebuild the HF tensors (name, tensor) from the TP shards of one Megatron parameter, in rank order."""
        import torch

        if self.kind == "replicated":
            return [(hf_names[0], shards[0])]
        if self.kind == "column":
            return [(hf_names[0], torch.cat(list(shards), dim=0))]
        if self.kind == "row":
            return [(hf_names[0], torch.cat(list(shards), dim=1))]
        if self.kind == "vocab":
            return [(hf_names[0], torch.cat(list(shards), dim=0)[: shape.vocab_size])]
        if self.kind == "gated":
            halves = [shard.chunk(2, dim=0) for shard in shards]
            gate = torch.cat([h[0] for h in halves], dim=0)
            up = torch.cat([h[1] for h in halves], dim=0)
            return [(hf_names[0], gate), (hf_names[1], up)]
        if self.kind == "qkv":
            fused = torch.cat(list(shards), dim=0)
            tail = fused.shape[1:]
            q_rows = shape.heads_per_group * shape.head_dim
            grouped = fused.reshape(shape.num_query_groups, q_rows + 2 * shape.head_dim, *tail)
            q, k, v = grouped.split([q_rows, shape.head_dim, shape.head_dim], dim=1)
            return [(hf_names[0], q.reshape(-1, *tail)), (hf_names[1], k.reshape(-1, *tail)),
                    (hf_names[2], v.reshape(-1, *tail))]
        raise ValueError(f"unknown layout {self.kind}")

    @property
    def tp_dim(self) -> int | None:
        """The dim along which Megatron splits this parameter over TP (None: replicated)."""
        return {"replicated": None, "row": 1}.get(self.kind, 0)


REPLICATED, COLUMN, ROW, VOCAB, QKV, GATED = (
    Layout(kind) for kind in ("replicated", "column", "row", "vocab", "qkv", "gated"))


@dataclass(frozen=True)
class TensorMap:
    """One Megatron parameter and the HF tensors it is made of. `{i}` stands for the global layer index."""

    megatron: str
    hf: tuple[str, ...]
    layout: Layout
    te_megatron: str | None = None  # the name under the Transformer Engine spec, where it differs
    when: str | None = None  # a ModelShape flag that must be true for this row to exist


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_architectures: tuple[str, ...]
    rows: tuple[TensorMap, ...] = field(default_factory=tuple)


_LAYER = "decoder.layers.{i}."
_HF_LAYER = "model.layers.{i}."

# Qwen2/2.5, Qwen3 and Llama 3 share the Llama tensor naming; they differ in qkv bias, q/k norm and rope scaling.
_COMMON_ROWS = (
    TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
    TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED),
    TensorMap("output_layer.weight", ("lm_head.weight",), VOCAB, when="untied"),
    TensorMap(_LAYER + "input_layernorm.weight", (_HF_LAYER + "input_layernorm.weight",), REPLICATED,
              te_megatron=_LAYER + "self_attention.linear_qkv.layer_norm_weight"),
    TensorMap(_LAYER + "self_attention.linear_qkv.weight",
              tuple(_HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"), QKV),
    TensorMap(_LAYER + "self_attention.linear_qkv.bias",
              tuple(_HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"), QKV, when="qkv_bias"),
    TensorMap(_LAYER + "self_attention.q_layernorm.weight", (_HF_LAYER + "self_attn.q_norm.weight",), REPLICATED,
              when="qk_norm"),
    TensorMap(_LAYER + "self_attention.k_layernorm.weight", (_HF_LAYER + "self_attn.k_norm.weight",), REPLICATED,
              when="qk_norm"),
    TensorMap(_LAYER + "self_attention.linear_proj.weight", (_HF_LAYER + "self_attn.o_proj.weight",), ROW),
    TensorMap(_LAYER + "pre_mlp_layernorm.weight", (_HF_LAYER + "post_attention_layernorm.weight",), REPLICATED,
              te_megatron=_LAYER + "mlp.linear_fc1.layer_norm_weight"),
    TensorMap(_LAYER + "mlp.linear_fc1.weight",
              (_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"), GATED),
    TensorMap(_LAYER + "mlp.linear_fc2.weight", (_HF_LAYER + "mlp.down_proj.weight",), ROW),
)

ARCHITECTURES = {
    "qwen2": Architecture("qwen2", ("Qwen2ForCausalLM",), _COMMON_ROWS),
    "qwen3": Architecture("qwen3", ("Qwen3ForCausalLM",), _COMMON_ROWS),
    "llama": Architecture("llama", ("LlamaForCausalLM",), _COMMON_ROWS),
}


def architecture_of(config: dict) -> Architecture:
    """The table for an HF config.json dict; a clear error lists the supported ones."""
    model_type = config.get("model_type")
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    for arch in ARCHITECTURES.values():
        if set(config.get("architectures") or ()) & set(arch.hf_architectures):
            return arch
    supported = ", ".join(f"{a.name} ({'/'.join(a.hf_architectures)})" for a in ARCHITECTURES.values())
    raise ValueError(
        f"unsupported architecture in config.json: model_type={model_type!r}, "
        f"architectures={config.get('architectures')!r}. Supported: {supported}"
    )


def _rope_parameters(config: dict) -> tuple[float, dict | None]:
    params = dict(config.get("rope_parameters") or {})
    legacy_scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = {**legacy_scaling, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r} in config.json: supported are 'default' and 'llama3'")
    return float(theta), {
        "factor": float(scaling["factor"]),
        "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
        "high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
        "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 8192)),
    }


def model_shape(config: dict) -> ModelShape:
    """Read the fields a GPTModel needs from an HF config.json dict."""
    arch = architecture_of(config)
    heads = config["num_attention_heads"]
    theta, scaling = _rope_parameters(config)
    qkv_bias = {"qwen2": True, "qwen3": bool(config.get("attention_bias", False)),
                "llama": bool(config.get("attention_bias", False))}[arch.name]
    if config.get("mlp_bias"):
        raise ValueError("config.json sets mlp_bias=true, which no supported architecture uses: set it to false")
    return ModelShape(
        architecture=arch.name,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        ffn_hidden_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=arch.name == "qwen3",
        rope_scaling=scaling,
    )


def _row_applies(row: TensorMap, shape: ModelShape) -> bool:
    flags = {None: True, "untied": not shape.tie_word_embeddings, "qkv_bias": shape.qkv_bias,
             "qk_norm": shape.qk_norm}
    return flags[row.when]


def parameter_rows(shape: ModelShape) -> list[TensorMap]:
    """The rows of this model's table that exist for its config."""
    return [row for row in ARCHITECTURES[shape.architecture].rows if _row_applies(row, shape)]


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def find_row(megatron_name: str, shape: ModelShape) -> tuple[TensorMap, int | None]:
    """The table row of a global Megatron parameter name (local or TE spec) and its layer index (None: not a layer).

    `output_layer.weight` of a tied model (a PP last stage holds a copy of the embedding) maps to the embedding's HF
    tensor."""
    match = _LAYER_RE.match(megatron_name)
    layer, key = (int(match.group(1)), _LAYER + match.group(2)) if match else (None, megatron_name)
    if key == "output_layer.weight" and shape.tie_word_embeddings:
        key = "embedding.word_embeddings.weight"
    for row in parameter_rows(shape):
        if key in (row.megatron, row.te_megatron):
            return row, layer
    raise KeyError(f"no {shape.architecture} mapping for Megatron parameter {megatron_name!r}")


def hf_names_of(row: TensorMap, layer: int | None) -> tuple[str, ...]:
    return tuple(name.format(i=layer) for name in row.hf)


def expected_hf_names(shape: ModelShape) -> list[str]:
    """Every HF tensor name a checkpoint of this model holds."""
    names = []
    for row in parameter_rows(shape):
        layers = range(shape.num_layers) if "{i}" in row.megatron else [None]
        for layer in layers:
            names.extend(hf_names_of(row, layer))
    return names

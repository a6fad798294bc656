"""Build a Megatron-Core GPTModel from an HF config.json and load HF safetensors weights into its TP/PP shards.

The model's last pipeline stage stops before the output layer (`FusedOutputGPTModel`): it returns the final hidden
states and the loss gets them with the output layer's weight (`OutputLayerInput`), so log-probs come straight from
hidden states and weight (actor/logprobs.py) and no [T, V/tp] logits tensor exists, on the CPU as on the GPU.

The layer spec is Megatron-LM's `--transformer-impl` (`TransformerConfig.transformer_impl`):
`transformer_engine` (the default on a GPU): TE's layers; TE attention takes packed THD input natively.
`local` (the default, and the only choice, on the CPU; a GPU without TE): megatron-core's local spec with
`core_attention` swapped (a supported ModuleSpec extension) for `SDPACoreAttention`, because the local
`DotProductAttention` refuses `PackedSeqParams`. Both specs receive the same `packed_seq_params`, so the THD data path
is one path.

A model is finished as Megatron-LM's `get_model` finishes it (`place_model`): moved to its device, then, for bf16 and
fp16, wrapped in `Float16Module`, which casts every floating parameter and buffer. Invariant after it: every
parameter and buffer is on the actor's device and in the training dtype.
"""

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dppo.actor.logprobs import OutputLayerInput
from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
from megatron_dppo.convert.mapping import ModelShape, find_row, hf_names_of, padded_vocab_size
from megatron_dppo.errors import UserInputError
from megatron_dppo.platform import default_transformer_impl, is_cpu, transformer_impl_error

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Recompute:
    """Megatron-LM's activation recompute (`--recompute-granularity`, `--recompute-method`, `--recompute-num-layers`),
    passed to TransformerConfig under its own field names, as Megatron-LM passes them. full: each layer (uniform: each
    chunk of `num_layers` layers; block: the first `num_layers` layers of each pipeline stage) keeps only its input
    and runs its forward again in backward; selective: core attention alone, in every layer. None: nothing."""

    granularity: str | None = None  # full | selective
    method: str | None = None  # uniform | block (full only)
    num_layers: int | None = None  # full only

    def config_fields(self) -> dict:
        return {f"recompute_{name}": value for name, value in asdict(self).items()}


class SDPACoreAttention(MegatronModule):
    """Core attention through `F.scaled_dot_product_attention`, for BSHD and packed THD input.

    THD: q [t, heads, head_dim], k/v [t, groups, head_dim]; each sequence of `cu_seqlens` (the padded spans when
    `cu_seqlens_q_padded` is set) attends causally within itself, exactly as if it were run alone.
    BSHD: q [s, b, heads, head_dim]; causal, or the given boolean mask (True = masked).
    Returns [t, heads * head_dim] or [s, b, heads * head_dim], as Megatron's attention expects.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("SDPACoreAttention does not support context parallelism: use the GPU (TE) layer spec")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def _attend(self, query, key, value, mask=None):
        # [heads, seq, dim] (or [b, heads, seq, dim]); GQA through enable_gqa
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
            enable_gqa=query.shape[-3] != key.shape[-3],
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention bias")
        if packed_seq_params is not None:
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded
            if cu_seqlens is None:
                cu_seqlens = packed_seq_params.cu_seqlens_q
            cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.long)
            starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
            out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])  # [t, heads, dim]
            # Sequences of equal length run as one batched causal SDPA call: exact, and far cheaper than a
            # [t, t] block-diagonal mask or a Python loop over many short sequences.
            for length in lengths.unique().tolist():
                if length == 0:
                    continue
                positions = starts[lengths == length][:, None] + torch.arange(length, device=query.device)  # [n, L]
                q, k, v = (x[positions].transpose(1, 2) for x in (query, key, value))  # [n, heads, L, dim]
                out[positions] = self._attend(q, k, v).transpose(1, 2)
            return out.reshape(out.shape[0], -1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, dim]
        mask = None if attention_mask is None else ~attention_mask
        out = self._attend(q, k, v, mask)  # [b, heads, s, dim]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


class FusedOutputGPTModel(GPTModel):
    """GPTModel whose last pipeline stage returns the final hidden states [s, b, H] (after the final norm; [s / tp,
    b, H] under sequence parallelism), as its other stages return theirs, instead of applying the output layer.
    `output_layer_input(hidden)` hands them to the loss with the output layer and its weight: the embedding's when
    they are tied and this stage holds the embedding, the last stage's copy of it when PP > 1, its own otherwise,
    exactly the weight GPTModel's `_postprocess` would pass."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        if config.mtp_num_layers:
            raise ValueError("multi-token prediction (mtp_num_layers) is not supported: the actor's output layer is "
                             "fused with its log-probs (actor/logprobs.py)")
        super().__init__(config, *args, **kwargs)

    def _postprocess(self, hidden_states, labels=None, inference_context=None, **kwargs):
        if labels is not None or inference_context is not None:
            raise ValueError("FusedOutputGPTModel returns hidden states, not a language-model loss or inference "
                             "logits: compute log-probs with output_layer_input(hidden).logprobs(targets)")
        return hidden_states

    def output_layer_input(self, hidden_states: torch.Tensor) -> OutputLayerInput:
        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight)
        return OutputLayerInput(hidden_states, self.output_layer, weight, self.shape.vocab_size)


def build_transformer_config(shape: ModelShape, tp_size: int = 1, pp_size: int = 1, dtype: str = "fp32",
                             sequence_parallel: bool = False, transformer_impl: str | None = None,
                             **overrides) -> TransformerConfig:
    """The TransformerConfig of `shape` for this parallel layout and layer implementation (default:
    `default_transformer_impl()`). Dropout is 0 (RL recomputes log-probs that must match the rollout engine's)."""
    shape.check_parallel(tp_size, pp_size)
    transformer_impl = transformer_impl or default_transformer_impl()
    problem = transformer_impl_error(transformer_impl)
    if problem:
        raise UserInputError(problem)
    params_dtype = DTYPES[dtype]
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        layernorm_epsilon=shape.norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=is_cpu(),
        # Packed micro-batches differ in length; the alltoall dispatcher is required by that flag even for dense models.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Losses arrive divided by global normalisers: Megatron must sum, never average (see actor/step.py).
        calculate_per_token_loss=True,
        transformer_impl=transformer_impl,
        **overrides,
    )


def layer_spec(shape: ModelShape, transformer_impl: str):
    """Transformer Engine's spec, or the local spec with SDPA core attention."""
    if transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm)
    return local_layer_spec(shape)


def local_layer_spec(shape: ModelShape):
    """megatron-core's local spec with `SDPACoreAttention` as core attention (the local one refuses packed input)."""
    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    attention = spec.submodules.self_attention
    submodules = replace(attention.submodules, core_attention=SDPACoreAttention)
    return replace(spec, submodules=replace(spec.submodules, self_attention=replace(attention, submodules=submodules)))


def llama3_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """RoPE inverse frequencies with Llama 3 frequency-dependent scaling, from all four HF scaling parameters
    (megatron-core's built-in scaling fixes three of them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_context / low) & (wavelen >= old_context / high)
    return torch.where(medium, smoothed, scaled)


def build_gpt_model(shape: ModelShape, config: TransformerConfig, make_vocab_size_divisible_by: int = 128,
                    vp_stage: int | None = None) -> FusedOutputGPTModel:
    """This rank's pipeline stage of the model; parallel_state must be initialised."""
    pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = FusedOutputGPTModel(
        config=config,
        transformer_layer_spec=layer_spec(shape, config.transformer_impl),
        vocab_size=padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size,
                                     make_vocab_size_divisible_by),
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        vp_stage=vp_stage,
    )
    if shape.rope_scaling is not None:
        model.rotary_pos_emb.inv_freq = llama3_inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling).to(
            model.rotary_pos_emb.inv_freq.device)
    model.shape = shape
    return model


def place_model(model: FusedOutputGPTModel, device: torch.device | str) -> torch.nn.Module:
    """Finish a built model as Megatron-LM's `get_model` does: move it to `device` (there
    `model.cuda(current_device)`), then, for bf16 and fp16, wrap it in megatron-core's `Float16Module`, which casts
    every floating parameter and buffer to the training dtype. Returns the module to train or run (the wrapper, or
    the model itself in fp32); `model`'s parameters are the same objects, moved and cast in place.

    Both steps are needed whatever the spec: modules that take no device or `params_dtype` (the local spec's torch
    RMSNorm weights) are built fp32 on the host, where the GPU forward refuses them, and the mixed-precision optimizer
    keeps fp32 main copies of fp16/bf16 parameters only, so its checkpoint would have no entry for them."""
    model.to(device)
    config = model.config
    placed = Float16Module(config, model) if config.bf16 or config.fp16 else model
    dtype, device = config.params_dtype, torch.device(device)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        off_device = tensor.device.type != device.type or device.index not in (None, tensor.device.index)
        if off_device or (tensor.is_floating_point() and tensor.dtype != dtype):
            raise AssertionError(f"{name} is {tensor.dtype} on {tensor.device} after placing the model on {device} "
                                 f"in {dtype}")
    return placed


def global_parameter_name(model: GPTModel, local_name: str) -> str:
    """The name of a parameter with its global layer index (PP stages number their layers from 0 locally)."""
    prefix = "decoder.layers."
    if not local_name.startswith(prefix):
        return local_name
    local_index, rest = local_name[len(prefix):].split(".", 1)
    layer = model.decoder.layers[int(local_index)]
    return f"{prefix}{layer.layer_number - 1}.{rest}"


@torch.no_grad()
def load_hf_weights(model: GPTModel, checkpoint: HFCheckpoint, make_vocab_size_divisible_by: int = 128) -> None:
    """Copy HF weights into this rank's shards, reading only the slices the rank holds."""
    shape = model.shape
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    padded_vocab = padded_vocab_size(shape.vocab_size, tp_size, make_vocab_size_divisible_by)
    if checkpoint.shape != shape:
        raise ValueError(f"checkpoint {checkpoint.dir} has config {checkpoint.shape}, the model was built for {shape}")
    for local_name, param in model.named_parameters():
        name = global_parameter_name(model, local_name)
        row, layer = find_row(name, shape)
        shard = row.layout.shard(hf_names_of(row, layer), checkpoint.read, shape, tp_rank, tp_size, padded_vocab,
                                 checkpoint.tensor_shape)
        if shard.shape != param.shape:
            raise ValueError(
                f"{checkpoint.dir}: the HF tensors {hf_names_of(row, layer)} give {name} the shape "
                f"{tuple(shard.shape)}, but the model expects {tuple(param.shape)}: "
                "config.json does not match the weights"
            )
        param.copy_(shard)

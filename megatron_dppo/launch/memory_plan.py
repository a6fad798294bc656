"""The memory plan of a trainer GPU: what each pipeline stage's GPUs hold at the peak of a training step, estimated
from the model's config.json and the flags, against the GPU's memory (--gpu-memory-gib). --dry-run prints and checks
it (on a machine without GPUs too: a login node plans for the GPUs the run will have) and a start on a GPU checks it;
a plan that cannot fit is refused before anything is built, in one line naming the flags that would make it fit.

    config.json (a folder's, or a Hub name's: cached, or downloaded alone) ─► ModelShape ─┐
    flags: precision, TP/PP/DP, sequence parallel, distributed optimizer, recompute, --max-tokens-per-gpu,
           --kl-coef (a frozen reference), the layer spec ─┴─► plan_memory ─► StageMemory per pipeline stage:
        weights + gradients + optimizer state + activations + working set + reserve  ─► memory_plan_lines
                                                                                      ─► memory_plan_error

What each term counts (bytes on one GPU of the stage; P = the stage's parameters on this GPU, its TP shard):
- weights: P x the training dtype's size (Float16Module casts every parameter), and again for the frozen reference
  when --kl-coef > 0;
- gradients: P x 4, DDP's fp32 gradient buffer (the actor reduces in fp32, grad_reduce_in_fp32);
- optimizer: Adam's two fp32 moments and, for bf16/fp16, the fp32 main copy of every parameter (P x 12, fp32 P x 8),
  divided over the data-parallel ranks by the distributed optimizer;
- activations: what autograd keeps for backward at --max-tokens-per-gpu tokens per micro-batch (the packer fills
  micro-batches up to it), summed over the tensors each module saves (`saved_per_token`: inputs of the linear layers
  and norms, the attention's q, k, v and output, SwiGLU's three tensors, ...), per layer, times the layers the stage
  keeps: all of them; under full recompute each recomputed unit's input plus the one unit recomputed during
  backward; under selective recompute without core attention's own saved tensors. A pipeline stage p of PP holds
  PP - p micro-batches in flight (1F1B's warm-up);
- working set: what backward allocates beyond the saved activations at its peak: the fused log-probs' gradient
  buffers (the hidden states' fp32 gradient, the output weight's gradient, the vocabulary slices of
  actor/logprobs.py) on the last stage, one layer's gradients elsewhere; the larger of the two;
- reserve: the CUDA context and the caching allocator's fragmentation, RESERVE_BYTES + RESERVE_FRACTION of the rest.

Calibration (docs/actor.md, "The memory plan"): the activation count equals what autograd saves on the CPU, per
tensor (tests/workers/recompute_checks.py counts it with saved-tensor hooks, with and without recompute, at TP 1
and 2); on a GPU the whole estimate without the reserve falls 2-4% under the allocator's peak (Qwen3-0.6B, bf16,
local spec, the GPU check's micro-batches, the longest 7956 tokens, on an H200: 24.14 GiB estimated, 25.19 GiB
measured), a gap the reserve covers.

The flags that decide memory beside the layout and the precision are added and checked here, for arguments.py's
parser: Megatron-LM's recompute flags (`memory_flags`, `recompute_errors`: its rules, one line each) and
--gpu-memory-gib.

Invariants: imports no torch (--dry-run runs before every launch); pure arithmetic on the shape and the flags, so
--dry-run and a real start plan alike.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace

from megatron_dppo.convert.mapping import ModelShape, model_shape, padded_vocab_size
from megatron_dppo.flags import COUNT, POSITIVE
from megatron_dppo.hub import HubError, model_config_file

GIB = 2**30
# An 80 GB H100 (H100 80GB HBM3) as CUDA reports it: 85,017,493,504 bytes, 79.18 GiB (cuDeviceTotalMem and torch's
# total_memory; nvidia-smi: 81,559 MiB, 480 MiB of them reserved by the driver), measured on one on 2026-11-27
# (driver 580.159.04; docs/actor.md). The plan's total holds the CUDA context in its reserve, so it is compared with
# this, rounded down to 0.01 GiB: a plan --dry-run passes, a start on the card passes too.
H100_80GB_GIB = 79.17
RESERVE_BYTES = GIB  # the CUDA context and NCCL's buffers, which the allocator's peak does not count
RESERVE_FRACTION = 0.10  # the caching allocator's fragmentation over micro-batches of varying shapes
LOGPROB_CHUNK_ELEMENTS = 2**25  # actor/logprobs.CHUNK_ELEMENTS (its temporaries), written out: no torch here
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
INDEX_BYTES = 8  # int64 token ids, targets, gather indices
FP32_BYTES = 4


RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS = ("full", "selective"), ("uniform", "block")  # Megatron-LM's choices


def memory_flags(parser: argparse.ArgumentParser) -> None:
    memory = parser.add_argument_group("memory (Megatron-LM's activation recompute; the per-GPU memory plan)")
    memory.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                        help="recompute activations in backward instead of keeping them: full (whole layers, keeping "
                             "only each recomputed unit's input; needs --recompute-method and --recompute-num-layers) "
                             "or selective (core attention of every layer); default: keep every activation")
    memory.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                        help="--recompute-granularity full: uniform (every layer, in units of --recompute-num-layers "
                             "layers) or block (the first --recompute-num-layers layers of each pipeline stage)")
    memory.add_argument("--recompute-num-layers", type=COUNT, default=None,
                        help="--recompute-granularity full: layers per recomputed unit (uniform) or recomputed "
                             "layers per pipeline stage (block)")
    memory.add_argument("--gpu-memory-gib", type=POSITIVE, default=H100_80GB_GIB,
                        help="memory of one trainer GPU, which the memory plan (--dry-run, also on a machine without "
                             "GPUs, and every start on a GPU) checks the run against: weights, gradients, optimizer "
                             "state and activations at --max-tokens-per-gpu (default: what an 80 GB H100 offers, "
                             f"{H100_80GB_GIB} GiB; a start also takes the GPU's own if smaller)")


def recompute_errors(args: argparse.Namespace) -> list[str]:
    """Megatron-LM's recompute rules (megatron-core's TransformerConfig and Megatron-LM's validate_args): full takes a
    method and a layer count, selective neither; a method or a count alone recomputes nothing."""
    granularity, method, layers = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    given = [f"{flag} {value}" for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers))
             if value is not None]
    if granularity is None and given:
        return [f"{' and '.join(given)} apply to --recompute-granularity full, which is not given: add "
                "--recompute-granularity full or drop them"]
    if granularity == "full" and (method is None or layers is None):
        return ["--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers "
                "N: e.g. --recompute-method uniform --recompute-num-layers 1 (each layer keeps only its input)"]
    if granularity == "selective" and given:
        return [f"--recompute-granularity selective recomputes core attention in every layer and takes no "
                f"{' or '.join(given)}: drop them, or use --recompute-granularity full"]
    return []


@dataclass(frozen=True)
class TrainerLayout:
    """What the plan needs of a run: the model, its parallel layout and the flags that decide memory."""

    shape: ModelShape
    tp: int = 1
    pp: int = 1
    dp: int = 1
    dtype: str = "bf16"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    tokens: int = 8192  # --max-tokens-per-gpu: the longest micro-batch
    reference_model: bool = False  # --kl-coef > 0: a frozen copy of the weights
    transformer_impl: str = "transformer_engine"
    norms: str = "fused"  # "fused": torch's CUDA RMSNorm kernel and TE's norms; "composite": torch's CPU RMSNorm

    @property
    def layers_per_stage(self) -> int:
        return self.shape.num_layers // self.pp


def layout_of(args, dp: int, shape: ModelShape) -> TrainerLayout:
    """The plan's inputs from parsed flags; the layer spec is --transformer-impl, else a GPU's default (TE)."""
    return TrainerLayout(
        shape=shape, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size, dp=dp,
        dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        distributed_optimizer=args.use_distributed_optimizer, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        tokens=args.max_tokens_per_gpu, reference_model=args.kl_coef > 0,
        transformer_impl=args.transformer_impl or "transformer_engine")


@dataclass(frozen=True)
class StageMemory:
    """Bytes one GPU of pipeline stage `stage` holds at the peak of a training step."""

    stage: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    working: float
    main_params: float = 0.0  # of `optimizer`, what is allocated when the optimizer is built: the fp32 main copy
    # (bf16/fp16); Adam's moments come at its first step, or when a checkpoint loads

    @property
    def resident_when_built(self) -> float:
        """What the actor holds once built, before its first step or load: what a colocated server finds taken."""
        return self.weights + self.gradients + self.main_params

    @property
    def estimate(self) -> float:
        """What the allocator holds at the peak (comparable to torch.cuda.max_memory_allocated)."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.working

    @property
    def reserve(self) -> float:
        return RESERVE_BYTES + RESERVE_FRACTION * self.estimate

    @property
    def total(self) -> float:
        return self.estimate + self.reserve


def stage_parameters(layout: TrainerLayout, stage: int) -> int:
    """Parameters one GPU of `stage` holds: its TP shard of the stage's layers, the embedding on the first stage and
    the output layer (or, tied under PP > 1, the embedding's copy) on the last."""
    shape, tp = layout.shape, layout.tp
    q, kv, ffn, h = shape.num_attention_heads * shape.head_dim, shape.num_query_groups * shape.head_dim, \
        shape.ffn_hidden_size, shape.hidden_size
    layer = (h * (q + 2 * kv) + q * h + h * 2 * ffn + ffn * h) // tp + 2 * h
    layer += (q + 2 * kv) // tp if shape.qkv_bias else 0
    layer += 2 * shape.head_dim if shape.qk_norm else 0
    vocab = padded_vocab_size(shape.vocab_size, tp) // tp * h
    first, last = stage == 0, stage == layout.pp - 1
    output_layer = last and (not shape.tie_word_embeddings or layout.pp > 1)
    return layer * layout.layers_per_stage + vocab * (first + output_layer) + h * last


def saved_per_token(layout: TrainerLayout) -> dict[str, float]:
    """Bytes autograd keeps per token for one transformer layer, by what saves them, on one GPU (TP shard), without
    recompute. The tensors each module saves for its backward (counted on the CPU by tests/workers/
    recompute_checks.py; a view keeps its whole storage):

        input norm, pre-MLP norm   its input (fused) or fp32 copies of input and output (composite), fp32 1/rms
        qkv and fc1 linears        their input (the normed hidden states)
        q/k norms (Qwen3)          their inputs, views of the fused qkv output: that whole tensor, and 1/rms
        rotary embedding           cos and sin for q and k
        core attention             q, k, v, the output and the log-sum-exp (local spec: SDPA's own copies of
                                   q, k, v gathered per sequence length and the gather indices, and its output apart
                                   from the projection's input; TE: the output is the projection's input)
        attention projection       its input
        SwiGLU                     fc1's output (gate and up), silu's output and the gated product
        fc2                        its input

    Under sequence parallelism the hidden-size tensors are split over TP as the heads and the FFN are."""
    shape, size = layout.shape, DTYPE_BYTES[layout.dtype]
    tp, sp = layout.tp, layout.tp if layout.sequence_parallel else 1
    h, ffn, head = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * head / tp, shape.num_query_groups * head / tp
    heads, groups = shape.num_attention_heads / tp, shape.num_query_groups / tp
    local = layout.transformer_impl == "local"

    def norm(width: float, rows: float = 1) -> float:
        saved = 2 * FP32_BYTES * width if layout.norms == "composite" else size * width
        return saved + FP32_BYTES * rows

    parts = {
        "input norm": norm(h / sp),
        "qkv input": size * h / sp,
        "rotary cos/sin": 4 * head * size,
        "core attention": size * (q + 2 * kv) + size * q * local + FP32_BYTES * heads + INDEX_BYTES * local,
        "projection input": size * q,
        "pre-MLP norm": norm(h / sp),
        "fc1 input": size * h / sp,
        "SwiGLU": size * 4 * ffn / tp,
        "fc2 input": size * ffn / tp,
    }
    if shape.qk_norm:
        parts["q/k norms"] = (norm(q, heads) + norm(kv, groups) if layout.norms == "composite"
                              else size * (q + 2 * kv) + FP32_BYTES * (heads + groups))
    return parts


def selective_saving_per_token(layout: TrainerLayout) -> float:
    """What recomputing core attention (selective) saves per token and layer: the tensors core attention keeps for
    its backward, less what the checkpoint keeps instead (its inputs q, k, v: v a view of the fused qkv output,
    whose whole storage the q/k norms keep anyway where they save views)."""
    shape, size = layout.shape, DTYPE_BYTES[layout.dtype]
    q = shape.num_attention_heads * shape.head_dim / layout.tp
    kv = shape.num_query_groups * shape.head_dim / layout.tp
    kept = size * (q + kv)  # the rotated q and k
    kept += 0 if shape.qk_norm and layout.norms == "fused" else size * (q + 2 * kv)  # v's storage, the fused qkv
    return saved_per_token(layout)["core attention"] - kept


def checkpoint_input_per_token(layout: TrainerLayout) -> float:
    """What a fully recomputed unit keeps: its input hidden states."""
    sp = layout.tp if layout.sequence_parallel else 1
    return DTYPE_BYTES[layout.dtype] * layout.shape.hidden_size / sp


def layer_activations(layout: TrainerLayout) -> float:
    """Bytes of activations the stage's layers hold at the peak of one micro-batch's backward."""
    per_layer = sum(saved_per_token(layout).values())
    layers, tokens = layout.layers_per_stage, layout.tokens
    if layout.recompute_granularity == "selective":
        return layers * (per_layer - selective_saving_per_token(layout)) * tokens
    if layout.recompute_granularity != "full":
        return layers * per_layer * tokens
    unit, kept_input = min(layout.recompute_num_layers, layers), checkpoint_input_per_token(layout)
    if layout.recompute_method == "uniform":  # every unit's input, and one unit recomputed in backward
        return (math.ceil(layers / unit) * kept_input + unit * per_layer) * tokens
    # block: the first `unit` layers keep their inputs, the others everything; one layer recomputed at a time
    return (unit * kept_input + max(layers - unit, 1) * per_layer) * tokens


def outside_layers_per_token(layout: TrainerLayout, stage: int) -> float:
    """Bytes per token autograd keeps outside the layers: the token ids (the embedding's backward) on the first
    stage; on the last the final norm's, and the hidden states, targets and two fp32 statistics per token of the
    fused log-probs (actor/logprobs.py)."""
    saved = INDEX_BYTES if stage == 0 else 0
    if stage == layout.pp - 1:
        saved += (saved_per_token(layout)["input norm"] + DTYPE_BYTES[layout.dtype] * layout.shape.hidden_size
                  + INDEX_BYTES + 2 * FP32_BYTES)
    return saved


def stage_memory(layout: TrainerLayout, stage: int) -> StageMemory:
    shape, size, tokens = layout.shape, DTYPE_BYTES[layout.dtype], layout.tokens
    parameters = stage_parameters(layout, stage)
    main_copy = FP32_BYTES if layout.dtype != "fp32" else 0
    shards = layout.dp if layout.distributed_optimizer else 1
    optimizer = parameters * (2 * FP32_BYTES + main_copy) / shards
    last = stage == layout.pp - 1
    in_flight = layout.pp - stage  # 1F1B: stage p runs PP - p forwards before its first backward
    activations = layer_activations(layout) + outside_layers_per_token(layout, stage) * tokens
    vocab = padded_vocab_size(shape.vocab_size, layout.tp) // layout.tp
    loss_working = (FP32_BYTES * shape.hidden_size * tokens + size * vocab * shape.hidden_size
                    + 3 * FP32_BYTES * LOGPROB_CHUNK_ELEMENTS) if last else 0
    layer_working = sum(saved_per_token(layout).values()) * tokens
    return StageMemory(stage=stage, weights=parameters * size * (1 + layout.reference_model),
                       gradients=parameters * FP32_BYTES, optimizer=optimizer,
                       activations=activations * in_flight, working=max(loss_working, layer_working),
                       main_params=parameters * main_copy / shards)


def plan_memory(layout: TrainerLayout) -> list[StageMemory]:
    """One StageMemory per pipeline stage (every TP and DP rank of a stage holds the same)."""
    return [stage_memory(layout, stage) for stage in range(layout.pp)]


def recompute_flags(layout: TrainerLayout) -> str:
    if layout.recompute_granularity is None:
        return "no recompute"
    if layout.recompute_granularity == "selective":
        return "--recompute-granularity selective"
    return (f"--recompute-granularity full --recompute-method {layout.recompute_method} --recompute-num-layers "
            f"{layout.recompute_num_layers}")


def memory_plan_lines(layout: TrainerLayout, gpu_gib: float) -> list[str]:
    """The plan as --dry-run prints it: one row per pipeline stage, in GiB."""
    rows = [["stage", "weights", "gradients", "optimizer", "activations", "working", "reserve", "total", "fits"]]
    for plan in plan_memory(layout):
        rows.append([str(plan.stage), *(f"{value / GIB:.1f}" for value in (
            plan.weights, plan.gradients, plan.optimizer, plan.activations, plan.working, plan.reserve, plan.total)),
            "yes" if plan.total <= gpu_gib * GIB else "NO"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    optimizer = "distributed optimizer" if layout.distributed_optimizer else "optimizer on every DP rank"
    return [f"memory plan per trainer GPU (GiB; every TP and DP rank of a stage alike), against --gpu-memory-gib "
            f"{gpu_gib:g}: {layout.dtype}, TP {layout.tp} x PP {layout.pp} x DP {layout.dp}"
            f"{', sequence parallel' if layout.sequence_parallel else ''}, {optimizer}, {recompute_flags(layout)}, "
            f"{layout.tokens} tokens per micro-batch, {layout.transformer_impl} layers"
            f"{', a frozen reference (--kl-coef)' if layout.reference_model else ''}", *table]


def _fits(layout: TrainerLayout, gpu_gib: float) -> bool:
    return all(plan.total <= gpu_gib * GIB for plan in plan_memory(layout))


def _most_tokens_that_fit(layout: TrainerLayout, fits) -> int | None:
    """The largest --max-tokens-per-gpu (a multiple of 1024) below the layout's for which `fits(layout)`, or None."""
    tokens = layout.tokens // 1024 * 1024
    while tokens >= 1024:
        if fits(replace(layout, tokens=tokens)):
            return tokens
        tokens -= 1024
    return None


def single_changes(layout: TrainerLayout, fits) -> list[tuple[str, TrainerLayout]]:
    """(flags, the layout they give) for each one change of flags that lowers a trainer GPU's memory: full recompute
    of every layer, the distributed optimizer, the largest --max-tokens-per-gpu for which `fits(layout)`, more TP
    over the same processes."""
    changes = []
    full = replace(layout, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if layout.recompute_granularity != "full" or (layout.recompute_method, layout.recompute_num_layers) != (
            "uniform", 1):
        changes.append((recompute_flags(full), full))
    if not layout.distributed_optimizer and layout.dp > 1:
        changes.append(("--use-distributed-optimizer", replace(layout, distributed_optimizer=True)))
    tokens = _most_tokens_that_fit(layout, fits)
    if tokens is not None:
        changes.append((f"--max-tokens-per-gpu {tokens}", replace(layout, tokens=tokens)))
    for tp in (2 * layout.tp, 4 * layout.tp):
        try:
            layout.shape.check_parallel(tp, layout.pp)
        except ValueError:
            continue
        if layout.dp % (tp // layout.tp) == 0:  # the same processes: DP shrinks as TP grows
            wider = replace(layout, tp=tp, dp=layout.dp * layout.tp // tp)
            changes.append((f"--tensor-model-parallel-size {tp}", wider))
            break
    return changes


def memory_plan_error(layout: TrainerLayout, gpu_gib: float) -> str | None:
    """None if every stage fits; else one line: the heaviest stage's estimate and the flags that would make it fit,
    each with the plan it would give."""
    plans = plan_memory(layout)
    worst = max(plans, key=lambda plan: plan.total)
    if worst.total <= gpu_gib * GIB:
        return None
    options = [f"{flags} ({max(plan.total for plan in plan_memory(fixed)) / GIB:.2f} GiB)"
               for flags, fixed in single_changes(layout, lambda changed: _fits(changed, gpu_gib))
               if _fits(fixed, gpu_gib)]
    advice = ("; fits with " + ", or ".join(options)) if options else \
        "; no single change fits: combine --recompute-granularity full, a lower --max-tokens-per-gpu and more TP/PP"
    return (f"the memory plan needs an estimated {worst.total / GIB:.1f} GiB per GPU of pipeline stage {worst.stage} "
            f"(weights {worst.weights / GIB:.1f}, gradients {worst.gradients / GIB:.1f}, optimizer "
            f"{worst.optimizer / GIB:.1f}, activations {worst.activations / GIB:.1f} at --max-tokens-per-gpu "
            f"{layout.tokens} with {recompute_flags(layout)}, working {worst.working / GIB:.1f}, reserve "
            f"{worst.reserve / GIB:.1f}) but --gpu-memory-gib is {gpu_gib:g}{advice}; or, if the GPUs have more "
            "memory, say so with --gpu-memory-gib")


def layout_error(layout: TrainerLayout) -> str | None:
    """A layout the model cannot take (TP/PP against its heads, FFN and layers; a recompute unit longer than a
    stage), as one line; None if it can."""
    try:
        layout.shape.check_parallel(layout.tp, layout.pp)
    except ValueError as error:
        return str(error)
    layers = layout.recompute_num_layers
    if layers is not None and layers > layout.layers_per_stage:
        return (f"--recompute-num-layers {layers} exceeds the {layout.layers_per_stage} layers of a pipeline stage "
                f"(Megatron-LM's rule: between 1 and the layers per stage): give at most {layout.layers_per_stage}")
    return None


def plan_config(args) -> tuple[dict | None, str]:
    """(config.json of --hf-checkpoint, where it was read), or (None, why not): a folder's, or a Hub name's from the
    Hugging Face cache or a config-only download (megatron_dppo.hub); the plan may be printed where the model is not
    (--dry-run on a login node)."""
    if not args.hf_checkpoint:
        return None, "no --hf-checkpoint"
    try:
        path = model_config_file(args.hf_checkpoint, "--hf-checkpoint")
    except HubError as error:
        return None, str(error)
    try:
        return json.loads(path.read_text()), str(path)
    except (OSError, ValueError) as error:
        return None, f"{path} not readable here ({type(error).__name__})"


def dry_run_memory_plan(args, dp: int, on_gpus: bool) -> tuple[list[str], str | None]:
    """(lines --dry-run prints, one-line error or None): the plan for --hf-checkpoint's model, checked against
    --gpu-memory-gib also where this machine has no GPU (a login node plans for the GPUs the run will have)."""
    config, source = plan_config(args)
    if config is None:
        return [f"memory plan: not made ({source}; a start on a GPU makes it from the model it loads)"], None
    try:
        layout = layout_of(args, dp, model_shape(config))
    except (KeyError, ValueError) as error:
        return [], f"{source}: {error}"
    problem = layout_error(layout)
    if problem:
        return [], problem
    lines = memory_plan_lines(layout, args.gpu_memory_gib)
    if not on_gpus:
        lines.append(f"  (no GPU here: checked against --gpu-memory-gib {args.gpu_memory_gib:g}, the GPUs the run "
                     "will have; a run on CPUs alone trains in host memory, which no plan checks)")
    return lines, memory_plan_error(layout, args.gpu_memory_gib)


def start_memory_error(args, dp: int, shape: ModelShape, gpu_bytes: int | None) -> str | None:
    """At a real start, before the model is built: the layout's error, or, on a GPU (`gpu_bytes` its memory), the
    plan's against the smaller of --gpu-memory-gib and the GPU's own memory."""
    layout = layout_of(args, dp, shape)
    problem = layout_error(layout)
    if problem or gpu_bytes is None:
        return problem
    error = memory_plan_error(layout, min(args.gpu_memory_gib, gpu_bytes / GIB))
    if error and gpu_bytes / GIB < args.gpu_memory_gib:
        error += f" (this GPU has {gpu_bytes / GIB:.1f} GiB, less than --gpu-memory-gib {args.gpu_memory_gib:g})"
    return error

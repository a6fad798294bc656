"""The share of a trainer GPU that a colocated SGLang server takes (--rollout-colocate), in the memory plan, and the
--mem-fraction-static the trainer passes it.

    the trainer's plan per pipeline stage (memory_plan.plan_memory) ─┐
    the model's shape, the server's TP (--rollout-server-gpus), --rollout-max-response-len, the forwarded
    --sglang-mem-fraction-static and --sglang-chunked-prefill-size, the GPU's memory ─┴─► colocated_share
        ─► ColocatedShare: per stage what the server finds free, its static share, runtime and context beside the
           trainer's peak; the fraction passed (or the one given, checked) ─► colocated_lines (--dry-run)
                                                                            ─► colocated_error (one line, refused)
        ─► server_flags: the fraction added to the servers' command (launch_plan prints it, run.py starts it)

How SGLang 0.5.23 sizes itself (srt/mem_cache/kv_cache_configurator.py, `_profile_available_bytes`): once its
process is up and before it loads the model, it measures the GPU's free memory B; its weights and KV cache pool
together take mem_fraction_static x B, and (1 - mem_fraction_static) x B is left as the slack its activations and
CUDA graphs run in. Its default fraction is computed from the GPU's total memory (srt/arg_groups/memory_hook.py: the
GPU less a reserve for a chunked prefill's activations and the CUDA graphs, at least 10 GiB on GPUs over 60 GiB), so
on a GPU the trainer shares, where B is what the trainer left free, the default takes nearly all of it.

On a colocated GPU the server starts after the actor is built (launch/run.py, which first hands the allocator's
cached blocks back): B = the GPU - what the actor holds then (weights, fp32 gradients, fp32 main copy: Adam's moments
come at its first step or when a checkpoint loads) - the trainer's context - the server's context. At the trainer's
peak the GPU holds the trainer's plan (estimate + reserve), the server's static share f x B, its runtime memory
(activations at its chunked prefill, CUDA graph buffers: its caching allocator keeps them between generations) and
its context. The largest fraction that fits, over every stage's GPU:

    f_max = min over stages (GPU - trainer's total - server runtime - server context) / B

and the smallest the server needs: its weights (the model's TP shard, bf16) and a KV cache of one response of
--rollout-max-response-len, over B. The trainer passes f_max (floored to 0.001) unless --sglang-mem-fraction-static
is given, which must lie between the two; a layout whose f_max is below what the server needs is refused in one
line naming the flags that would make it fit.

The server's runtime memory follows SGLang's own estimate of it (memory_hook.py): 512 MiB, 1.5 MiB per token of a
chunked prefill (SGLang's default chunk by the GPU's memory, or --sglang-chunked-prefill-size), 2 MiB per decode
CUDA graph batch size up to its default largest, and 1 GiB per 8 GPUs of its TP; SGLang's prefill graphs (a few
MiB each) are left out. None of this is measured here: the estimates are SGLang's, and the GPU check does not yet
start a colocated server (docs/actor.md).

Invariants: imports no torch; pure arithmetic on the plan and the flags, so --dry-run and a start plan alike.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from megatron_dppo.convert.mapping import ModelShape, model_shape
from megatron_dppo.launch.memory_plan import (
    GIB,
    RESERVE_BYTES,
    TrainerLayout,
    layout_error,
    layout_of,
    plan_config,
    plan_memory,
    single_changes,
    stage_parameters,
)
from megatron_dppo.rollout.launcher import sglang_flag_value

MIB = 2**20
SGLANG_FRACTION_FLAGS = ("--mem-fraction-static",)
SGLANG_CHUNKED_PREFILL_FLAGS = ("--chunked-prefill-size",)
SGLANG_CONTEXT_BYTES = GIB  # the server process's CUDA context and communication buffers (the trainer's allowance)
SGLANG_METADATA_BYTES = 512 * MIB  # SGLang's constant for attention metadata and slack
SGLANG_BYTES_PER_PREFILL_TOKEN = 1.5 * MIB  # SGLang's activation estimate per token of a chunked prefill
SGLANG_MIN_PREFILL_TOKENS = 2048  # SGLang counts a chunk of at least this many tokens
SGLANG_BYTES_PER_GRAPH_BATCH = 2 * MIB  # per decode CUDA graph batch size
SGLANG_BYTES_PER_TP_RANK = GIB / 8
# SGLang 0.5.23's defaults by the GPU's memory (memory_hook.py): (below GiB, chunked prefill tokens, the largest decode
# CUDA graph batch at TP < 4, at TP >= 4)
SGLANG_GPU_TIERS = ((20, 2048, 8, 8), (35, 4096, 48, 160), (60, 4096, 32, 160), (160, 8192, 256, 512),
                    (math.inf, 16384, 512, 512))
SGLANG_RESERVE_FLOOR_BYTES = 10 * GIB  # SGLang's least reserve on GPUs over 60 GiB, for its own default fraction
KV_BYTES = 2  # the KV cache in the model's bf16 (SGLang's --kv-cache-dtype auto)
FRACTION_STEP = 1000  # fractions are given to 0.001, as SGLang rounds its own


@dataclass(frozen=True)
class ColocatedServer:
    """What the plan needs of the colocated SGLang servers' flags."""

    tp: int = 1  # --rollout-server-gpus: GPUs of one server, each holding its TP shard
    response_tokens: int = 1024  # --rollout-max-response-len
    fraction: float | None = None  # --sglang-mem-fraction-static, where given
    chunked_prefill: int | None = None  # --sglang-chunked-prefill-size, where given


def server_of(args: argparse.Namespace) -> ColocatedServer:
    fraction = sglang_flag_value(args.sglang_args, SGLANG_FRACTION_FLAGS)
    chunk = sglang_flag_value(args.sglang_args, SGLANG_CHUNKED_PREFILL_FLAGS)
    return ColocatedServer(tp=args.rollout_server_gpus or 1, response_tokens=args.rollout_max_response_len,
                           fraction=float(fraction) if fraction is not None else None,
                           chunked_prefill=int(chunk) if chunk is not None and int(chunk) > 0 else None)


@dataclass(frozen=True)
class ColocatedStage:
    """Bytes on one GPU of pipeline stage `stage` that a server shares."""

    stage: int
    trainer_then: float  # what the trainer holds when the server starts (its context included)
    free: float  # B: what the server finds free once its own context is up
    trainer_peak: float  # the trainer's planned total at the peak of a step
    server_weights: float
    server_runtime: float

    def static(self, fraction: float) -> float:
        return fraction * self.free

    def kv_cache(self, fraction: float) -> float:
        return self.static(fraction) - self.server_weights

    def total(self, fraction: float) -> float:
        return self.trainer_peak + SGLANG_CONTEXT_BYTES + self.static(fraction) + self.server_runtime


@dataclass(frozen=True)
class ColocatedShare:
    stages: tuple[ColocatedStage, ...]
    gpu: float  # bytes of one GPU
    largest: float  # the largest fraction that fits beside the trainer on every stage's GPU (floored to 0.001)
    smallest: float  # the least the server needs: its weights and one response's KV cache (ceiled to 0.001)
    given: float | None  # --sglang-mem-fraction-static
    kv_bytes_per_token: float
    response_kv: float  # one response of --rollout-max-response-len in the KV cache
    chunked_prefill: int
    sglang_default: float  # the fraction SGLang would pick itself on this GPU

    @property
    def fraction(self) -> float:
        """The fraction the servers get: the one given, else the largest that fits (where even that is less than the
        server needs, the least it needs: the share is then refused)."""
        return self.given if self.given is not None else max(self.largest, self.smallest)

    def stage_fits(self, stage: ColocatedStage) -> bool:
        return stage.total(self.fraction) <= self.gpu and stage.kv_cache(self.fraction) >= self.response_kv

    @property
    def fits(self) -> bool:
        return self.smallest <= self.fraction <= self.largest


def _gpu_tier(gpu_bytes: float) -> tuple:
    return next(tier for tier in SGLANG_GPU_TIERS if gpu_bytes < tier[0] * GIB)


def server_runtime_bytes(server: ColocatedServer, gpu_bytes: float) -> tuple[float, int]:
    """(SGLang's runtime memory beside its static share, the chunked prefill it is sized at)."""
    _, default_chunk, graphs_small_tp, graphs_large_tp = _gpu_tier(gpu_bytes)
    chunk = server.chunked_prefill or default_chunk
    graphs = graphs_small_tp if server.tp < 4 else graphs_large_tp
    runtime = (SGLANG_METADATA_BYTES + SGLANG_BYTES_PER_PREFILL_TOKEN * max(chunk, SGLANG_MIN_PREFILL_TOKENS)
               + SGLANG_BYTES_PER_GRAPH_BATCH * graphs + SGLANG_BYTES_PER_TP_RANK * server.tp)
    return runtime, chunk


def kv_bytes_per_token(shape: ModelShape, tp: int) -> float:
    """K and V of every layer for one token on one GPU of a TP-`tp` server (KV heads replicated below one a GPU)."""
    return 2 * shape.num_layers * max(shape.num_query_groups / tp, 1) * shape.head_dim * KV_BYTES


def colocated_share(layout: TrainerLayout, gpu_gib: float, server: ColocatedServer) -> ColocatedShare:
    gpu = gpu_gib * GIB
    runtime, chunk = server_runtime_bytes(server, gpu)
    weights = stage_parameters(replace(layout, tp=server.tp, pp=1, dp=1), 0) * KV_BYTES  # bf16, the TP shard
    per_token = kv_bytes_per_token(layout.shape, server.tp)
    stages = tuple(ColocatedStage(
        stage=plan.stage, trainer_then=plan.resident_when_built + RESERVE_BYTES,
        free=gpu - plan.resident_when_built - RESERVE_BYTES - SGLANG_CONTEXT_BYTES, trainer_peak=plan.total,
        server_weights=weights, server_runtime=runtime) for plan in plan_memory(layout))
    largest = min((gpu - stage.trainer_peak - SGLANG_CONTEXT_BYTES - runtime) / stage.free for stage in stages)
    smallest = max((weights + per_token * server.response_tokens) / stage.free for stage in stages)
    sglang_reserve = max(runtime, SGLANG_RESERVE_FLOOR_BYTES) if gpu > 60 * GIB else runtime
    return ColocatedShare(
        stages=stages, gpu=gpu, largest=math.floor(largest * FRACTION_STEP) / FRACTION_STEP,
        smallest=math.ceil(smallest * FRACTION_STEP) / FRACTION_STEP, given=server.fraction,
        kv_bytes_per_token=per_token, response_kv=per_token * server.response_tokens, chunked_prefill=chunk,
        sglang_default=round((gpu - sglang_reserve) / gpu, 3))


def colocated_lines(share: ColocatedShare, gpu_gib: float, server: ColocatedServer) -> list[str]:
    """The share as --dry-run prints it: one row per pipeline stage, in GiB, and the fraction passed."""
    fraction = share.fraction
    rows = [["stage", "trainer_then", "free", "static", "weights", "kv_cache", "runtime", "context", "trainer_peak",
             "total", "fits"]]
    for stage in share.stages:
        rows.append([str(stage.stage), *(f"{value / GIB:.1f}" for value in (
            stage.trainer_then, stage.free, stage.static(fraction), stage.server_weights, stage.kv_cache(fraction),
            stage.server_runtime, SGLANG_CONTEXT_BYTES, stage.trainer_peak, stage.total(fraction))),
            "yes" if share.stage_fits(stage) else "NO"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    tightest = min(share.stages, key=lambda stage: stage.kv_cache(fraction))
    tokens = max(tightest.kv_cache(fraction), 0) / share.kv_bytes_per_token
    source = ("given by --sglang-mem-fraction-static" if share.given is not None
              else "passed to SGLang: the largest that fits beside the trainer")
    short = max(stage.total(share.sglang_default) for stage in share.stages) - gpu_gib * GIB
    return [f"colocated SGLang server per shared GPU (--rollout-colocate; GiB, against --gpu-memory-gib {gpu_gib:g}): "
            "it starts after the actor is built and takes --mem-fraction-static of the memory it finds free (static: "
            f"its weights and KV cache), beside its runtime (chunked prefill of {share.chunked_prefill} tokens, CUDA "
            "graphs) and context", *table,
            f"  --mem-fraction-static {fraction:.3f} {source} (it needs at least {share.smallest:.3f}; SGLang's own "
            f"default on this GPU, {share.sglang_default:.3f}, would "
            + (f"overrun the GPU by {short / GIB:.1f} GiB" if short > 0 else "fit too")
            + f"): its KV cache holds {tokens:,.0f} tokens, {tokens // server.response_tokens:.0f} whole "
            f"response(s) of --rollout-max-response-len {server.response_tokens}"]


def colocated_error(share: ColocatedShare, layout: TrainerLayout, gpu_gib: float,
                    server: ColocatedServer) -> str | None:
    """None where the share fits; else one line: why, and the flags that would make it fit."""
    if share.fits:
        return None
    fraction = share.fraction
    if share.given is not None and share.smallest <= share.largest:
        bound = "at most" if fraction > share.largest else "at least"
        why = ("leaves the trainer too little beside the server" if fraction > share.largest
               else "leaves the server's KV cache less than one response of --rollout-max-response-len")
        return (f"--sglang-mem-fraction-static {fraction:g} gives the colocated SGLang server {fraction:g} of the "
                f"{min(stage.free for stage in share.stages) / GIB:.1f} GiB it finds free and {why} "
                f"({share.smallest:.3f} to {share.largest:.3f} fit): give {bound} "
                f"{share.largest if fraction > share.largest else share.smallest:.3f}, or drop the flag for the "
                f"trainer to pass {share.largest:.3f}")
    stage = max(share.stages, key=lambda each: each.trainer_peak)
    fixes = [(flags, changed, server) for flags, changed in single_changes(
        layout, lambda changed: colocated_share(changed, gpu_gib, replace(server, fraction=None)).fits)]
    if share.chunked_prefill > SGLANG_MIN_PREFILL_TOKENS:
        fixes.append((f"--sglang-chunked-prefill-size {SGLANG_MIN_PREFILL_TOKENS}", layout,
                      replace(server, chunked_prefill=SGLANG_MIN_PREFILL_TOKENS)))
    options = [flags for flags, changed, changed_server in fixes
               if colocated_share(changed, gpu_gib, replace(changed_server, fraction=None)).fits]
    advice = ("fits with " + ", or ".join(options)) if options else "no single change fits"
    return (f"--rollout-colocate: the trainer's plan ({stage.trainer_peak / GIB:.1f} GiB on stage {stage.stage}) "
            f"and the SGLang server's runtime ({stage.server_runtime / GIB:.1f} GiB at a chunked prefill of "
            f"{share.chunked_prefill} tokens) and context leave it {max(share.largest, 0):.3f} of the "
            f"{stage.free / GIB:.1f} GiB it finds free, and its weights ({stage.server_weights / GIB:.1f} GiB) and "
            f"one response of --rollout-max-response-len {server.response_tokens} need {share.smallest:.3f} "
            f"(--gpu-memory-gib {gpu_gib:g}): {advice}; or serve on GPUs of their own (drop --rollout-colocate)")


def server_flags(args: argparse.Namespace, share: ColocatedShare) -> list[str]:
    """The servers' SGLang flags: the forwarded ones, and the fraction the plan derived unless one was given."""
    if share.given is not None:
        return list(args.sglang_args)
    return [*args.sglang_args, SGLANG_FRACTION_FLAGS[0], f"{share.fraction:.3f}"]


def with_server_flags(args: argparse.Namespace, flags: list[str]) -> argparse.Namespace:
    """A copy of `args` whose servers start with `flags` (the run's own flags are left as parsed)."""
    return argparse.Namespace(**{**vars(args), "sglang_args": flags})


def dry_run_colocated_share(args: argparse.Namespace, dp: int, on_gpus: bool) -> tuple[list[str], str | None,
                                                                                       list[str] | None]:
    """(lines --dry-run prints, one-line error or None, the servers' flags with the fraction or None) for
    --rollout-colocate; ([], None, None) without it."""
    if not args.rollout_colocate:
        return [], None, None
    config, source = plan_config(args)
    if config is None or not on_gpus:
        why = source if config is None else "no GPU"
        return [f"colocated SGLang server: not planned ({why}; a start on a GPU plans it and passes "
                "--mem-fraction-static)"], None, None
    layout = layout_of(args, dp, model_shape(config))
    if layout_error(layout):
        return [], None, None  # the memory plan names it
    server = server_of(args)
    share = colocated_share(layout, args.gpu_memory_gib, server)
    return (["", *colocated_lines(share, args.gpu_memory_gib, server)],
            colocated_error(share, layout, args.gpu_memory_gib, server), server_flags(args, share))


def start_colocated_share(args: argparse.Namespace, dp: int, shape: ModelShape,
                          gpu_bytes: int | None) -> tuple[str | None, list[str] | None]:
    """At a real start on a GPU, for --rollout-colocate: (one-line error or None, the servers' flags with the
    fraction); (None, None) without it, or on the CPU."""
    if not args.rollout_colocate or gpu_bytes is None:
        return None, None
    gpu_gib = min(args.gpu_memory_gib, gpu_bytes / GIB)
    layout, server = layout_of(args, dp, shape), server_of(args)
    share = colocated_share(layout, gpu_gib, server)
    return colocated_error(share, layout, gpu_gib, server), server_flags(args, share)

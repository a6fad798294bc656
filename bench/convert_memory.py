"""Peak memory of the checkpoint converters on a randomly initialised ~1B-parameter model (Llama-3.2-1B shape).

    random HF dir (bf16, written tensor by tensor) ──► HF → Megatron (tp=1 rank, spawned) ──► Megatron → HF, timed
    and measured `--repeats` times, each in a fresh child process

Peak memory is the child's ru_maxrss minus its RSS after imports (the baseline run in the same process). The last
line measures Megatron → HF, the direction that streams: it is compared with the largest unit it holds at once (the
embedding, or one decoder layer) plus one output shard. HF → Megatron builds the rank's whole shard of the model
(see docs/conversion.md) and is reported against the model size instead.
Prints a table and, last, `convert_peak_over_layer_plus_shard: X` (target <= 1.5).

python bench/convert_memory.py [--layers 16] [--repeats 3] [--shard-mb 2048] [--work-dir DIR]
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_dppo.rollout.launcher import python_env


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def bench_config(layers: int) -> dict:
    """Llama-3.2-1B's shape (tied embeddings, vocabulary 128256), with `layers` decoder layers."""
    from megatron_dppo.convert.tiny import tiny_hf_config

    config = tiny_hf_config("llama", vocab_size=128256, hidden_size=2048, num_layers=layers, num_heads=32,
                            num_kv_heads=8, ffn_hidden_size=8192, tie_word_embeddings=True,
                            max_position_embeddings=4096, head_dim=64, dtype="bfloat16")
    return config.to_dict()


def write_random_hf_model(out_dir: Path, config: dict) -> int:
    """An HF directory of random bf16 weights, written one tensor at a time; returns the parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_dppo.convert.conversion import ShardedSafetensorsWriter

    out_dir.mkdir(parents=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    planned = [(name, tuple(t.shape)) for name, t in model.state_dict().items() if name != "lm_head.weight"]
    writer = ShardedSafetensorsWriter(out_dir, planned, torch.bfloat16, 2 * 1024**3)
    generator = torch.Generator().manual_seed(0)
    for name, tensor_shape in planned:
        writer.write(name, torch.randn(tensor_shape, generator=generator, dtype=torch.bfloat16) * 0.02)
    writer.close()
    (out_dir / "config.json").write_text(json.dumps(config))
    return sum(torch.Size(s).numel() for _, s in planned)


def export_child(megatron_dir: str, out: str, shard_mb: float) -> None:
    """Runs in a fresh process: baseline RSS after imports, then one export; prints a JSON line."""
    from megatron_dppo.actor.checkpoint import read_hf_config, resolve_checkpoint
    from megatron_dppo.convert.conversion import DistCheckpointReader, _nbytes, _plan_parameters, megatron_to_hf
    from megatron_dppo.convert.mapping import model_shape

    path = resolve_checkpoint(megatron_dir)
    reader = DistCheckpointReader(path)
    units = _plan_parameters(reader, model_shape(read_hf_config(path)))
    largest_unit = max(sum(_nbytes(s, torch.bfloat16) for p in unit for _, s in p.hf_tensors) for unit in units)
    del reader, units
    baseline = rss_bytes()
    start = time.perf_counter()
    megatron_to_hf(megatron_dir, out, max_shard_bytes=int(shard_mb * 1024**2))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"baseline": baseline, "peak": peak, "seconds": seconds, "largest_unit": largest_unit}))


def run_export(megatron_dir: Path, out: Path, shard_mb: float) -> dict:
    command = [sys.executable, __file__, "--export-child", str(megatron_dir), str(out), str(shard_mb)]
    result = subprocess.run(command, capture_output=True, text=True, env=python_env(), check=False)
    if result.returncode:
        raise RuntimeError(f"export child failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-mb", type=float, default=2048.0)
    parser.add_argument("--work-dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--export-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.export_child:
        export_child(args.export_child[0], args.export_child[1], float(args.export_child[2]))
        return

    from megatron_dppo.convert.conversion import hf_to_megatron

    gib = 1024**3
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        work = Path(work)
        start = time.perf_counter()
        params = write_random_hf_model(work / "hf", bench_config(args.layers))
        print(f"random model: {params / 1e9:.2f}B parameters, bf16, written in {time.perf_counter() - start:.0f} s")
        start = time.perf_counter()
        hf_to_megatron(work / "hf", work / "megatron", tp=1, pp=1)
        to_megatron_s = time.perf_counter() - start
        to_megatron_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        runs = [run_export(work / "megatron", work / f"export_{i}", args.shard_mb) for i in range(args.repeats)]

    over_baseline = statistics.median(r["peak"] - r["baseline"] for r in runs)
    seconds = statistics.median(r["seconds"] for r in runs)
    largest_unit, shard = runs[0]["largest_unit"], args.shard_mb * 1024**2
    model_bytes = params * 2
    print(f"{'direction':<16}{'seconds':>10}{'peak GiB':>10}{'reference':>40}{'ratio':>8}")
    print(f"{'HF → Megatron':<16}{to_megatron_s:>10.1f}{to_megatron_peak / gib:>10.2f}"
          f"{f'model {model_bytes / gib:.2f} GiB':>40}{to_megatron_peak / model_bytes:>8.2f}")
    print(f"{'Megatron → HF':<16}{seconds:>10.1f}{over_baseline / gib:>10.2f}"
          f"{f'largest unit {largest_unit / gib:.2f} + shard {shard / gib:.2f} GiB':>40}"
          f"{over_baseline / (largest_unit + shard):>8.2f}")
    print(f"Megatron → HF peak over the largest unit alone: {over_baseline / largest_unit:.2f} "
          f"(median of {args.repeats} exports, each in a fresh process; HF → Megatron peak is the spawned rank's)")
    print(f"convert_peak_over_layer_plus_shard: {over_baseline / (largest_unit + shard):.3f}")


if __name__ == "__main__":
    main()

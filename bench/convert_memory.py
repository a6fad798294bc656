"""Peak memory of the checkpoint converters on a randomly initialised ~1B-parameter model (Llama-3.2-1B shape).

    random HF dir (bf16, written tensor by tensor) ──► HF → Megatron (tp=1) ──► Megatron → HF
    each conversion timed and measured `--repeats` times, each in a fresh child process

Peak memory is the child's ru_maxrss minus its RSS after imports (the baseline run in the same process). HF →
Megatron runs the converter's rank function (`convert_rank`, what the tool spawns per rank) in the child itself, so
its peak is that rank's. Each direction is compared with the largest unit it handles (the embedding, or one decoder
layer: all its parameters) plus one output shard: for Megatron → HF the safetensors shard size (`--shard-mb`), for
HF → Megatron the largest `.distcp` file the rank wrote (megatron's writer splits a rank's items over 2 files).
Prints a table and, last, `convert_peak_over_layer_plus_shard: X`, the larger ratio of the two directions
(target <= 1.5).

python bench/convert_memory.py [--layers 16] [--repeats 3] [--shard-mb 2048] [--work-dir DIR]
"""

import argparse
import json
import resource
import shutil
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

    from megatron_dppo.actor.conversion import ShardedSafetensorsWriter

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


def largest_unit_bytes(megatron_dir: Path) -> int:
    """The largest unit of the checkpoint in bytes (in bf16): the embedding, or all the parameters of one layer."""
    from megatron_dppo.actor.checkpoint import read_hf_config, resolve_checkpoint
    from megatron_dppo.actor.conversion import DistCheckpointReader, plan_parameters, tensor_bytes
    from megatron_dppo.convert.mapping import model_shape

    path = resolve_checkpoint(megatron_dir)
    units = plan_parameters(DistCheckpointReader(path), model_shape(read_hf_config(path)))
    return max(sum(tensor_bytes(s, torch.bfloat16) for p in unit for _, s in p.hf_tensors) for unit in units)


def import_child(hf_dir: str, out: str) -> None:
    """Runs in a fresh process: baseline RSS after imports, then the converter's single rank (tp=1, pp=1) writing
    into `out`; prints a JSON line."""
    import os

    import megatron.core.dist_checkpointing  # noqa: F401  (imports before the baseline)
    import megatron.core.models.gpt  # noqa: F401

    import megatron_dppo.actor.model  # noqa: F401
    import megatron_dppo.actor.parallel  # noqa: F401
    from megatron_dppo.actor.conversion import convert_rank
    from megatron_dppo.platform.network import free_port

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    Path(out).mkdir()
    baseline = rss_bytes()
    start = time.perf_counter()
    convert_rank(0, 1, free_port(), hf_dir, out, 1, 1, "bf16")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = max(p.stat().st_size for p in Path(out).glob("iter_0000000/*.distcp"))
    print(json.dumps({"baseline": baseline, "peak": peak, "seconds": seconds, "shard": shard}))


def export_child(megatron_dir: str, out: str, shard_mb: float) -> None:
    """Runs in a fresh process: baseline RSS after imports, then one export; prints a JSON line."""
    from transformers import GenerationConfig  # noqa: F401  (imports before the baseline)

    import megatron_dppo.actor.checkpoint  # noqa: F401
    from megatron_dppo.actor.conversion import megatron_to_hf

    baseline = rss_bytes()
    start = time.perf_counter()
    megatron_to_hf(megatron_dir, out, max_shard_bytes=int(shard_mb * 1024**2))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"baseline": baseline, "peak": peak, "seconds": seconds, "shard": shard_mb * 1024**2}))


def run_child(*argv, keep: bool = False) -> dict:
    """One measured conversion in a fresh process; its output (the last argument naming a directory) is deleted
    unless `keep`, so the repeats need the disk of one copy."""
    command = [sys.executable, __file__, *map(str, argv)]
    result = subprocess.run(command, capture_output=True, text=True, env=python_env(), check=False)
    if result.returncode:
        raise RuntimeError(f"{argv[0]} failed:\n{result.stderr[-4000:]}")
    if not keep:
        shutil.rmtree(argv[2])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-mb", type=float, default=2048.0)
    parser.add_argument("--work-dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--export-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--import-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.export_child:
        export_child(args.export_child[0], args.export_child[1], float(args.export_child[2]))
        return
    if args.import_child:
        import_child(*args.import_child)
        return

    gib = 1024**3
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        work = Path(work)
        start = time.perf_counter()
        params = write_random_hf_model(work / "hf", bench_config(args.layers))
        print(f"random model: {params / 1e9:.2f}B parameters, bf16, written in {time.perf_counter() - start:.0f} s")
        runs = {"HF → Megatron": [run_child("--import-child", work / "hf", work / f"megatron_{i}", keep=i == 0)
                                  for i in range(args.repeats)]}
        largest_unit = largest_unit_bytes(work / "megatron_0")
        runs["Megatron → HF"] = [run_child("--export-child", work / "megatron_0", work / f"export_{i}", args.shard_mb)
                                 for i in range(args.repeats)]

    print(f"{'direction':<16}{'seconds':>10}{'peak GiB':>10}{'reference':>40}{'ratio':>8}{'peak/unit':>11}")
    ratios = []
    for direction, measured in runs.items():
        peak = statistics.median(r["peak"] - r["baseline"] for r in measured)
        seconds = statistics.median(r["seconds"] for r in measured)
        shard = max(r["shard"] for r in measured)
        ratios.append(peak / (largest_unit + shard))
        print(f"{direction:<16}{seconds:>10.1f}{peak / gib:>10.2f}"
              f"{f'largest unit {largest_unit / gib:.2f} + shard {shard / gib:.2f} GiB':>40}"
              f"{ratios[-1]:>8.2f}{peak / largest_unit:>11.2f}")
    print(f"{params * 2 / gib:.2f} GiB of weights; peaks are medians of {args.repeats} runs, each in a fresh process, "
          "over the RSS after imports")
    print(f"convert_peak_over_layer_plus_shard: {max(ratios):.3f}")


if __name__ == "__main__":
    main()

"""Weight sync throughput: WeightSyncer into the embedded engine vs a raw broadcast of the same bytes (gloo).

Both run from this process against separate receivers on this host, repeats interleaved (sync, raw, sync, raw, ...)
so that both see the same load on a shared machine:
  sync: pause → flush → bucketed broadcast (+ engine loads by name) → continue → version check
  raw:  one ProcessGroup.broadcast of one flat uint8 buffer of the same size, to a bare receiver process
One unmeasured warm-up round of each comes first (the engine's first sync allocates the buffers its parameters
then live in; the raw receiver's first broadcast touches its buffer's pages). Prints a table (median of repeats),
the median of the per-round ratios, and, last, `weight_sync_vs_raw_broadcast: X` (median raw seconds / median sync
seconds).

python bench/weight_sync.py [--params 0.5e9] [--repeats 7] [--bucket-mb 512] [--first-bucket-mb 32]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from megatron_dppo.platform.network import free_port
from megatron_dppo.rollout.launcher import launch_embedded_engine, python_env
from megatron_dppo.rollout.weight_sync import WeightSyncer, broadcast_from_trainer, init_weight_update_group

RAW_RECEIVER = """
import sys, torch
from megatron_dppo.rollout.weight_sync import init_weight_update_group
port, nbytes, repeats = map(int, sys.argv[1:4])
group = init_weight_update_group("gloo", "127.0.0.1", port, 1, 2, "raw_bench", 300)
buffer = torch.empty(nbytes, dtype=torch.uint8)
for _ in range(repeats):
    group.broadcast(buffer, 0).wait()
"""


def save_model(directory: str, target_params: float) -> None:
    """A Qwen2-shaped model with about target_params fp32 parameters, saved without a costly init."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers = 1024, max(1, round((target_params - 2 * 32000 * 1024) / 12.6e6))
    config = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
    model.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=0.5e9, help="approximate parameter count (fp32)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--first-bucket-mb", type=int, default=32, help="first bucket limit, ramping to --bucket-mb")
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, args.params)
        from transformers import AutoModelForCausalLM

        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        named = list(trainer.state_dict().items())
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        print(f"model: {sum(t.numel() for _, t in named) / 1e9:.3f} B params, {nbytes / 1e9:.3f} GB fp32, "
              f"{len(named)} tensors, bucket {args.bucket_mb} MiB")

        port = free_port()
        receiver = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(port), str(nbytes), str(args.repeats + 1)],
                                    env=python_env())
        raw_group = init_weight_update_group("gloo", "127.0.0.1", port, 0, 2, "raw_bench", 300)
        flat = torch.zeros(nbytes, dtype=torch.uint8)
        sync_seconds, raw_seconds = [], []
        with launch_embedded_engine(model_dir, startup_timeout_s=300, threads=1) as engine:
            syncer = WeightSyncer([engine.url], bucket_bytes=args.bucket_mb * 1024**2,
                                  first_bucket_bytes=args.first_bucket_mb * 1024**2, timeout_s=300)
            syncer.init_group()
            for version in range(args.repeats + 1):  # version 0: warm-up, not measured
                seconds = syncer.sync(named, version).seconds
                start = time.perf_counter()
                broadcast_from_trainer(raw_group, flat)
                if version:
                    sync_seconds.append(seconds)
                    raw_seconds.append(time.perf_counter() - start)
            syncer.destroy_group()
        receiver.wait(timeout=300)

    gigabytes = nbytes / 1e9
    rows = [("weight sync (WeightSyncer → engine)", statistics.median(sync_seconds)),
            ("raw broadcast (one flat buffer)", statistics.median(raw_seconds))]
    print(f"{'method':40s} {'median s':>10s} {'GB/s':>8s} {'s/GB':>8s}")
    for name, seconds in rows:
        print(f"{name:40s} {seconds:10.3f} {gigabytes / seconds:8.3f} {seconds / gigabytes:8.3f}")
    print(f"sync repeats: {[round(s, 3) for s in sync_seconds]}; raw repeats: {[round(s, 3) for s in raw_seconds]}")
    print(f"median of per-round ratios (raw / sync): "
          f"{statistics.median(r / s for r, s in zip(raw_seconds, sync_seconds)):.3f}")
    print(f"weight_sync_vs_raw_broadcast: {rows[1][1] / rows[0][1]:.3f}")


if __name__ == "__main__":
    main()

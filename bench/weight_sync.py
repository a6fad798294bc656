"""Weight sync throughput: WeightSyncer into the embedded engine vs a raw broadcast of the same bytes (gloo).

All run from this process against separate receivers on this host, repeats interleaved (auto sync, per-tensor sync,
flattened sync, raw, auto sync, ...) so that all see the same load on a shared machine:
  sync: pause → flush → begin → bucketed broadcast (+ engine loads by name) → end → continue → version check (each
        phase timed: WeightSyncer's SyncStats.phases, the table's rows), in
        the format the trainer uses for the embedded engine (auto: a bucket of large tensors per tensor, a bucket of
        small ones packed), per tensor (each tensor broadcast as it is, received into its parameter) and in
        flattened buckets (tensors packed into one buffer per bucket, as for SGLang over NCCL and for vLLM)
  raw:  one ProcessGroup.broadcast of one flat uint8 buffer of the same size, to a bare receiver process
One unmeasured warm-up round comes first (the engine's first flattened sync allocates the buffers its parameters
then live in; the raw receiver's first broadcast touches its buffer's pages). Prints a table (median of repeats),
the median of the per-round ratios, and, last, `weight_sync_vs_raw_broadcast: X` (median raw seconds / median
seconds of the trainer's format).

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
from megatron_dppo.rollout.engine_calls import PHASES
from megatron_dppo.rollout.launcher import launch_embedded_engine, python_env
from megatron_dppo.rollout.weight_sync import AUTO_FORMAT, WeightSyncer
from megatron_dppo.weight_update_protocol import FLATTENED_BUCKET, broadcast_from_trainer, init_weight_update_group

# The syncer's formats, the trainer's for the embedded engine first (run.start_rollout): the bench's headline.
FORMATS = {"weight sync, auto (the trainer's)": AUTO_FORMAT, "weight sync, per tensor": None,
           "weight sync, flattened buckets": FLATTENED_BUCKET}
RAW = "raw broadcast (one flat buffer)"

RAW_RECEIVER = """
import sys, torch
from megatron_dppo.weight_update_protocol import init_weight_update_group
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
        seconds = {name: [] for name in (*FORMATS, RAW)}
        phases = {name: {phase: [] for phase in PHASES} for name in FORMATS}
        with launch_embedded_engine(model_dir, startup_timeout_s=300, threads=1) as engine:
            syncers = {name: WeightSyncer([engine.url], bucket_bytes=args.bucket_mb * 1024**2,
                                          first_bucket_bytes=args.first_bucket_mb * 1024**2, timeout_s=300,
                                          load_format=load_format, group_name=f"bench_{index}")
                       for index, (name, load_format) in enumerate(FORMATS.items())}
            for syncer in syncers.values():
                syncer.init_group()
            for version in range(args.repeats + 1):  # version 0: warm-up, not measured
                stats = {name: syncer.sync(named, f"{name}-{version}") for name, syncer in syncers.items()}
                round_seconds = {name: value.seconds for name, value in stats.items()}
                start = time.perf_counter()
                broadcast_from_trainer(raw_group, flat)
                round_seconds[RAW] = time.perf_counter() - start
                if version:
                    for name, value in round_seconds.items():
                        seconds[name].append(value)
                    for name, value in stats.items():
                        for phase in PHASES:
                            phases[name][phase].append(value.phases[phase])
            for syncer in syncers.values():
                syncer.destroy_group()
        receiver.wait(timeout=300)

    gigabytes = nbytes / 1e9
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"{'method':45s} {'median s':>10s} {'GB/s':>8s} {'s/GB':>8s} {'raw / this':>11s}")
    for name, median in medians.items():
        print(f"{name:45s} {median:10.3f} {gigabytes / median:8.3f} {median / gigabytes:8.3f} "
              f"{medians[RAW] / median:11.3f}")
    print("\nper phase, median over rounds (ms): pause → flush → begin → (next bucket → buckets → loads) per bucket → "
          "end → continue → version check; raw: the one broadcast")
    short = {name: name.removeprefix("weight sync, ") for name in FORMATS}
    print(f"{'phase':15s} " + " ".join(f"{short[name]:>20s}" for name in FORMATS) + f" {'raw broadcast':>14s}")
    for phase in PHASES:
        cells = " ".join(f"{1000 * statistics.median(phases[name][phase]):20.1f}" for name in FORMATS)
        raw = f"{1000 * medians[RAW]:14.1f}" if phase == "buckets" else f"{'-':>14s}"
        print(f"{phase:15s} {cells} {raw}")
    totals = " ".join(f"{1000 * medians[name]:20.1f}" for name in FORMATS)
    print(f"{'total':15s} {totals} {1000 * medians[RAW]:14.1f}")
    for name, values in seconds.items():
        print(f"{name} repeats: {[round(value, 3) for value in values]}")
    trainer_format = next(iter(FORMATS))
    print(f"median of per-round ratios (raw / {trainer_format}): "
          f"{statistics.median(r / s for r, s in zip(seconds[RAW], seconds[trainer_format])):.3f}")
    print(f"weight_sync_vs_raw_broadcast: {medians[RAW] / medians[trainer_format]:.3f}")


if __name__ == "__main__":
    main()

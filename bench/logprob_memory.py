"""Peak extra memory and time of the fused output layer + log-probs against the full-vocabulary path, with backward.

Workload: the output layer of a Qwen3-4B-sized model over T tokens: hidden states [T, H] and the output weight
[V, H], in bf16 as a GPU run holds them (--dtype fp32: as the CPU mode does); loss = sum of per-token log-probs +
0.01 x entropy, backward to both inputs (dh and dW: both methods produce them, and both are counted).
    fused  actor/logprobs.py's output_layer_logprobs: logits per chunk of tokens, recomputed per vocabulary slice in
           backward; no [T, V] tensor is formed
    full   the unfused path: logits = hidden @ weight^T materialised [T, V] as GPTModel's output layer gives them,
           then the full-vocabulary log-softmax in fp32 in its leanest plain-PyTorch form (per chunk of tokens under
           activation checkpointing, so that only the logits and their gradient are whole)
Each measurement runs in a fresh process (peak RSS is a per-process high-water mark): extra = peak RSS - RSS once the
inputs exist. Median of --repeats processes per method, the methods alternating. T is never lowered: if the machine
lacks the memory the full path needs, the bench stops and says how much it needs.

Usage: python bench/logprob_memory.py [--tokens 8192] [--vocab 151936] [--hidden 2560] [--dtype bf16] [--repeats 3]
Last line: `logprob_memory_ratio: X` (full / fused extra peak memory).
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import psutil

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
GIB = 2**30


def measure(method: str, tokens: int, vocab: int, hidden_size: int, dtype: str) -> dict:
    import torch

    from megatron_dppo.actor.logprobs import CHUNK_ELEMENTS, output_layer_logprobs, unfused_logprobs

    torch.manual_seed(0)
    dtype = getattr(torch, DTYPES[dtype])
    hidden = torch.randn(tokens, hidden_size, dtype=dtype).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, dtype=dtype).mul_(hidden_size ** -0.5).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))
    chunk_size = max(1, CHUNK_ELEMENTS // vocab)
    start_rss_kib = psutil.Process().memory_info().rss / 1024
    start_peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if method == "fused":
        logprobs, entropy = output_layer_logprobs(hidden, weight, targets, vocab, chunk_size=chunk_size)
    else:
        logprobs, entropy = unfused_logprobs(hidden, weight, targets, chunk_size)
    forward = time.perf_counter() - start
    (logprobs.sum() + 0.01 * entropy.sum()).backward()
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if peak_kib <= start_peak_kib:
        raise RuntimeError(f"{method}: the measured region never rose above the process's earlier peak RSS")
    return {"extra_gib": (peak_kib - start_rss_kib) / 2**20, "seconds": seconds, "forward_seconds": forward}


def run_child(method: str, args) -> dict:
    command = [sys.executable, __file__, "--child", method, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
               "--hidden", str(args.hidden), "--dtype", args.dtype]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the {method} measurement failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def full_path_needs_gib(tokens: int, vocab: int, hidden_size: int, dtype: str) -> float:
    """The full path's peak beyond its inputs, with a margin: the logits and their gradient in the model dtype, a
    chunk's fp32 temporaries and dW (measured: 0.58 GiB per 1024 tokens in bf16, plus 1.2 GiB)."""
    itemsize = 2 if dtype == "bf16" else 4
    return (3 * tokens * vocab * itemsize + 4 * 2**26 * 4 + vocab * hidden_size * itemsize) / GIB


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["full", "fused"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tokens, args.vocab, args.hidden, args.dtype)))
        return

    needs = full_path_needs_gib(args.tokens, args.vocab, args.hidden, args.dtype)
    available = psutil.virtual_memory().available / GIB
    if needs > 0.9 * available:
        raise SystemExit(f"the full-vocabulary path at T={args.tokens} needs about {needs:.1f} GiB beyond its inputs "
                         f"and {available:.1f} GiB are available: run on an idle machine (T is never lowered)")
    runs = {"full": [], "fused": []}
    for _ in range(args.repeats):
        for method in runs:
            runs[method].append(run_child(method, args))
    rows = {method: {key: statistics.median(r[key] for r in results) for key in results[0]}
            for method, results in runs.items()}
    logits_gib = args.tokens * args.vocab * (2 if args.dtype == "bf16" else 4) / GIB
    print(f"\nT={args.tokens} V={args.vocab} H={args.hidden} {args.dtype}; the logits [T, V] alone: {logits_gib:.2f} "
          f"GiB; median of {args.repeats} fresh processes per method; load average {psutil.getloadavg()[0]:.1f}")
    print(f"{'method':<8}{'extra peak GiB':>16}{'forward s':>11}{'fwd+bwd s':>11}{'memory vs full':>16}"
          f"{'time vs full':>14}")
    for method, row in rows.items():
        print(f"{method:<8}{row['extra_gib']:>16.2f}{row['forward_seconds']:>11.1f}{row['seconds']:>11.1f}"
              f"{row['extra_gib'] / rows['full']['extra_gib']:>16.3f}{row['seconds'] / rows['full']['seconds']:>14.2f}")
    print(f"fused_time_vs_full: {rows['fused']['seconds'] / rows['full']['seconds']:.2f}")
    print(f"logprob_memory_ratio: {rows['full']['extra_gib'] / rows['fused']['extra_gib']:.2f}")


if __name__ == "__main__":
    main()

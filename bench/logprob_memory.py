"""Peak memory of chunked vocab-parallel log-probs + entropy against full-vocabulary log_softmax, forward+backward.

Each measurement runs in a fresh process (peak RSS is a per-process high-water mark): it allocates the logits
[T, V] (fp32, requires grad), records RSS, runs forward and backward of log-prob + entropy, and reports the peak
RSS above that point, i.e. the extra memory the method needs beyond the logits. Both methods must also produce the
logits' gradient ([T, V]), which is counted for both.

Usage: python bench/logprob_memory.py [--tokens 8192] [--vocab 151936] [--chunk-size 1024] [--repeats 2]
T is lowered (8192 -> 4096 -> ...) until the full-vocabulary reference fits in the machine's memory.
Last line: `logprob_memory_ratio: X` (full / chunked).
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import psutil


def measure(method: str, tokens: int, vocab: int, chunk_size: int) -> dict:
    import torch

    from megatron_dppo.actor.logprobs import vocab_parallel_logprobs

    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if method == "full":
        log_softmax = torch.log_softmax(logits, dim=-1)
        logprobs = log_softmax.gather(1, targets[:, None]).squeeze(1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    else:
        logprobs, entropy = vocab_parallel_logprobs(logits, targets, vocab, chunk_size=chunk_size)
    (logprobs.sum() + 0.01 * entropy.sum()).backward()
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"extra_gib": (peak_kib - baseline_kib) / 2**20, "seconds": seconds}


def run_child(method, tokens, vocab, chunk_size) -> dict:
    command = [sys.executable, __file__, "--child", method, "--tokens", str(tokens), "--vocab", str(vocab),
               "--chunk-size", str(chunk_size)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=["full", "chunked"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tokens, args.vocab, args.chunk_size)))
        return

    tokens = args.tokens
    budget = psutil.virtual_memory().available * 0.8
    # full: logits, their grad, log_softmax, exp and the product (5 x [T, V] fp32)
    while tokens > 256 and 5 * tokens * args.vocab * 4 > budget:
        tokens //= 2
    if tokens != args.tokens:
        print(f"T lowered from {args.tokens} to {tokens} so the full-vocabulary reference fits in memory")
    rows = {}
    for method in ("full", "chunked"):
        runs = [run_child(method, tokens, args.vocab, args.chunk_size) for _ in range(args.repeats)]
        rows[method] = {key: statistics.median(r[key] for r in runs) for key in ("extra_gib", "seconds")}
    logits_gib = tokens * args.vocab * 4 / 2**30
    print(f"\nT={tokens} V={args.vocab} chunk={args.chunk_size} fp32; logits themselves: {logits_gib:.2f} GiB; "
          f"median of {args.repeats} fresh processes")
    print(f"{'method':<10}{'extra peak GiB':>16}{'seconds':>10}{'vs full':>10}")
    for method, row in rows.items():
        print(f"{method:<10}{row['extra_gib']:>16.2f}{row['seconds']:>10.2f}"
              f"{rows['full']['extra_gib'] / row['extra_gib']:>10.2f}")
    print(f"logprob_memory_ratio: {rows['full']['extra_gib'] / rows['chunked']['extra_gib']:.2f}")


if __name__ == "__main__":
    main()

"""Dense Prompt Packing on real length distributions: valid-token density, DP load balance, packing time.

Distributions (10,000 sequences each, drawn with a fixed seed):
  math       MATH train+test, len(problem) + len(solution) in characters (= tokens of the project's
             character tokenizer)
  gsm8k      GSM8K train+test, len(question) + len(answer)
  long_tail  log-normal lengths (median ~600 tokens, sigma 1.1) clipped to [16, 8192]

Packers, all under the same token budget per micro-batch (--max-tokens-per-gpu):
  padded         naive padded batching in arrival order: add rows while rows · longest row fits the budget
  ffd            full-sort first-fit decreasing (a baseline, not used by the trainer)
  window_greedy  megatron_dppo.pipeline.packing.pack (window-greedy best fit, then Karmarkar–Karp over DP ranks)

density = valid tokens / (micro-batches · max_tokens_per_gpu). DP load ratio = max / min of the per-rank cost
Σs + c·Σs². Times are medians of repeats in this process. The last line is the lowest window-greedy density
(dp = 1) over the distributions.

    python bench/packing.py [--max-tokens-per-gpu 9216] [--window 256] [--dp-size 8] [--repeats 7]
"""

import argparse
import json
import statistics
import time

import numpy as np

from megatron_dppo.data.paths import shared_data_dir
from megatron_dppo.pipeline.packing import DEFAULT_ATTENTION_COST_COEF, pack, packing_density

NUM_SEQUENCES = 10_000


def jsonl_lengths(relative_paths: list[str], fields: tuple[str, str]) -> np.ndarray:
    lengths = []
    for relative_path in relative_paths:
        with open(shared_data_dir() / relative_path) as file:
            lengths.extend(len(row[fields[0]]) + len(row[fields[1]]) for row in map(json.loads, file))
    return np.array(lengths)


def length_distributions(rng: np.random.Generator) -> dict[str, list[int]]:
    pools = {
        "math": jsonl_lengths(["math/train.jsonl", "math/test.jsonl"], ("problem", "solution")),
        "gsm8k": jsonl_lengths(["gsm8k/train.jsonl", "gsm8k/test.jsonl"], ("question", "answer")),
        "long_tail": np.clip(np.exp(rng.normal(6.4, 1.1, NUM_SEQUENCES)), 16, 8192).astype(int),
    }
    return {
        name: rng.choice(pool, NUM_SEQUENCES, replace=len(pool) < NUM_SEQUENCES).tolist()
        for name, pool in pools.items()
    }


def padded_micro_batches(lengths: list[int], budget: int) -> int:
    """Micro-batches of naive padded batching: rows in arrival order, padded to the micro-batch's longest."""
    micro_batches, rows, longest = 1, 0, 0
    for length in lengths:
        if (rows + 1) * max(longest, length) > budget:
            micro_batches, rows, longest = micro_batches + 1, 0, 0
        rows, longest = rows + 1, max(longest, length)
    return micro_batches


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Sort all sequences longest first; each goes into the first bin (in opening order) with room for it."""
    lengths_array = np.asarray(lengths)
    room = np.full(len(lengths) + 1, budget)
    bins: list[list[int]] = []
    for index in np.argsort(-lengths_array, kind="stable").tolist():
        length = lengths[index]
        bin_id = int(np.argmax(room[:len(bins) + 1] >= length))  # room[len(bins)] is a fresh, empty bin
        if bin_id == len(bins):
            bins.append([])
        room[bin_id] -= length
        bins[bin_id].append(index)
    return bins


def rank_costs(rank_bins: list[list[list[int]]], lengths: list[int]) -> list[float]:
    coef = DEFAULT_ATTENTION_COST_COEF
    return [sum(lengths[i] + coef * lengths[i] ** 2 for bin_ in rank for i in bin_) for rank in rank_bins]


def median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens-per-gpu", type=int, default=9216)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--dp-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    budget, window, dp_size = args.max_tokens_per_gpu, args.window, args.dp_size
    distributions = length_distributions(np.random.default_rng(0))

    print(f"max_tokens_per_gpu={budget} window={window} dp_size={dp_size} sequences={NUM_SEQUENCES} "
          f"cost=s+{DEFAULT_ATTENTION_COST_COEF:g}*s^2 repeats={args.repeats}\n")
    header = (f"{'distribution':<11} {'mean len':>8} {'max len':>7} | {'padded':>7} {'ffd':>7} {'window':>7} "
              f"{'win/ffd':>7} {'win dp':>7} | {'load rr':>7} {'load bal':>8} | {'ffd ms':>7} {'win ms':>7} "
              f"{'win/ffd':>7}")
    print("density (dp=1, 'win dp' at dp_size) | DP load max/min (round-robin vs KK + moves) | time to pack")
    print(header)
    print("-" * len(header))
    window_densities = []
    for name, lengths in distributions.items():
        padded_density = sum(lengths) / (padded_micro_batches(lengths, budget) * budget)
        ffd_density = packing_density([first_fit_decreasing(lengths, budget)], lengths, budget)
        single_rank = pack(lengths, budget, window)
        window_density = packing_density(single_rank, lengths, budget)
        window_densities.append(window_density)
        ranks = pack(lengths, budget, window, dp_size)
        round_robin = [single_rank[0][rank::dp_size] for rank in range(dp_size)]
        load_rr, load_kk = (max(costs) / min(costs) for costs in (rank_costs(round_robin, lengths),
                                                                    rank_costs(ranks, lengths)))
        ffd_seconds = median_seconds(lambda lengths=lengths: first_fit_decreasing(lengths, budget), args.repeats)
        window_seconds = median_seconds(lambda lengths=lengths: pack(lengths, budget, window, dp_size), args.repeats)
        print(f"{name:<11} {statistics.mean(lengths):>8.0f} {max(lengths):>7} | {padded_density:>7.4f} "
              f"{ffd_density:>7.4f} {window_density:>7.4f} {window_density / ffd_density:>7.4f} "
              f"{packing_density(ranks, lengths, budget):>7.4f} | {load_rr:>7.3f} {load_kk:>8.3f} | "
              f"{ffd_seconds * 1e3:>7.1f} {window_seconds * 1e3:>7.1f} {window_seconds / ffd_seconds:>7.2f}")

    print("\nwindow sweep on math (dp=1 density, time to pack at dp_size)")
    print(f"{'window':>8} {'density':>8} {'ms':>7}")
    lengths = distributions["math"]
    for sweep_window in (16, 64, 256, 1024, NUM_SEQUENCES):
        density = packing_density(pack(lengths, budget, sweep_window), lengths, budget)
        seconds = median_seconds(lambda w=sweep_window: pack(lengths, budget, w, dp_size), args.repeats)
        print(f"{sweep_window:>8} {density:>8.4f} {seconds * 1e3:>7.1f}")

    print("\nstep size on math (fewer sequences: the last, partly filled micro-batch weighs more)")
    print(f"{'sequences':>9} {'ffd':>7} {'window':>7} {'win dp':>7} {'load bal':>8}")
    for count in (256, 1024, 4096):
        subset = lengths[:count]
        ranks = pack(subset, budget, window, dp_size)
        costs = rank_costs(ranks, subset)
        print(f"{count:>9} {packing_density([first_fit_decreasing(subset, budget)], subset, budget):>7.4f} "
              f"{packing_density(pack(subset, budget, window), subset, budget):>7.4f} "
              f"{packing_density(ranks, subset, budget):>7.4f} {max(costs) / min(costs):>8.3f}")

    print(f"\nwindow_greedy_density: {min(window_densities):.4f}")


if __name__ == "__main__":
    main()

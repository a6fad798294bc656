"""The RL step's cost model on this machine: GRPO runs of the embedded default at several response lengths, fitted as
seconds_step ≈ fixed + per generated token x tokens_generated + per trained token x tokens_trained; then what
partial rollouts do to it on the worked task.

    runs (the real entry point, torchrun, 2 processes + the embedded engine, GRPO without the DAPO filter so that
    every generated token is also trained): the cached warm start (the default task's worked responses, 14 to ~160
    tokens), and an untrained model (--warm-start-steps 0: random tokens until the end token or
    --rollout-max-response-len) at two response limits
    ─► every step after the first --skip-steps of each run ─► least squares (bench/time_to_accuracy.fit_step_cost)
    ─► a table of the runs' median phases, the fit, `name: value` lines

    partial rollouts: GRPO and DPPO (the embedded default, DAPO filter on) from the same warm start, each with
    synchronous rollouts and with --partial-rollout (PARTIAL_FLAGS) ─► steps per second (every step trains one whole
    drawn batch in both) and the fit with one fixed part per mode and shared per-token costs

The fixed part is what pruning cannot remove: mostly the engine's decode iterations, as many as the step's longest
response needs; partial rollouts spread those over the steps a draw stays open. The runs share one cache directory,
so the warm start is trained once and reused. Last lines: `step_cost_fixed_share_partial` (the partial mode's fixed
part over its mean step) and `partial_rollout_step_speedup` (steps per second with partial rollouts over synchronous
ones, the smaller of GRPO's and DPPO's).

python bench/step_cost.py [--budget-s 40] [--out-dir runs/step_cost] [--processes 2]
"""

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.time_to_accuracy import (  # noqa: E402
    fit_step_cost,
    fit_step_cost_by_group,
    launch_unless_finished,
    markdown,
)
from tools.plot_metrics import load_run  # noqa: E402

# name -> trainer flags on top of GRPO without the DAPO filter: three response-length regimes
RUNS = {
    "warm start, worked responses": [],
    "untrained, up to 16 tokens": ["--warm-start-steps", "0", "--rollout-max-response-len", "16"],
    "untrained, up to 44 tokens": ["--warm-start-steps", "0", "--rollout-max-response-len", "44"],
}
PHASES = ("seconds_step", "seconds_rollout", "seconds_update", "seconds_sync", "tokens_generated", "tokens_trained")
# the worked task's comparison: algorithm -> flags (the embedded default's DAPO filter kept), and partial rollouts' own
ALGORITHMS = {"grpo": ["--algorithm", "grpo"], "dppo": ["--algorithm", "dppo"]}
PARTIAL_FLAGS = ["--partial-rollout", "--partial-rollout-chunk-tokens", "32", "--partial-rollout-max-staleness", "1"]


def steps_per_second(run) -> float:
    return len(run.records) / sum(float(r["seconds_step"]) for r in run.records)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=40.0, help="RL seconds per run")
    parser.add_argument("--out-dir", default="runs/step_cost")
    parser.add_argument("--processes", type=int, default=2, help="torchrun --nproc-per-node")
    parser.add_argument("--skip-steps", type=int, default=5, help="first steps of each run left out (warm-up)")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    base = ["--algorithm", "grpo", "--no-dapo-filter", "--cache-dir", str(out / "cache"), "--eval-size", "16",
            "--time-budget-s", str(args.budget_s)]
    runs = {}
    for index, (name, flags) in enumerate(RUNS.items()):
        run_dir = launch_unless_finished([*base, *flags], out / f"run_{index}", args.processes)
        run = load_run(run_dir, name)
        run.records = run.records[args.skip_steps:]
        runs[name] = run
    rows = [[name, str(len(run.records)), *(f"{statistics.median(r[key] for r in run.records):.4g}" for key in PHASES)]
            for name, run in runs.items()]
    cost = fit_step_cost(list(runs.values()))
    print(markdown(["run", "steps", *PHASES], rows))
    print(f"\nFit over {sum(len(run.records) for run in runs.values())} steps (R² {cost['r_squared']:.2f}): step ≈ "
          f"{1000 * cost['fixed']:.1f} ms + {1e6 * cost['per_generated']:.1f} µs x generated tokens + "
          f"{1e6 * cost['per_trained']:.1f} µs x trained tokens")
    print(f"step_cost_fixed_ms: {1000 * cost['fixed']:.2f}")
    print(f"step_cost_per_generated_token_us: {1e6 * cost['per_generated']:.2f}")
    print(f"step_cost_per_trained_token_us: {1e6 * cost['per_trained']:.2f}")

    modes = {"synchronous": [], "partial": []}
    speedups, rows = {}, []
    for algorithm, flags in ALGORITHMS.items():
        pair = {}
        for mode, extra in (("synchronous", []), ("partial", PARTIAL_FLAGS)):
            common = ["--cache-dir", str(out / "cache"), "--eval-size", "16", "--time-budget-s", str(args.budget_s)]
            run_dir = launch_unless_finished([*common, *flags, *extra], out / f"{algorithm}_{mode}", args.processes)
            run = load_run(run_dir, f"{algorithm}, {mode}")
            run.records = run.records[args.skip_steps:]
            pair[mode] = run
            modes[mode].append(run)
            rows.append([algorithm, mode, str(len(run.records)), f"{steps_per_second(run):.3f}",
                         *(f"{statistics.median(r[key] for r in run.records):.4g}" for key in PHASES),
                         f"{statistics.fmean(r.get('partial_chunks', 1.0) for r in run.records):.2f}"])
        speedups[algorithm] = steps_per_second(pair["partial"]) / steps_per_second(pair["synchronous"])
    by_mode = fit_step_cost_by_group(modes)
    print(f"\nThe worked task, synchronous and partial rollouts ({' '.join(PARTIAL_FLAGS)}):\n")
    print(markdown(["algorithm", "rollouts", "steps", "steps/s", *PHASES, "chunks/step"], rows))
    shares = {}
    for mode, runs_of_mode in modes.items():
        mean_step = statistics.fmean(r["seconds_step"] for run in runs_of_mode for r in run.records)
        shares[mode] = by_mode["fixed"][mode] / mean_step
        print(f"{mode}: fixed {1000 * by_mode['fixed'][mode]:.1f} ms of a mean step of {1000 * mean_step:.1f} ms "
              f"({100 * shares[mode]:.0f}%)")
    print(f"shared per-token costs (R² {by_mode['r_squared']:.2f}): {1e6 * by_mode['per_generated']:.1f} µs per "
          f"generated token, {1e6 * by_mode['per_trained']:.1f} µs per trained token")
    print("steps per second, partial / synchronous: " + ", ".join(f"{a} {v:.2f}x" for a, v in speedups.items()))
    print(f"step_cost_fixed_share_synchronous: {shares['synchronous']:.3f}")
    print(f"step_cost_fixed_share_partial: {shares['partial']:.3f}")
    print(f"partial_rollout_step_speedup: {min(speedups.values()):.3f}")


if __name__ == "__main__":
    main()

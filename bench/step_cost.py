"""The RL step's cost model on this machine: GRPO runs of the embedded default at several response lengths, fitted as
seconds_step ≈ fixed + per generated token x tokens_generated + per trained token x tokens_trained.

    runs (the real entry point, torchrun, 2 processes + the embedded engine, GRPO without the DAPO filter so that
    every generated token is also trained): the cached warm start (the default task's worked responses, 14 to ~160
    tokens), and an untrained model (--warm-start-steps 0: random tokens until the end token or
    --rollout-max-response-len) at two response limits
    ─► every step after the first --skip-steps of each run ─► least squares (bench/time_to_accuracy.fit_step_cost)
    ─► a table of the runs' median phases, the fit, `name: value` lines

The fixed part is what pruning cannot remove (the issue's "79 of 227 ms"); the per-token parts are what it can. The
runs share one cache directory, so the warm start is trained once and reused.

python bench/step_cost.py [--budget-s 40] [--out-dir runs/step_cost] [--processes 2]
"""

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.time_to_accuracy import fit_step_cost, launch_unless_finished, markdown  # noqa: E402
from tools.plot_metrics import load_run  # noqa: E402

# name -> trainer flags on top of GRPO without the DAPO filter: three response-length regimes
RUNS = {
    "warm start, worked responses": [],
    "untrained, up to 16 tokens": ["--warm-start-steps", "0", "--rollout-max-response-len", "16"],
    "untrained, up to 44 tokens": ["--warm-start-steps", "0", "--rollout-max-response-len", "44"],
}
PHASES = ("seconds_step", "seconds_rollout", "seconds_update", "seconds_sync", "tokens_generated", "tokens_trained")


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


if __name__ == "__main__":
    main()

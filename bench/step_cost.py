"""The RL step's cost model on this machine: GRPO runs of the embedded default at several response lengths, fitted as
seconds_step ≈ fixed + per generated token x tokens_generated + per trained token x tokens_trained; then what
partial rollouts do to it on the worked task.

    runs (the real entry point, torchrun, 2 processes + the embedded engine, GRPO without the DAPO filter so that
    every generated token is also trained): the cached warm start (the default task's worked responses, 14 to ~160
    tokens), and an untrained model (--warm-start-steps 0: random tokens until the end token or
    --rollout-max-response-len) at two response limits, on the answer-only task's prompts
    ─► every step after the first --skip-steps of each run ─► least squares (bench/run_costs.fit_step_cost)
    ─► a table of the runs' median phases, the fit, `name: value` lines

    partial rollouts: GRPO and DPPO (the embedded default, DAPO filter on) from the same warm start, each with
    synchronous rollouts and with --partial-rollout (PARTIAL_FLAGS) ─► steps per second (every step trains one whole
    drawn batch in both) and the fit with one fixed part per mode and shared per-token costs

The fixed part is what pruning cannot remove: mostly the engine's decode iterations, as many as the step's longest
response needs; partial rollouts spread those over the steps a draw stays open. The runs share one cache directory,
so the warm start is trained once and reused. Last lines: `step_cost_fixed_share_partial` (the partial mode's fixed
part over its mean step) and `partial_rollout_step_speedup` (steps per second with partial rollouts over synchronous
ones, the smaller of GRPO's and DPPO's).

On a GPU (--engine-device cuda: the embedded engine decodes on rank 0's GPU, beside the trainer) a decode
iteration costs about the same for 1 row as for 64, where the CPU engine's grows with the rows: the fixed part of a
step is then mostly decode iterations, which is what partial rollouts cut. --headline-only runs GRPO's synchronous
and partial-rollout runs alone (tools/gpu_check.py's short measurement).

python bench/step_cost.py [--budget-s 40] [--out-dir runs/step_cost] [--processes 2] [--engine-device cuda]
                          [--headline-only] [--trainer-flags "..."]
"""

import argparse
import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.markdown_table import markdown  # noqa: E402
from bench.run_costs import fit_step_cost  # noqa: E402
from bench.training_run import launch_unless_finished  # noqa: E402
from megatron_dppo.metrics import load_run  # noqa: E402

# name -> trainer flags on top of GRPO without the DAPO filter: three response-length regimes
RUNS = {
    "warm start, worked responses": [],
    # the answer-only task's prompts: a response limit below the worked task's longest responses is refused there
    "untrained, up to 16 tokens": ["--warm-start-steps", "0", "--synthetic-task", "answer",
                                   "--rollout-max-response-len", "16"],
    "untrained, up to 44 tokens": ["--warm-start-steps", "0", "--synthetic-task", "answer",
                                   "--rollout-max-response-len", "44"],
}
PHASES = ("seconds_step", "seconds_rollout", "seconds_update", "seconds_sync", "tokens_generated", "tokens_trained")
# the worked task's comparison: algorithm -> flags (the embedded default's DAPO filter kept), and the rollout modes:
# synchronous, the shipped partial-rollout defaults (the headline), and other bounds and chunk sizes
ALGORITHMS = {"grpo": ["--algorithm", "grpo"], "dppo": ["--algorithm", "dppo"]}
MODES = {
    "synchronous": [],
    "partial, chunks of 64": ["--partial-rollout", "--partial-rollout-chunk-tokens", "64"],  # the shipped defaults
    "partial, chunks of 32": ["--partial-rollout", "--partial-rollout-chunk-tokens", "32"],
    "partial, chunks of 32, staleness 2": ["--partial-rollout", "--partial-rollout-chunk-tokens", "32",
                                           "--partial-rollout-max-staleness", "2"],
    "partial, chunks of 64, no prefix cache": ["--partial-rollout", "--partial-rollout-chunk-tokens", "64",
                                               "--rollout-engine-disable-radix-cache"],
    # the engine's layout: the trainer's default gives it one decode worker per trainer process, 1 thread each
    "synchronous, engine 1 worker x 2 threads": ["--rollout-engine-workers", "1", "--rollout-engine-threads", "2"],
}
HEADLINE = "partial, chunks of 64"  # --partial-rollout alone: --partial-rollout-max-staleness 1, chunks of 64


def steps_per_second(run) -> float:
    return len(run.records) / sum(float(r["seconds_step"]) for r in run.records)


def median_row(run, keys) -> list[str]:
    return [f"{statistics.median(float(r.get(key, 0.0)) for r in run.records):.4g}" for key in keys]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=40.0, help="RL seconds per cost-model run")
    parser.add_argument("--modes-budget-s", type=float, default=90.0,
                        help="RL seconds per run of the worked task's rollout-mode comparison")
    parser.add_argument("--out-dir", default="runs/step_cost")
    parser.add_argument("--processes", type=int, default=2, help="torchrun --nproc-per-node")
    parser.add_argument("--skip-steps", type=int, default=5, help="first steps of each run left out (warm-up)")
    parser.add_argument("--engine-device", choices=("cpu", "cuda"), default="cpu",
                        help="--rollout-engine-device of every run (cuda: a GPU's decode cost)")
    parser.add_argument("--headline-only", action="store_true",
                        help="only GRPO on the worked task, synchronous and with partial rollouts (chunks of 64): "
                             "steps per second and partial_rollout_step_speedup, no cost model")
    parser.add_argument("--trainer-flags", default="", help="more trainer flags for every run (one string)")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)

    def run_of(flags: list[str], name: str, budget_s: float):
        common = ["--cache-dir", str(out / "cache"), "--eval-size", "16", "--time-budget-s", str(budget_s),
                  *(["--rollout-engine-device", args.engine_device] if args.engine_device != "cpu" else []),
                  *shlex.split(args.trainer_flags)]
        run_dir = launch_unless_finished([*common, *flags], out / name.replace(", ", "_").replace(" ", "_"),
                                         args.processes)
        run = load_run(run_dir, name)
        run.records = run.records[args.skip_steps:]
        return run

    keys = ("decode_iterations", *PHASES)
    if args.headline_only:
        runs = {mode: run_of([*ALGORITHMS["grpo"], *MODES[mode]], f"grpo, {mode}", args.modes_budget_s)
                for mode in ("synchronous", HEADLINE)}
        print(markdown(["rollouts", "steps", "steps/s", *keys], [
            [mode, str(len(run.records)), f"{steps_per_second(run):.3f}", *median_row(run, keys)]
            for mode, run in runs.items()]))
        print(f"partial_rollout_step_speedup: "
              f"{steps_per_second(runs[HEADLINE]) / steps_per_second(runs['synchronous']):.3f}")
        return
    base = {name: run_of(["--algorithm", "grpo", "--no-dapo-filter", *flags], f"run_{index}", args.budget_s)
            for index, (name, flags) in enumerate(RUNS.items())}
    by_mode = {mode: {algorithm: run_of([*flags, *extra], f"{algorithm}, {mode}", args.modes_budget_s)
                      for algorithm, flags in ALGORITHMS.items()} for mode, extra in MODES.items()}
    every_run = [*base.values(), *(run for runs in by_mode.values() for run in runs.values())]
    cost = fit_step_cost(every_run)
    print(markdown(["run", "steps", *keys], [[name, str(len(run.records)), *median_row(run, keys)]
                                              for name, run in base.items()]))
    print(f"\nThe worked task, by rollout mode ({args.modes_budget_s:.0f} s of RL each):\n")
    rows, shares, speedups = [], {}, {}
    for mode, runs in by_mode.items():
        records = [r for run in runs.values() for r in run.records]
        step = statistics.fmean(float(r["seconds_step"]) for r in records)
        iterations = statistics.fmean(float(r.get("decode_iterations", 0.0)) for r in records)
        shares[mode] = (cost["fixed"] + cost["per_iteration"] * iterations) / step
        speedups[mode] = min(steps_per_second(runs[a]) / steps_per_second(by_mode["synchronous"][a]) for a in runs)
        for algorithm, run in runs.items():
            rows.append([algorithm, mode, str(len(run.records)), f"{steps_per_second(run):.3f}",
                         f"{steps_per_second(run) / steps_per_second(by_mode['synchronous'][algorithm]):.2f}x",
                         *median_row(run, keys),
                         f"{statistics.fmean(r.get('partial_chunks', 1.0) for r in run.records):.2f}"])
    print(markdown(["algorithm", "rollouts", "steps", "steps/s", "vs synchronous", *keys, "chunks/step"], rows))
    print(f"\nFit over {sum(len(run.records) for run in every_run)} steps of every run (R² {cost['r_squared']:.2f}): "
          f"step ≈ {1000 * cost['fixed']:.1f} ms + {1000 * cost['per_iteration']:.2f} ms x decode iterations + "
          f"{1e6 * cost['per_generated']:.1f} µs x generated tokens + {1e6 * cost['per_trained']:.1f} µs x trained "
          "tokens. The part of a step that does not scale with tokens (fixed + decode iterations), by mode: "
          + ", ".join(f"{mode} {100 * share:.0f}%" for mode, share in shares.items()) + ".")
    print("Steps per second against synchronous rollouts, the smaller of GRPO's and DPPO's: "
          + ", ".join(f"{mode} {value:.2f}x" for mode, value in speedups.items() if mode != "synchronous"))
    print(f"step_cost_fixed_ms: {1000 * cost['fixed']:.2f}")
    print(f"step_cost_per_iteration_ms: {1000 * cost['per_iteration']:.3f}")
    print(f"step_cost_per_generated_token_us: {1e6 * cost['per_generated']:.2f}")
    print(f"step_cost_per_trained_token_us: {1e6 * cost['per_trained']:.2f}")
    print(f"step_cost_fixed_share_synchronous: {shares['synchronous']:.3f}")
    print(f"step_cost_fixed_share_partial: {shares[HEADLINE]:.3f}")
    print(f"partial_rollout_step_speedup: {speedups[HEADLINE]:.3f}")


if __name__ == "__main__":
    main()

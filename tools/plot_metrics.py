"""Draw PNG curves from the metrics of one or several training runs.

    RUN[=LABEL] ... ──► <run>/metrics.jsonl (one JSON per step) [+ <run>/summary.json]
                    ──► <output-dir>/<metric>_vs_<x>.png, every run on one figure per (metric, x)

Default curves: reward and held-out accuracy, against wall time (seconds_wall) and against the step. Runs that
share a label (seeds of one method) share a colour and one legend entry, so their spread stays visible.
Held-out accuracy is only in the steps the trainer evaluated (--eval-interval); when the run's summary.json is
there, its before/after accuracies are added at x = 0 and at the last step's x.

Example:
    python tools/plot_metrics.py runs/grpo=GRPO runs/dppo=DPPO --output-dir plots --smooth 10
"""

import argparse
import sys
from pathlib import Path

from megatron_dppo.metrics import Run, load_run, smoothed

DEFAULT_METRICS = ("reward_mean", "heldout_accuracy")
DEFAULT_X_AXES = ("seconds_wall", "step")
AXIS_TITLES = {"seconds_wall": "wall time of RL (s)", "step": "RL step",
               "seconds_steps": "wall time of RL steps, evaluations excluded (s)", "reward_mean": "mean reward",
               "heldout_accuracy": "held-out accuracy (greedy)"}


def plot_runs(runs: list[Run], output_dir: str | Path, metrics: tuple[str, ...] | None = None,
              x_axes: tuple[str, ...] = DEFAULT_X_AXES, smooth: int = 1, title: str = "") -> list[Path]:
    """One PNG per (metric, x axis) with every run on it; returns the files written.

    metrics=None plots the defaults that at least one run holds; a metric named explicitly that no run holds is
    an error (a typo or a run without --eval-interval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no runs to plot: pass at least one run directory or metrics.jsonl")
    if smooth < 1:
        raise ValueError(f"smooth window {smooth} must be >= 1 (1: no smoothing)")
    wanted = metrics if metrics is not None else tuple(
        m for m in DEFAULT_METRICS if any(run.series(m, "step")[0] for run in runs))
    for metric in wanted:
        for x_axis in x_axes:
            if not any(run.series(metric, x_axis)[0] for run in runs):
                raise ValueError(f"no run has both {metric!r} and {x_axis!r} in its metrics: check the names "
                                 "(heldout_accuracy needs the trainer's --eval-interval N)")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    labels = list(dict.fromkeys(run.label for run in runs))
    colours = {label: plt.get_cmap("tab10")(index % 10) for index, label in enumerate(labels)}
    written = []
    for metric in wanted:
        for x_axis in x_axes:
            figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
            shown = set()
            window = smooth if metric != "heldout_accuracy" else 1  # evaluations are sparse: never smooth them
            for run in runs:
                xs, ys = run.series(metric, x_axis)
                if not xs:
                    continue
                axes.plot(xs, smoothed(ys, window), color=colours[run.label], linewidth=1.2, alpha=0.85,
                          marker="o" if metric == "heldout_accuracy" else None, markersize=2.5,
                          label=None if run.label in shown else run.label)
                shown.add(run.label)
            axes.set_xlabel(AXIS_TITLES.get(x_axis, x_axis))
            axes.set_ylabel(AXIS_TITLES.get(metric, metric) + (f" (mean of {smooth})" if window > 1 else ""))
            axes.set_title(title or f"{metric} vs {x_axis}", fontsize=10)
            axes.grid(alpha=0.3)
            axes.legend(fontsize=8)
            figure.tight_layout()
            path = output_dir / f"{metric}_vs_{x_axis}.png"
            figure.savefig(path)
            plt.close(figure)
            written.append(path)
    return written


def parse_run_argument(text: str) -> tuple[str, str | None]:
    """RUN or RUN=LABEL."""
    path, _, label = text.partition("=")
    return path, label or None


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directory or metrics.jsonl, optionally =LABEL")
    parser.add_argument("--output-dir", required=True, help="where the PNG files go")
    parser.add_argument("--metrics", nargs="+", default=None, help=f"default: {' '.join(DEFAULT_METRICS)}")
    parser.add_argument("--x", nargs="+", default=list(DEFAULT_X_AXES), help="x axes (any metric key)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing-mean window for per-step metrics")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(*parse_run_argument(text)) for text in args.runs]
        written = plot_runs(runs, args.output_dir, tuple(args.metrics) if args.metrics else None, tuple(args.x),
                            args.smooth, args.title)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

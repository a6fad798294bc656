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

from megatron_dppo.flags import ToolHelpFormatter
from megatron_dppo.metrics import DEFAULT_METRICS, DEFAULT_X_AXES, load_run, plot_runs


def parse_run_argument(text: str) -> tuple[str, str | None]:
    """RUN or RUN=LABEL."""
    path, _, label = text.partition("=")
    return path, label or None


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directory or metrics.jsonl, optionally =LABEL")
    parser.add_argument("--output-dir", required=True, help="where the PNG files go")
    parser.add_argument("--metrics", nargs="+", default=None,
                        help=f"metrics to draw (default: {' '.join(DEFAULT_METRICS)})")
    parser.add_argument("--x", nargs="+", default=list(DEFAULT_X_AXES), help="x axes (any metric key)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing-mean window for per-step metrics")
    parser.add_argument("--title", default="", help="the figures' title")
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

"""Per-step metrics: one JSON line per step (metrics.jsonl), TensorBoard events, Weights & Biases (with
--wandb-project) and a progress bar (rank 0 only); the reader of that file (load_run ─► Run) and its curves
(plot_runs), which `tools/plot_metrics.py` and the benchmarks use.

    MetricsLogger.log(step, metrics) ─► <log dir>/metrics.jsonl (+ prompt_outcomes.jsonl, tensorboard/)
                                     ─► W&B run (--wandb-project, --wandb-entity, --wandb-group, --wandb-exp-name;
                                        files in --wandb-save-dir): the very scalars TensorBoard gets, at the same
                                        step, and every --wandb-rollout-table-interval steps a table of sample
                                        rollouts (--wandb-rollout-table-rows of them)
                                     ─► --save-debug-rollout-data DIR: the step's "rollout_samples", one JSON line per
                                        response, in DIR/step_NNNNNN.jsonl (RolloutRecords says at which steps a
                                        step carries them: pipeline/experience.py builds them only then)
    load_run(<log dir>) ─► Run(label, records in step order, summary.json) ─► Run.series(metric, x) ─► (xs, ys)
    plot_runs([Run, ...]) ─► <output dir>/<metric>_vs_<x>.png, every run on one figure per (metric, x)

The JSONL file is the record of a run. Beside it, prompt_outcomes.jsonl has
one line per rolled-out group (the step's "prompt_outcomes": what the prompt level predicted before rollout and what
the group turned out to be), from which bench/prompt_prediction.py measures how well history predicts. On resume
from the checkpoint of step s, both files keep steps 1..s only (later lines came from work the checkpoint does not
hold), so a resumed run's files read as if the run had never stopped; so do the debug directory's (its files of later
steps are removed). The W&B run resumes too: its id is saved with the checkpoint (launch/run.py) and passed back to
wandb.init(id=..., resume="allow"); W&B cannot forget what the stopped run logged after its checkpoint, and keeps a
step's first values (it takes only steps above the last it has, docs/trainer.md).
"""

import argparse
import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

OUTCOMES_FILE = "prompt_outcomes.jsonl"


def _truncate_after(path: Path, start_step: int) -> None:
    """Keep the lines of steps <= start_step (all of them on a fresh start)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", -1) <= start_step]
    path.write_text("".join(line + "\n" for line in kept))


def wandb_project_flag(text: str) -> str:
    """--wandb-project's argparse type: the project, when the wandb package is there to log to it."""
    if importlib.util.find_spec("wandb") is None:
        raise argparse.ArgumentTypeError("logging to Weights & Biases needs the wandb package, which is not "
                                         "installed: pip install -e '.[wandb]' (or drop --wandb-project)")
    return text


@dataclass(frozen=True)
class WandbRun:
    """A Weights & Biases run as Megatron-LM's flags name it (--wandb-project, --wandb-exp-name, --wandb-save-dir)
    with W&B's entity and group; `run_id`: the id of the run to continue (a resumed training run's), else None."""

    project: str
    name: str | None  # None: W&B names the run
    save_dir: Path  # where W&B keeps the run's files (WANDB_MODE=offline: all of it, for `wandb sync`)
    config: dict  # the run's flags
    entity: str | None = None  # None: the logged-in user's default entity
    group: str | None = None
    run_id: str | None = None


ROLLOUT_TABLE_COLUMNS = ("step", "prompt", "response", "reward", "finish_reason", "weight")


@dataclass(frozen=True)
class RolloutRecords:
    """Where a step's rollout samples go: every step to `debug_dir` (--save-debug-rollout-data), and every
    `table_interval` steps `table_rows` of them to the W&B run as a table (none without a W&B run)."""

    debug_dir: Path | None = None
    table_rows: int = 0
    table_interval: int = 1

    @classmethod
    def from_args(cls, args) -> "RolloutRecords":
        return cls(Path(args.save_debug_rollout_data) if args.save_debug_rollout_data else None,
                   args.wandb_rollout_table_rows if args.wandb_project else 0, args.wandb_rollout_table_interval)

    def table_due(self, step: int) -> bool:
        return self.table_rows > 0 and step % self.table_interval == 0

    def wanted(self, step: int) -> bool:
        """Whether step `step`'s metrics should carry its "rollout_samples"."""
        return self.debug_dir is not None or self.table_due(step)

    def table_rows_of(self, samples: list[dict]) -> list[list]:
        """The W&B table's rows: one response of each prompt first (the first prompts'), then the next ones."""
        chosen = sorted(samples, key=lambda sample: (sample["sample_index"], sample["prompt_index"]))
        return [[sample["step"]] + [sample[column] for column in ROLLOUT_TABLE_COLUMNS[1:]]
                for sample in chosen[:self.table_rows]]


class MetricsLogger:
    def __init__(self, log_dir: str | Path, enabled: bool, total_steps: int | None, start_step: int = 0,
                 prompt_totals: dict | None = None, wandb: WandbRun | None = None,
                 records: RolloutRecords | None = None):
        """`prompt_totals` (prompts_drawn, prompts_pruned so far; the run's, kept up to date by its owner) feeds the
        progress bar's pruned share. `wandb`: also log to this Weights & Biases run (`wandb_run_id` is its id, for
        the checkpoint). `records`: where a step's "rollout_samples" go."""
        self.enabled = enabled
        self.prompt_totals = prompt_totals if prompt_totals is not None else {}
        self.path = Path(log_dir) / "metrics.jsonl"
        self.outcomes_path = self.path.parent / OUTCOMES_FILE
        self.records = records or RolloutRecords()
        self.writer = self.progress = self.wandb_run = self.wandb_run_id = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.outcomes_path):
            _truncate_after(path, start_step)
        if self.records.debug_dir is not None:
            self.records.debug_dir.mkdir(parents=True, exist_ok=True)
            for later in self.records.debug_dir.glob("step_*.jsonl"):  # from work the checkpoint does not hold
                if later.stem.removeprefix("step_").isdigit() and int(later.stem.removeprefix("step_")) > start_step:
                    later.unlink()
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.writer = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"))
        if wandb is not None:
            import wandb as wandb_sdk

            wandb.save_dir.mkdir(parents=True, exist_ok=True)
            resume = {"id": wandb.run_id, "resume": "allow"} if wandb.run_id else {}
            self.wandb_run = wandb_sdk.init(project=wandb.project, entity=wandb.entity, group=wandb.group,
                                            name=wandb.name, dir=str(wandb.save_dir), config=wandb.config, **resume)
            self.wandb_run_id = self.wandb_run.id
        self.progress = tqdm(total=total_steps, initial=start_step, desc="rl", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if metrics.get("prompt_outcomes"):
            with open(self.outcomes_path, "a") as f:
                f.writelines(json.dumps({"step": step, **outcome}) + "\n" for outcome in metrics["prompt_outcomes"])
        samples = [{"step": step, **sample} for sample in metrics.get("rollout_samples") or []]
        if samples and self.records.debug_dir is not None:
            with open(self.records.debug_dir / f"step_{step:06d}.jsonl", "w") as f:
                f.writelines(json.dumps(sample) + "\n" for sample in samples)
        scalars = {key: value for key, value in record.items()
                   if isinstance(value, (int, float)) and key != "step" and math.isfinite(value)}
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        if self.wandb_run is not None:
            tables = {}
            if samples and self.records.table_due(step):
                import wandb as wandb_sdk

                tables["rollouts"] = wandb_sdk.Table(columns=list(ROLLOUT_TABLE_COLUMNS),
                                                     data=self.records.table_rows_of(samples))
            self.wandb_run.log({**scalars, **tables}, step=step)
        shown = {k: record[k] for k in ("reward_mean", "kept_fraction", "seconds_step") if k in record}
        if self.prompt_totals.get("prompts_drawn"):
            shown["pruned"] = self.prompt_totals["prompts_pruned"] / self.prompt_totals["prompts_drawn"]
        self.progress.set_postfix({k: f"{v:.3f}" for k, v in shown.items()}, refresh=False)
        self.progress.update(1)

    def close(self) -> None:
        if self.enabled:
            self.progress.close()
            self.writer.close()
            if self.wandb_run is not None:
                self.wandb_run.finish()


# ------------------------------------------------------------------------------------------------ reading
@dataclass
class Run:
    label: str
    records: list[dict]  # one per step, in step order
    summary: dict = field(default_factory=dict)

    def series(self, metric: str, x_axis: str) -> tuple[list[float], list[float]]:
        """(x, y) of every record holding both. Held-out accuracy also gets the summary's evaluations: the one
        before RL at x = 0 and the one after RL at the last record's x."""
        points = [(float(r[x_axis]), float(r[metric])) for r in self.records
                  if isinstance(r.get(x_axis), (int, float)) and isinstance(r.get(metric), (int, float))]
        if metric == "heldout_accuracy" and self.summary:
            if "heldout_accuracy_before" in self.summary:
                points.insert(0, (0.0, float(self.summary["heldout_accuracy_before"])))
            end = self.records[-1].get(x_axis) if self.records else None
            if "heldout_accuracy_after" in self.summary and isinstance(end, (int, float)):
                points.append((float(end), float(self.summary["heldout_accuracy_after"])))
        points = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
        return [x for x, _ in points], [y for _, y in points]


def load_run(path: str | Path, label: str | None = None) -> Run:
    """A run directory (holding metrics.jsonl) or a metrics.jsonl file; summary.json beside it is optional."""
    path = Path(path)
    metrics_file = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics_file.is_file():
        raise FileNotFoundError(f"no metrics file at {metrics_file}: pass a run directory written by the trainer's "
                                "--log-dir (it holds metrics.jsonl) or the metrics.jsonl file itself")
    records = []
    for number, line in enumerate(metrics_file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{metrics_file}, line {number} is not JSON ({error.msg}): the file is garbled or was "
                             "cut mid-write; delete that line or re-run the training") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{metrics_file}, line {number} is not a step record (a JSON object with an integer "
                             "'step'): pass a metrics.jsonl written by the trainer")
        records.append(record)
    if not records:
        raise ValueError(f"{metrics_file} holds no step records: the run logged no step yet; read it once it has")
    summary_file = metrics_file.parent / "summary.json"
    summary = {}
    if summary_file.is_file():
        try:
            summary = json.loads(summary_file.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{summary_file} is not JSON ({error.msg}): delete it or re-run the training") from None
    records.sort(key=lambda record: record["step"])
    return Run(label or metrics_file.parent.name, records, summary)


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (the first points average what exists so far)."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


# ------------------------------------------------------------------------------------------------ curves
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

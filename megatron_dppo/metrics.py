"""Per-step metrics: one JSON line per step (metrics.jsonl), TensorBoard events, and a progress bar (rank 0 only).

The JSONL file is the record `tools/plot_metrics.py` and the benchmarks read. Beside it, prompt_outcomes.jsonl has
one line per rolled-out group (the step's "prompt_outcomes": what the prompt level predicted before rollout and what
the group turned out to be), from which bench/prompt_prediction.py measures how well history predicts. On resume
from the checkpoint of step s, both files keep steps 1..s only (later lines came from work the checkpoint does not
hold), so a resumed run's files read as if the run had never stopped.
"""

import json
import math
from pathlib import Path

OUTCOMES_FILE = "prompt_outcomes.jsonl"


def _truncate_after(path: Path, start_step: int) -> None:
    """Keep the lines of steps <= start_step (all of them on a fresh start)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", -1) <= start_step]
    path.write_text("".join(line + "\n" for line in kept))


class MetricsLogger:
    def __init__(self, log_dir: str | Path, enabled: bool, total_steps: int | None, start_step: int = 0,
                 prompt_totals: dict | None = None):
        """`prompt_totals` (prompts_drawn, prompts_pruned so far; the run's, kept up to date by its owner) feeds the
        progress bar's pruned share."""
        self.enabled = enabled
        self.prompt_totals = prompt_totals if prompt_totals is not None else {}
        self.path = Path(log_dir) / "metrics.jsonl"
        self.outcomes_path = self.path.parent / OUTCOMES_FILE
        self.writer = self.progress = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.outcomes_path):
            _truncate_after(path, start_step)
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.writer = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"))
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
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()
        shown = {k: record[k] for k in ("reward_mean", "kept_fraction", "seconds_step") if k in record}
        if self.prompt_totals.get("prompts_drawn"):
            shown["pruned"] = self.prompt_totals["prompts_pruned"] / self.prompt_totals["prompts_drawn"]
        self.progress.set_postfix({k: f"{v:.3f}" for k, v in shown.items()}, refresh=False)
        self.progress.update(1)

    def close(self) -> None:
        if self.enabled:
            self.progress.close()
            self.writer.close()

"""Per-step metrics: one JSON line per step (metrics.jsonl), TensorBoard events, and a progress bar (rank 0 only).

The JSONL file is the record `tools/plot_metrics.py` and the benchmarks read. On resume from the checkpoint of step
s, the file keeps steps 1..s only (later lines came from work the checkpoint does not hold), so a resumed run's file
reads as if the run had never stopped.
"""

import json
import math
from pathlib import Path


class MetricsLogger:
    def __init__(self, log_dir: str | Path, enabled: bool, total_steps: int | None, start_step: int = 0):
        self.enabled = enabled
        self.path = Path(log_dir) / "metrics.jsonl"
        self.writer = self.progress = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.writer = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"))
        self.progress = tqdm(total=total_steps, initial=start_step, desc="rl", unit="step", dynamic_ncols=True)

    def _truncate_after(self, start_step: int) -> None:
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", -1) <= start_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()
        shown = {k: record[k] for k in ("reward_mean", "kept_fraction", "seconds_step") if k in record}
        self.progress.set_postfix({k: f"{v:.3f}" for k, v in shown.items()}, refresh=False)
        self.progress.update(1)

    def close(self) -> None:
        if self.enabled:
            self.progress.close()
            self.writer.close()

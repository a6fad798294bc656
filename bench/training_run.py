"""One training run through the real entry point, as every bench starts it: resumable and pausable.

    flags ─► torchrun --standalone examples/pretrain_dppo.py ... --log-dir <run dir>
          ─► <run dir>/command.txt, stdout.log and the trainer's files (summary.json, metrics.jsonl, ...)

Invariants: a run whose directory holds summary.json written by the same command is read, not run again (a long
bench is finished over several sittings); a run cut short is started again from scratch; a file named PAUSE_FILE in
any folder above a run's directory holds the bench before that run starts, never during a run.
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAUSE_FILE = "pause"  # runs/<bench>/pause: hold before the next run (a run in progress is never disturbed)
PAUSE_POLL_S = 5.0


def command_for(flags: list[str], log_dir: Path, processes: int) -> list[str]:
    # --standalone: a free rendezvous port, so runs of other people on the machine do not collide with ours
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            str(REPO / "examples" / "pretrain_dppo.py"), *flags, "--log-dir", str(log_dir)]


def launch(flags: list[str], log_dir: Path, processes: int) -> float:
    """One training run through the real entry point; returns its wall seconds. Output goes to log_dir/stdout.log."""
    shutil.rmtree(log_dir, ignore_errors=True)  # a run cut short cannot be resumed by budget: start it again
    log_dir.mkdir(parents=True)
    command = command_for(flags, log_dir, processes)
    (log_dir / "command.txt").write_text(" ".join(command[1:]) + "\n")
    start = time.perf_counter()
    with open(log_dir / "stdout.log", "w") as log:
        result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"training run failed (exit {result.returncode}); its output is in {log_dir / 'stdout.log'}"
                           f" and its command in {log_dir / 'command.txt'}")
    return seconds


def finished(run_dir: Path, flags: list[str] | None = None, processes: int = 0) -> bool:
    """The run completed (summary.json) and, when flags are given, with exactly this command (else it re-runs)."""
    if not (run_dir / "summary.json").is_file():
        return False
    if flags is None:
        return True
    recorded = (run_dir / "command.txt").read_text().strip() if (run_dir / "command.txt").is_file() else ""
    return recorded == " ".join(command_for(flags, run_dir, processes)[1:])


def hold_while_paused(run_dir: Path) -> None:
    """Wait while a file named PAUSE_FILE is in any folder above `run_dir` up to runs/: a long benchmark is held
    between runs, so that the machine can do other work without disturbing a timed run."""
    folders = [folder for folder in run_dir.parents if (folder / PAUSE_FILE).is_file()]
    if folders:
        print(f"holding before {run_dir}: remove {folders[0] / PAUSE_FILE} to go on", flush=True)
    while any((folder / PAUSE_FILE).is_file() for folder in run_dir.parents):
        time.sleep(PAUSE_POLL_S)


def launch_unless_finished(flags: list[str], run_dir: Path, processes: int) -> Path:
    """Run unless finished with this command; a failed run is raised with where its output is."""
    if finished(run_dir, flags, processes):
        return run_dir
    hold_while_paused(run_dir)
    launch(flags, run_dir, processes)
    return run_dir

"""One training run through the real entry point, as every bench starts it: resumable and pausable.

    flags ─► torchrun --standalone examples/pretrain_dppo.py ... --log-dir <run dir>
          ─► <run dir>/command.txt, stdout.log and the trainer's files (summary.json, metrics.jsonl, ...)

Invariants: a run whose directory holds summary.json written by the same command is read, not run again (a long
bench is finished over several sittings); a run cut short is started again from scratch; a file named PAUSE_FILE in
any folder above a run's directory holds the bench before that run starts, never during a run.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAUSE_FILE = "pause"  # runs/<bench>/pause (or pause.<anything>: one per holder): hold before the next run
PAUSE_POLL_S = 5.0
MACHINE_FILE = "machine.json"  # beside a run's summary: what else the machine did while the run ran


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
    busy_before, children_before = machine_busy_seconds(), children_cpu_seconds()
    start = time.perf_counter()
    with open(log_dir / "stdout.log", "w") as log:
        result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"training run failed (exit {result.returncode}); its output is in {log_dir / 'stdout.log'}"
                           f" and its command in {log_dir / 'command.txt'}")
    own = children_cpu_seconds() - children_before
    busy = machine_busy_seconds() - busy_before
    (log_dir / MACHINE_FILE).write_text(json.dumps({
        "wall_seconds": seconds, "run_cpu_seconds": own, "machine_busy_seconds": busy,
        "other_cores_busy": max(busy - own, 0.0) / seconds if busy is not None else None,
        "cores": os.cpu_count()}))
    return seconds


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of every finished child process of the bench (torchrun and all it waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine spent busy since boot (every core; /proc/stat's non-idle time), None where the
    kernel does not expose it. Beside children_cpu_seconds it says how much of a run's machine others used: the
    noise a shared machine adds to its wall time."""
    try:
        fields = [float(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user nice system idle iowait irq softirq steal


def finished(run_dir: Path, flags: list[str] | None = None, processes: int = 0) -> bool:
    """The run completed (summary.json) and, when flags are given, with exactly this command (else it re-runs)."""
    if not (run_dir / "summary.json").is_file():
        return False
    if flags is None:
        return True
    recorded = (run_dir / "command.txt").read_text().strip() if (run_dir / "command.txt").is_file() else ""
    return recorded == " ".join(command_for(flags, run_dir, processes)[1:])


def pause_files(run_dir: Path) -> list[Path]:
    """Every PAUSE_FILE (or PAUSE_FILE.<holder>) in a folder above `run_dir`."""
    return [path for folder in run_dir.parents for path in folder.glob(f"{PAUSE_FILE}*") if path.is_file()]


def hold_while_paused(run_dir: Path) -> None:
    """Wait while a pause file is in any folder above `run_dir` up to runs/: a long benchmark is held between runs,
    so that the machine can do other work without disturbing a timed run. Several holders may each keep their own
    pause.<name>; the bench goes on when the last is removed."""
    held = pause_files(run_dir)
    if held:
        print(f"holding before {run_dir}: remove {', '.join(map(str, held))} to go on", flush=True)
    while pause_files(run_dir):
        time.sleep(PAUSE_POLL_S)


def launch_unless_finished(flags: list[str], run_dir: Path, processes: int) -> Path:
    """Run unless finished with this command; a failed run is raised with where its output is."""
    if finished(run_dir, flags, processes):
        return run_dir
    hold_while_paused(run_dir)
    launch(flags, run_dir, processes)
    return run_dir

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
MACHINE_FILE = "machine.json"  # beside a run's summary: what else the machine ran meanwhile (other_load)


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
    others_before, children_before = process_cpu(), children_cpu_seconds()
    start = time.perf_counter()
    with open(log_dir / "stdout.log", "w") as log:
        result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if result.returncode != 0:  # the output's error lines travel with the exception: a remote run's files may not
        said = [line for line in (log_dir / "stdout.log").read_text(errors="replace").splitlines()
                if "error" in line.lower() and "warn" not in line.lower()]
        raise RuntimeError(f"training run failed (exit {result.returncode}); its output is in {log_dir / 'stdout.log'}"
                           f" and its command in {log_dir / 'command.txt'}; its error lines: {' | '.join(said[-3:])}")
    load = other_load(others_before, process_cpu(), seconds)
    (log_dir / MACHINE_FILE).write_text(json.dumps({
        "wall_seconds": seconds, "run_cpu_seconds": children_cpu_seconds() - children_before, **load,
        "cores": os.cpu_count()}))
    return seconds


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of every finished child process of the bench (torchrun and all it waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu() -> dict[tuple[int, str], tuple[str, int, float]]:
    """(pid, start time) -> (name, nice, CPU seconds) of every process on the machine but the bench itself: its own
    user and system time and that of the children it reaped (/proc/<pid>/stat), so that a process that ends does not
    take its CPU time with it: the time moves into its parent's count. Empty where /proc is not there."""
    ticks, own, processes = os.sysconf("SC_CLK_TCK"), os.getpid(), {}
    for entry in Path("/proc").glob("[0-9]*"):
        if int(entry.name) == own:
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()  # from field 3 (state) on: the name may hold spaces
        processes[(int(entry.name), fields[19])] = (text[text.index("(") + 1:text.rindex(")")], int(fields[16]),
                                                    sum(float(value) for value in fields[11:15]) / ticks)
    return processes


def other_load(before: dict, after: dict, seconds: float, least_seconds: float = 0.1) -> dict:
    """What else the machine ran between two process_cpu() readings `seconds` apart, the bench's own processes aside
    (they are its children, and their time moves into the bench, which neither reading counts): other CPU seconds
    (the sum over processes of after minus before, which counts a process that started meanwhile whole and one that
    ended in the parent that reaped it), that per second (cores busy), and every process that used `least_seconds` or
    more, busiest first."""
    used = {key: after[key][2] - before.get(key, (None, None, 0.0))[2] for key in after}
    total = sum(process[2] for process in after.values()) - sum(process[2] for process in before.values())
    busiest = sorted((key for key in used if used[key] >= least_seconds), key=used.get, reverse=True)
    return {"other_cpu_seconds": total, "other_cores_busy": total / seconds,
            "other_processes": [{"pid": key[0], "name": after[key][0], "nice": after[key][1],
                                 "cpu_seconds": round(used[key], 2)} for key in busiest]}


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

"""Run a multi-process check under torchrun, bounded in time, and never leave processes behind.

Each launch costs about 10 s (imports and rendezvous), so a worker script groups several checks.
The launch gets its own process group and a marker in its environment, which every process it starts inherits; on
exit or timeout the whole group and every marked process are killed. The marker reaches what the group does not:
torchrun (torch 2.13) starts each rank in a session of its own, and megatron's checkpoint writer its spawn Manager.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from megatron_dppo.platform.network import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCH_MARKER = "MEGATRON_DPPO_TEST_LAUNCH"  # NAME=<unique value> in the environment of everything a launch starts


def start_torchrun(script: Path, nproc: int, args=(), env: dict | None = None) -> subprocess.Popen:
    """`torchrun --nproc-per-node nproc script args` in a new process group, marked (output captured)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *map(str, args),
    ]
    marker = uuid.uuid4().hex
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), LAUNCH_MARKER: marker,
                **(env or {})}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                               cwd=REPO_ROOT, start_new_session=True)
    process.marker = f"{LAUNCH_MARKER}={marker}"
    return process


def processes_marked(marker: str) -> list[int]:
    """Pids of the live processes whose environment holds `marker` (a unique NAME=value given to a launch, which
    every process it starts inherits): what a launch left behind. Zombies are dead and not counted."""
    needle = b"\0" + marker.encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if needle in b"\0" + (entry / "environ").read_bytes() + b"\0" and state != "Z":
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def kill_marked(marker: str) -> None:
    for pid in processes_marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the launch's process group and every process marked as its own (start_torchrun)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if getattr(process, "marker", None):
        kill_marked(process.marker)


def finish(process: subprocess.Popen, timeout: float, what: str) -> str:
    """Wait for the launch (killing its whole group at the end, or at the timeout); return its output."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        output, _ = process.communicate()
        raise AssertionError(f"{what} timed out after {timeout} s:\n{output[-6000:]}") from None
    finally:
        kill_group(process)
    return output


def kill_once_saved(process: subprocess.Popen, save_dir: Path, step: int, timeout: float = 300) -> int:
    """SIGKILL the launch's whole group as soon as `save_dir/latest` names a checkpoint of `step` or later, as a lost
    node or the OOM killer would end a run mid-way after a save; returns the step `latest` named at the kill (the
    run may have saved again before the kill landed)."""
    from megatron_dppo.actor.checkpoint_dir import checkpoint_step, latest_name

    deadline = time.monotonic() + timeout
    while (name := latest_name(save_dir)) is None or checkpoint_step(name) < step:
        if process.poll() is not None:
            raise AssertionError(f"the run ended before its step-{step} checkpoint:\n{process.stdout.read()[-6000:]}")
        if time.monotonic() > deadline:
            kill_group(process)
            raise AssertionError(f"no step-{step} checkpoint in {save_dir} within {timeout} s")
        time.sleep(0.05)
    kill_group(process)
    process.communicate()
    return checkpoint_step(latest_name(save_dir))


def run_torchrun(script: Path, nproc: int, args=(), timeout: float = 300, env: dict | None = None) -> str:
    """Run `torchrun --nproc-per-node nproc script args`; return its output, raise on failure or timeout."""
    process = start_torchrun(script, nproc, args, env)
    output = finish(process, timeout, f"torchrun {script.name}")
    if process.returncode != 0:
        raise AssertionError(f"torchrun {script.name} exited {process.returncode}:\n{output[-8000:]}")
    return output

"""Run a multi-process check under torchrun, bounded in time, and never leave processes behind.

Each launch costs about 10 s (imports and rendezvous), so a worker script groups several checks.
The launch gets its own process group; on exit or timeout the whole group is killed, which also
reaps the spawn Manager that megatron's checkpoint writer starts.
"""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(script: Path, nproc: int, args: list[str] = (), timeout: float = 300, env: dict | None = None):
    """Run `torchrun --nproc-per-node nproc script args`; return the CompletedProcess, raise on failure."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *map(str, args),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
        cwd=REPO_ROOT, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"torchrun {script.name} timed out after {timeout} s:\n{output[-6000:]}") from None
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if process.returncode != 0:
        raise AssertionError(f"torchrun {script.name} exited {process.returncode}:\n{output[-8000:]}")
    return output

"""No process of a run outlives its trainer: rank 0 of the embedded default under torchrun is SIGKILLed at three
points, and a few seconds later nothing the launch started is left (the engine, its tether, the other rank,
torchrun).

The points: right after rank 0 has launched the engine (the engine is still importing torch, the case where a
watchdog inside the engine could not yet run); during the supervised warm start (no engine yet: the ranks and
torchrun must go); during the first weight sync (the engine is frozen once it has joined the weight-sync group, so
rank 0 is certainly inside the sync when it dies, then thawed, blocked on a peer that is gone). Every process the
launch starts carries a marker variable in its environment; the test finds them by it and kills any left over.
"""

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, kill_marked, processes_marked, start_torchrun

ENTRY = REPO_ROOT / "examples" / "pretrain_dppo.py"
MARKER_NAME = "MEGATRON_DPPO_LIFETIME_TEST"
ENGINE_MODULE = "megatron_dppo.servers.embedded"
STAGE_TIMEOUT_S = 240  # imports, rendezvous, warm start and the engine's start on 2 shared cores
GONE_WITHIN_S = 10


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def marked(marker: str, where) -> list[int]:
    """The marked processes for which `where(pid)` holds (those that vanish meanwhile are left out)."""
    found = []
    for pid in processes_marked(marker):
        try:
            if where(pid):
                found.append(pid)
        except OSError:
            continue
    return found


def trainer_rank0(marker: str) -> list[int]:
    return marked(marker, lambda pid: environ(pid).get("RANK") == "0" and str(ENTRY) in cmdline(pid))


def engines(marker: str) -> list[int]:
    """The engine processes (not their tethers, whose command lines end with the engine's)."""
    return marked(marker, lambda pid: cmdline(pid)[1:3] == ["-m", ENGINE_MODULE])


def outbound_connections(pid: int) -> int:
    """Established TCP connections of `pid` other than those to its own HTTP port: the engine makes one only when it
    joins the weight-sync group (the trainer's TCPStore, then gloo's pairs)."""
    command = cmdline(pid)
    http_port = int(command[command.index("--port") + 1])
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            sockets.add(target[len("socket:["):-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
            count += inode in sockets and state == "01" and local_port != http_port
    return count


def wait_for(what: str, find, output: list[str], timeout_s: float = STAGE_TIMEOUT_S, poll_s: float = 0.02):
    """Poll `find()` until it returns something truthy; fail with the launch's output if the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = find()
        if found:
            return found
        time.sleep(poll_s)
    raise AssertionError(f"never reached: {what}\n{''.join(output)[-4000:]}")


def collect(process) -> tuple[list[str], threading.Thread]:
    """Read the launch's output in a thread (a full pipe would stall it); the list grows as it arrives."""
    chunks: list[str] = []

    def read():
        for chunk in iter(lambda: os.read(process.stdout.fileno(), 4096), b""):
            chunks.append(chunk.decode(errors="replace"))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return chunks, thread


def kill_rank0_at_warm_start(marker, output):
    wait_for("the warm start", lambda: "warm start" in "".join(output), output)
    return wait_for("trainer rank 0", lambda: trainer_rank0(marker), output)[0], None


def kill_rank0_when_the_engine_is_launched(marker, output):
    wait_for("the engine's process", lambda: engines(marker), output)
    return trainer_rank0(marker)[0], None


def kill_rank0_during_the_first_weight_sync(marker, output):
    (engine,) = wait_for("the engine's process", lambda: engines(marker), output)
    # Watched alone and without pause: its first outbound connection (to the trainer's TCPStore) comes at the start
    # of the group's creation, which takes more round trips to finish than one look takes.
    wait_for("the engine joining the weight-sync group", lambda: outbound_connections(engine), output, poll_s=0)
    os.kill(engine, signal.SIGSTOP)  # the sync cannot end now: rank 0 is inside it until it dies
    return trainer_rank0(marker)[0], engine


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lifetime_cache")  # the zero-step warm start, shared by two stages


@pytest.mark.parametrize("stage, warm_start_steps", [
    (kill_rank0_when_the_engine_is_launched, 0),
    (kill_rank0_at_warm_start, 100000),
    (kill_rank0_during_the_first_weight_sync, 0),
], ids=["engine_launched", "warm_start", "first_weight_sync"])
def test_a_trainer_killed_at_each_stage_leaves_no_process_of_its_run(stage, warm_start_steps, cache_dir, tmp_path):
    marker = f"{MARKER_NAME}={uuid.uuid4().hex}"
    flags = ["--warm-start-steps", warm_start_steps, "--cache-dir", cache_dir, "--log-dir", tmp_path / "log",
             "--eval-size", 4, "--train-iters", 1]
    process = start_torchrun(ENTRY, 2, flags, env=dict([marker.split("=")]))
    output, reader = collect(process)
    try:
        rank0, frozen_engine = stage(marker, output)
        os.kill(rank0, signal.SIGKILL)
        if frozen_engine is not None:
            os.kill(frozen_engine, signal.SIGCONT)
        deadline = time.monotonic() + GONE_WITHIN_S
        while processes_marked(marker):
            assert time.monotonic() < deadline, (
                f"left {GONE_WITHIN_S} s after rank 0 was killed: "
                f"{[(pid, ' '.join(cmdline(pid))[:160]) for pid in processes_marked(marker)]}")
            time.sleep(0.1)
        assert process.wait(timeout=GONE_WITHIN_S) != 0
    finally:
        kill_marked(marker)
        process.kill()
        reader.join(timeout=10)

"""A server started behind the tether (platform/tether.py) never outlives the process that started it: not when that
process dies before the tether has even checked, not when it dies later (the server's own children go too), not
when the tether itself is SIGKILLed; and a SIGTERM to the tether is the server's to handle, its status comes back."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from megatron_dppo.platform import tether
from tests.launch import REPO_ROOT, kill_marked, processes_marked

# A server with a child of its own (as vLLM's API server has its engine core): both must go.
SERVER_WITH_CHILD = [sys.executable, "-c", "import subprocess, sys, time; "
                     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"]
# A 'trainer' that starts the server behind a tether from a thread that then ends (as a rollout client's worker
# thread may restart a server), says the tether's pid, and waits to be killed.
TRAINER = ("import subprocess, sys, threading, time; from megatron_dppo.platform import tether; started = []; "
           "thread = threading.Thread(target=lambda: started.append(tether.spawn(sys.argv[1:], None, "
           "subprocess.DEVNULL))); thread.start(); thread.join(); print(started[0].pid, flush=True); time.sleep(300)")


@pytest.fixture
def marker():
    """NAME=value in the environment of every process a test starts, to find what is left; all killed at the end."""
    marker = f"MEGATRON_DPPO_TETHER_TEST={uuid.uuid4().hex}"
    yield marker
    kill_marked(marker)


def marked_env(marker: str) -> dict[str, str]:
    name, value = marker.split("=")
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), name: value}


def wait_until_gone(marker: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while processes_marked(marker):
        assert time.monotonic() < deadline, f"processes outlived their trainer: {processes_marked(marker)}"
        time.sleep(0.1)


def wait_for_count(marker: str, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(processes_marked(marker)) < count:
        assert time.monotonic() < deadline, f"expected {count} processes, found {processes_marked(marker)}"
        time.sleep(0.05)


def test_a_trainer_killed_while_its_server_runs_takes_the_server_and_its_children_along(marker):
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, *SERVER_WITH_CHILD], stdout=subprocess.PIPE,
                               text=True, env=marked_env(marker))
    tether_pid = int(trainer.stdout.readline())
    wait_for_count(marker, 4)  # trainer, tether, server, the server's child
    assert os.getpgid(tether_pid) == tether_pid  # the tether leads the server's process group
    time.sleep(3 * tether.POLL_S)  # the thread that started it has ended: the server stays while its trainer lives
    assert len(processes_marked(marker)) == 4
    trainer.kill()
    trainer.wait()
    wait_until_gone(marker)


def test_a_trainer_gone_before_the_tether_checks_never_gets_its_server_started(tmp_path):
    started = tmp_path / "started"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is certainly not the tether's parent
    finished = subprocess.run([sys.executable, "-I", tether.__file__, str(gone.pid), "--", "touch", str(started)],
                              capture_output=True, text=True, timeout=30)
    assert finished.returncode == tether.ORPHANED_AT_START
    assert f"the process that started this server ({gone.pid}) is gone; not starting touch" in finished.stderr
    assert not started.exists()


def test_a_sigkilled_tether_takes_its_server_along(marker):
    process = tether.spawn(SERVER_WITH_CHILD[:2] + ["import time; time.sleep(300)"], marked_env(marker),
                           subprocess.DEVNULL)
    wait_for_count(marker, 2)
    process.kill()
    process.wait()
    wait_until_gone(marker)


def test_sigterm_to_the_tether_is_handled_by_the_server_whose_status_comes_back(marker):
    server = [sys.executable, "-c", "import signal, sys, time; "
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); print('up', flush=True); time.sleep(300)"]
    process = tether.spawn(server, marked_env(marker), subprocess.PIPE)
    assert process.stdout.readline() == b"up\n"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 7
    wait_until_gone(marker)

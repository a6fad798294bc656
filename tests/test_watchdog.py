"""platform/watchdog.py with real processes on this host: ranks (tests/workers/watchdog_rank.py, no torch) and HTTP
servers, frozen with SIGSTOP as a hung or partitioned peer is (it keeps its sockets and says nothing).

The bound a test holds the watchdog to is the documented one: a silent peer is noticed --heartbeat-timeout-s after
its last word, checked every --heartbeat-interval-s, and the run ends at once; SLACK_S covers process exit and a
loaded machine's scheduling. The multi-host faults (a link down, a frozen trainer) are tests/test_cluster_faults.py.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_dppo.platform.network import free_port
from megatron_dppo.platform.watchdog import EXIT_STATUS, Connection
from tests.launch import REPO_ROOT

WORKER = REPO_ROOT / "tests" / "workers" / "watchdog_rank.py"
INTERVAL_S, TIMEOUT_S = 0.5, 4.0
SLACK_S = 5.0
BOUND_S = TIMEOUT_S + INTERVAL_S + SLACK_S


class Ranks:
    """Processes of one pretend run, each with its output in a file."""

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.port, self.processes = tmp_path, free_port(), {}

    def start(self, rank: int, world: int, phases: list, **plan) -> subprocess.Popen:
        plan = {"world": world, "port": self.port, "interval_s": INTERVAL_S, "timeout_s": TIMEOUT_S,
                "phases": phases, **plan}
        log = open(self.tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - the process holds it
        process = subprocess.Popen([sys.executable, str(WORKER), json.dumps(plan)], stdout=log,
                                   stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True,
                                   env={**os.environ, "RANK": str(rank), "PYTHONPATH": str(REPO_ROOT)})
        self.processes[rank] = process
        return process

    def output(self, rank: int) -> str:
        return (self.tmp_path / f"rank{rank}.log").read_text()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while not all("ready" in self.output(rank) for rank in self.processes):
            assert time.monotonic() < deadline, {rank: self.output(rank) for rank in self.processes}
            time.sleep(0.05)

    def wait(self, rank: int, timeout: float) -> int:
        try:
            return self.processes[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {rank} still running after {timeout} s:\n{self.output(rank)}") from None

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture
def ranks(tmp_path):
    started = Ranks(tmp_path)
    yield started
    started.kill_all()


def endings(output: str) -> list[str]:
    """The watchdog's lines that end a run (not rank 0's opening line)."""
    return [line for line in output.splitlines() if line.startswith("watchdog: ") and "heartbeats on" not in line]


def watchdog_line(output: str) -> str:
    lines = endings(output)
    assert len(lines) == 1, output
    return lines[0]


def silent_seconds(line: str) -> float:
    return float(re.search(r"unheard for (\d+) s", line).group(1))


def test_a_frozen_rank_ends_every_other_rank_within_the_bound_with_one_line_naming_its_host_and_phase(ranks):
    ranks.start(0, 3, [["rollouts", 60]])
    ranks.start(1, 3, [["update", 60]])
    ranks.start(2, 3, [["experience", 60]])
    ranks.wait_ready()
    time.sleep(2 * INTERVAL_S)  # every rank has told its phase
    os.kill(ranks.processes[1].pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    assert ranks.wait(0, 60) == EXIT_STATUS and ranks.wait(2, 60) == EXIT_STATUS
    detected_s = time.monotonic() - frozen_at
    line = watchdog_line(ranks.output(0))
    assert f"rank 1 on {socket.gethostname()} unheard for" in line and "(its last phase: update)" in line
    assert "rank 0 on" in line and "is in phase rollouts" in line and "resume from the last checkpoint" in line
    assert TIMEOUT_S <= silent_seconds(line) + 1 and detected_s < BOUND_S, (line, detected_s)
    assert watchdog_line(ranks.output(2)) == line  # the hub told the rank it could still reach


def test_a_frozen_rank_0_ends_the_others_naming_its_host_and_phase(ranks):
    ranks.start(0, 3, [["sync", 60]])
    ranks.start(1, 3, [["update", 60]])
    ranks.start(2, 3, [["update", 60]])
    ranks.wait_ready()
    time.sleep(2 * INTERVAL_S)
    os.kill(ranks.processes[0].pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    for rank in (1, 2):
        assert ranks.wait(rank, 60) == EXIT_STATUS
        line = watchdog_line(ranks.output(rank))
        assert "rank 0 on 127.0.0.1 unheard for" in line and "(its last phase: sync)" in line, line
        assert f"rank {rank} on {socket.gethostname()} is in phase update" in line
    assert time.monotonic() - frozen_at < BOUND_S


def test_a_rank_that_exits_without_finishing_ends_the_run_at_once(ranks):
    ranks.start(0, 2, [["rollouts", 60]])
    ranks.start(1, 2, [["update", 1.0]], exit_without_bye=True)
    ranks.wait_ready()
    assert ranks.wait(1, 60) == 1
    assert ranks.wait(0, 60) == EXIT_STATUS
    line = watchdog_line(ranks.output(0))  # not a silence, waited out: the connection closed
    assert "rank 1 on" in line and "closed its heartbeat connection without finishing" in line
    assert "in phase update" in line, line


def test_an_error_every_rank_found_alike_is_said_once_and_ends_no_rank_through_the_watchdog(ranks):
    """exit_saying_once stops the watchdog first: rank 0 says the error and exits, the others wait for torchrun to
    stop them (platform/process.py), as before there was a watchdog."""
    for rank in (0, 1):
        ranks.start(rank, 2, [["load", 0.5]], say_once="the error, once")
    assert ranks.wait(0, 60) == 2
    time.sleep(TIMEOUT_S + 2 * INTERVAL_S)
    assert ranks.processes[1].poll() is None, ranks.output(1)  # still in its wait, not ended by the watchdog
    assert ranks.output(0).count("the error, once") == 1 and "the error, once" not in ranks.output(1)
    assert endings(ranks.output(0)) == endings(ranks.output(1)) == []


def test_ranks_that_finish_stop_their_watchdogs_and_exit_cleanly(ranks):
    for rank, seconds in ((0, 2.0), (1, 1.0), (2, 3.0)):  # rank 0, the hub, finishes between the others
        ranks.start(rank, 3, [["update", seconds], ["sync", seconds]])
    for rank in range(3):
        assert ranks.wait(rank, 60) == 0, ranks.output(rank)
        assert endings(ranks.output(rank)) == []


def test_a_finished_sides_bye_arrives_though_it_closes_with_the_peers_beats_unread():
    # the CI failure: a rank finished while the hub's beats waited unread at its end; closing then sends a reset,
    # which drops the bye that Nagle held back for the unacknowledged phase before it (a long-lived connection is out
    # of quick-ack mode), and the hub ended a finished run. Plain close() loses it every time on Linux.
    for _ in range(5):
        with socket.create_server(("127.0.0.1", 0)) as listener:
            rank_side = socket.create_connection(listener.getsockname())
            hub_side, _ = listener.accept()
            with hub_side:
                for _ in range(30):  # a connection that has talked a while
                    rank_side.sendall(b'{"phase": "update"}\n')
                    hub_side.recv(100)
                    time.sleep(0.002)
                hub_side.sendall(b'{"beat": "outside"}\n')  # never read by the rank
                rank_side.setblocking(False)
                connection = Connection(rank_side)
                connection.send({"phase": "outside"})
                connection.send({"bye": True})
                closer = threading.Thread(target=connection.close_after_peer, args=(time.monotonic() + 5,))
                closer.start()
                received = b""
                hub_side.settimeout(5)
                while chunk := hub_side.recv(4096):  # the hub reads to the end, then closes its side
                    received += chunk
            closer.join(5)
        assert not closer.is_alive()
        assert b'{"bye": true}' in received


def test_a_phase_past_its_deadline_ends_the_run_naming_it_while_its_peers_are_alive(ranks):
    ranks.start(0, 2, [["update", 60]], deadlines={"save": 1.5})
    ranks.start(1, 2, [["save", 60]], deadlines={"save": 1.5})
    ranks.wait_ready()
    assert ranks.wait(1, 60) == EXIT_STATUS and ranks.wait(0, 60) == EXIT_STATUS
    line = watchdog_line(ranks.output(1))
    assert re.search(r"rank 1 on \S+ has been in phase save for \d+ s, past its bound of 2 s", line), line
    assert watchdog_line(ranks.output(0)) == line


def test_an_exception_leaving_a_phase_is_said_in_one_line_naming_rank_host_and_phase(ranks):
    ranks.start(0, 1, [["update", 0.1]], fail_in="update")
    assert ranks.wait(0, 60) == 1
    lines = [line for line in ranks.output(0).splitlines() if line.startswith("megatron_dppo: ")]
    assert lines == [f"megatron_dppo: rank 0 on {socket.gethostname()} failed in phase update after 0 s: "
                     "RuntimeError: planted failure in update"]


def test_a_user_input_error_leaving_a_phase_is_left_to_the_entry_point_to_say_once(ranks):
    ranks.start(0, 1, [["load", 0.1]], fail_in="load", user_error=True)
    assert ranks.wait(0, 60) == 1
    assert "planted failure in load" in ranks.output(0) and "megatron_dppo: rank" not in ranks.output(0)


SERVER = """
import http.server, sys
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(int(sys.argv[2])); self.end_headers()
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Answer).serve_forever()
"""


def test_a_frozen_rollout_server_ends_the_run_but_one_answering_errors_or_refusing_does_not(ranks, tmp_path):
    ports = {"erring": free_port(), "frozen": free_port(), "refusing": free_port()}
    servers = {name: subprocess.Popen([sys.executable, "-c", SERVER, str(ports[name]), "500" if name == "erring"
                                       else "200"], stdout=subprocess.PIPE, text=True)
               for name in ("erring", "frozen")}
    try:
        for server in servers.values():
            assert server.stdout.readline().strip() == "serving"
        urls = [f"http://127.0.0.1:{port}" for port in ports.values()]
        ranks.start(0, 1, [["rollouts", 60]], servers=urls)
        ranks.wait_ready()
        time.sleep(TIMEOUT_S + 2 * INTERVAL_S)  # erring and refusing servers have been probed for a whole bound
        assert ranks.processes[0].poll() is None, ranks.output(0)
        os.kill(servers["frozen"].pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert ranks.wait(0, 60) == EXIT_STATUS
        assert time.monotonic() - frozen_at < BOUND_S
        line = watchdog_line(ranks.output(0))
        assert f"rollout server http://127.0.0.1:{ports['frozen']} (host 127.0.0.1) unanswering for" in line, line
        assert "is in phase rollouts" in line
    finally:
        for server in servers.values():
            server.kill()
            server.wait()


def test_a_watcher_sees_every_ranks_phase_changes(ranks, tmp_path):
    """Started before the run, the watcher waits for the hub, then prints each change of rank 0 (all of them, in
    order) and of the others, and ends with the run."""
    watcher = subprocess.Popen([sys.executable, "-m", "megatron_dppo.platform.watchdog", "watch",
                                f"127.0.0.1:{ranks.port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    ranks.start(0, 2, [["rollouts", 1.5], ["sync", 0.2], ["save", 1.5]])
    ranks.start(1, 2, [["experience", 1.5], ["update", 1.5]])
    stdout, stderr = watcher.communicate(timeout=120)
    assert watcher.returncode == 0, stderr
    host = socket.gethostname()
    seen = stdout.splitlines()
    rank0 = [line.split()[-1] for line in seen if line.startswith(f"rank 0 {host} ")]
    assert [phase for phase in rank0 if phase != "outside"] == ["rollouts", "sync", "save"], seen
    assert f"rank 1 {host} update" in seen, seen
    for rank in (0, 1):
        assert ranks.wait(rank, 60) == 0

"""The faults of a multi-node run on the namespace cluster (tests/cluster/cluster.sh): each ends the run within its
documented bound with a line naming the host and the phase, and each resume from the last checkpoint trains on as
an uninterrupted run does.

    rollout-0: two embedded engines (:30000, :30001) and tests/cluster/fault_proxy.py in front of them (:30100, :30101)
    trainer-0 + trainer-1: torchrun --nnodes 2, the watchdog at --heartbeat-timeout-s 10, --heartbeat-interval-s 1;
        a checkpoint after every step, into an ext4 file system of its own (mounted before the hosts are made, so
        they share it) that the test can freeze; a watcher (platform/watchdog.py watch) on trainer-0 tells the test
        which phase rank 0 is in, so each fault lands in the phase it names
    reference: STEPS steps, uninterrupted
    chain, each run resuming from the checkpoint the one before left (a fault in step k + 1 after step k's save):
        1. mid-step  trainer-1's cable pulled while rank 0 generates step 2's rollouts (rank 1 waits for them)
        2. mid-sync  rollout-0's cable pulled while rank 0 syncs step 3's weights (through the proxy, which answers
                     every route 2 s late, so that the sync lasts long enough to be caught in)
        3. mid-save  trainer-1's cable pulled while step 4's checkpoint is written (the file system frozen to hold the
                     save there, thawed once the cable is out)
        4. frozen    rank 0 stopped (SIGSTOP) in step 5's update
        5. malformed every /generate answer of step 6 on, through the proxy, truncated
        6. the proxy answers every route 2 s late and spoils three /generate answers (HTTP 500, a truncated body, a
           body without meta_info): steps 6 and 7 train through them
    every step's metrics, the final weights and the servers' weight version equal the reference's

The detection bound is the watchdog's: the line comes at most --heartbeat-timeout-s + --heartbeat-interval-s after
the fault; DETECT_SLACK_S allows for this loaded 2-core machine's scheduling. The measured seconds are printed (the
table in docs/multinode.md, "No hang"). The kernel here has no netem qdisc (tc's "delay"), so a slow server is the
proxy's delay.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.launch import REPO_ROOT
from tests.test_multinode_cluster import (
    LOGPROB_GAP_TOL,
    ROLLOUT_NODE,
    ROLLOUT_PORT,
    WAIT_HEALTHY,
    Cluster,
    running_cluster,
    tail,
    torchrun_on,
    trainer_args,
    warm_start,  # noqa: F401 - a fixture of this module too, on its cluster
)
from tests.test_trainer import TIMING_FIELDS, export_weights, read_metrics

# the warm start, the reference and six launches: about an hour on a loaded 2-core machine
pytestmark = pytest.mark.timeout(3 * 3600)

FAULT_PROXY = REPO_ROOT / "tests" / "cluster" / "fault_proxy.py"
STEPS = 7
HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S, HEARTBEAT_PORT = 1, 10, 29400
DETECT_SLACK_S = 15
DETECT_BOUND_S = HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S + DETECT_SLACK_S
RUN_TIMEOUT_S = 900  # one launch on this loaded machine, start to end
DIRECT = [f"http://rollout-0:{ROLLOUT_PORT + i}" for i in range(2)]
PROXIED = [f"http://rollout-0:{ROLLOUT_PORT + 100 + i}" for i in range(2)]


@pytest.fixture(scope="module")
def save_fs(tmp_path_factory):
    """An ext4 file system on a loop device for the checkpoints, mounted before the hosts exist (their mount
    namespaces copy it) so that freezing it holds every host's writes."""
    root = tmp_path_factory.mktemp("save_fs")
    image, mount = root / "fs.img", root / "mnt"
    mount.mkdir()
    subprocess.run(["truncate", "-s", "512M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["fsfreeze", "-u", str(mount)], capture_output=True)
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        image.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def cluster(save_fs):
    with running_cluster() as hosts:
        yield hosts


@pytest.fixture(scope="module")
def servers(cluster, warm_start, tmp_path_factory):  # noqa: F811
    """The engines on rollout-0 and the fault proxy before them; yields the proxy's mode file."""
    logs = tmp_path_factory.mktemp("server_logs")
    mode = logs / "proxy.mode"
    mode.write_text("pass\n")
    engines = cluster.start("rollout-0", ["bash", ROLLOUT_NODE, warm_start[0], 2, 1, ROLLOUT_PORT, logs,
                                          sys.executable], logs / "rollout-0.log", env={"ROLLOUT_ENGINE": "embedded"})
    proxy = cluster.start("rollout-0", [sys.executable, FAULT_PROXY, mode, f"{ROLLOUT_PORT + 100}:{ROLLOUT_PORT}",
                                        f"{ROLLOUT_PORT + 101}:{ROLLOUT_PORT + 1}"], logs / "proxy.log")
    try:
        healthy = cluster.run("trainer-0", [sys.executable, WAIT_HEALTHY, "--timeout-s", 600, *DIRECT, *PROXIED],
                              timeout=700)
        assert healthy.returncode == 0, f"{healthy.stderr}\n{tail(logs / 'rollout-0.log')}\n{tail(logs / 'proxy.log')}"
        yield mode, logs / "proxy.log"
    finally:
        cluster.kill("rollout-0")
        engines.wait(timeout=30)
        proxy.wait(timeout=30)


def common_args(warm_start_dirs, save: Path, log_dir: Path, urls: list[str]) -> list:
    return [*trainer_args(warm_start_dirs), "--rollout-backend", "external", "--rollout-urls", *urls,
            "--train-iters", STEPS, "--save-interval", 1, "--keep-last-checkpoints", 2, "--save", save,
            "--log-dir", log_dir, "--heartbeat-interval-s", HEARTBEAT_INTERVAL_S,
            "--heartbeat-timeout-s", HEARTBEAT_TIMEOUT_S, "--heartbeat-port", HEARTBEAT_PORT]


class TrainerRun:
    """One launch on trainer-0 and trainer-1, and a watcher of rank 0's phases on trainer-0."""

    def __init__(self, cluster: Cluster, name: str, args: list, logs: Path):
        self.cluster, self.name, self.logs = cluster, name, logs
        self.log = {host: logs / f"{name}.{host}.log" for host in ("trainer-0", "trainer-1")}
        self.processes = {host: torchrun_on(cluster, host, name, args, log) for host, log in self.log.items()}
        self.watch_log = logs / f"{name}.watch.log"
        self.watcher = None

    def text(self, host: str) -> str:
        return self.log[host].read_text(errors="replace") if self.log[host].exists() else ""

    def details(self) -> str:
        return "\n".join(f"--- {path.name}\n{tail(path, 40)}" for path in [*self.log.values(), self.watch_log])

    def wait_for(self, condition, what: str, timeout: float = RUN_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while not (found := condition()):
            ended = {host: p.returncode for host, p in self.processes.items() if p.poll() is not None}
            assert time.monotonic() < deadline and not ended, f"{self.name}: no {what} (ended: {ended})\n" + \
                self.details()
            time.sleep(0.05)
        return found

    def rank0_phases(self) -> list[str]:
        if self.watcher is None:
            if "watchdog: heartbeats on" not in self.text("trainer-0"):
                return []
            self.watcher = self.cluster.start("trainer-0", [sys.executable, "-m", "megatron_dppo.platform.watchdog",
                                                            "watch", f"127.0.0.1:{HEARTBEAT_PORT}"], self.watch_log)
        text = self.watch_log.read_text() if self.watch_log.exists() else ""
        return [line.split()[-1] for line in text.splitlines() if line.startswith("rank 0 trainer-0 ")]

    def wait_phase(self, name: str, after_saves: int) -> None:
        """Until rank 0 enters `name` after its `after_saves`-th save of this launch."""
        def entered():
            phases = self.rank0_phases()
            saves = [i for i, phase in enumerate(phases) if phase == "save"]
            return len(saves) >= after_saves and name in phases[saves[after_saves - 1] + 1 if after_saves else 0:]
        self.wait_for(entered, f"phase {name} after {after_saves} saves")

    def wait_line(self, host: str, pattern: str, since: float) -> tuple[str, float]:
        """`host`'s first line ending the run (the watchdog's, or a phase's failure), which must match `pattern`,
        and how long after `since` it was seen."""
        ending = re.compile(r"^(watchdog: (?!heartbeats on)|megatron_dppo: rank ).*$", re.MULTILINE)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            ended = self.processes[host].poll() is not None  # before the read: an ended launch's log is complete
            if found := ending.search(self.text(host)):
                break
            assert time.monotonic() < deadline and not ended, f"{self.name}: no line ending the run on {host}\n" + \
                self.details()
            time.sleep(0.05)
        seconds = time.monotonic() - since
        assert re.fullmatch(pattern, found.group(0)), f"{self.name} on {host}: {found.group(0)!r} is not " \
            f"{pattern!r}\n{self.details()}"
        return found.group(0), seconds

    def wait_exit(self, host: str, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.processes[host].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} on {host} still running after {timeout} s\n{self.details()}") from None

    def end(self) -> None:
        """Whatever is left of the launch (a frozen rank, a torchrun waiting for a lost peer, the watcher)."""
        for host in ("trainer-0", "trainer-1"):
            self.cluster.kill(host)
        for process in [*self.processes.values(), *([self.watcher] if self.watcher else [])]:
            process.wait(timeout=60)


def deterministic(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not any(t in k for t in TIMING_FIELDS)} for m in metrics]


@pytest.fixture(scope="module")
def reference(cluster, warm_start, servers, tmp_path_factory):  # noqa: F811
    """STEPS steps without a fault: their metrics and the final checkpoint."""
    root = tmp_path_factory.mktemp("reference")
    run = TrainerRun(cluster, "reference", common_args(warm_start, root / "ckpt", root / "log", DIRECT), root)
    try:
        codes = {host: run.wait_exit(host) for host in run.processes}
        assert codes == {"trainer-0": 0, "trainer-1": 0}, run.details()
    finally:
        run.end()
    return deterministic(read_metrics(root / "log")), root / "ckpt" / f"iter_{STEPS:07d}"


def test_partitions_a_frozen_rank_and_a_bad_server_end_the_run_in_bound_and_every_resume_trains_on_exactly(
        cluster, warm_start, servers, reference, save_fs, tmp_path):  # noqa: F811
    mode, proxy_log = servers
    save, log_dir, logs = save_fs / "chain", tmp_path / "log", tmp_path / "logs"
    logs.mkdir()

    def launch(name: str, urls: list[str], resume: bool) -> TrainerRun:
        args = common_args(warm_start, save, log_dir, urls)
        return TrainerRun(cluster, name, [*args, "--load", save] if resume else args, logs)

    def latest() -> str:
        return (save / "latest").read_text().strip()

    def ended_in_bound(run: TrainerRun, fault: str, at: float, expected: dict[str, str]) -> None:
        """Each host's log gets its expected line within the bound; every torchrun ends, non-zero."""
        for host, pattern in expected.items():
            line, seconds = run.wait_line(host, pattern, at)
            print(f"fault table: {fault} | {host} | {seconds:.1f} s | {line}", flush=True)
            assert seconds <= DETECT_BOUND_S, f"{fault}: {host} said it {seconds:.1f} s after the fault: {line}"

    # 1. mid-step: trainer-1's cable out while rank 0 generates step 2's rollouts and rank 1 waits for them
    run = launch("1-mid-step", DIRECT, resume=False)
    try:
        run.wait_phase("rollouts", after_saves=1)
        cluster.link("trainer-1", "down")
        at = time.monotonic()
        ended_in_bound(run, "mid-step: trainer-1 cable out", at, {
            "trainer-0": r"^watchdog: rank 1 on trainer-1 unheard for \d+ s \(its last phase: experience\); rank 0 "
                         r"on trainer-0 is in phase (rollouts|experience) .*$",
            "trainer-1": r"^watchdog: rank 0 on trainer-0 unheard for \d+ s \(its last phase: (rollouts|experience)\);"
                         r" rank 1 on trainer-1 is in phase experience .*$"})
        assert run.wait_exit("trainer-0") != 0
    finally:
        run.end()
        cluster.link("trainer-1", "up")
    assert latest() == "iter_0000001"

    # 2. mid-sync: rollout-0's cable out while rank 0 syncs step 3's weights (its control calls 2 s late each)
    mode.write_text("delay 2\n")
    run = launch("2-mid-sync", PROXIED, resume=True)
    try:
        run.wait_phase("sync", after_saves=1)
        cluster.link("rollout-0", "down")
        at = time.monotonic()
        server_line = (r"^watchdog: rollout server http://rollout-0:3010[01] \(host rollout-0\) unanswering for \d+ "
                       r"s; rank 0 on trainer-0 is in phase sync .*$")
        ended_in_bound(run, "mid-sync: rollout-0 cable out", at, {"trainer-0": server_line, "trainer-1": server_line})
        assert run.wait_exit("trainer-0") != 0 and run.wait_exit("trainer-1") != 0
    finally:
        run.end()
        cluster.link("rollout-0", "up")
        mode.write_text("pass\n")
    assert latest() == "iter_0000002"

    # 3. mid-save: trainer-1's cable out while step 4's checkpoint is written (held there by the frozen fs)
    run = launch("3-mid-save", DIRECT, resume=True)
    frozen = False
    try:
        run.wait_phase("step", after_saves=1)  # step 3 saved: nothing writes to the file system until step 4's save
        subprocess.run(["fsfreeze", "-f", str(save_fs)], check=True)
        frozen = True
        run.wait_phase("save", after_saves=1)
        time.sleep(2)  # rank 0 waits on the frozen file system inside the save, rank 1 at the save's barrier
        cluster.link("trainer-1", "down")
        at = time.monotonic()
        subprocess.run(["fsfreeze", "-u", str(save_fs)], check=True)
        frozen = False
        ended_in_bound(run, "mid-save: trainer-1 cable out", at, {
            "trainer-0": r"^watchdog: rank 1 on trainer-1 unheard for \d+ s \(its last phase: save\); rank 0 on "
                         r"trainer-0 is in phase save .*$",
            "trainer-1": r"^watchdog: rank 0 on trainer-0 unheard for \d+ s \(its last phase: save\); rank 1 on "
                         r"trainer-1 is in phase save .*$"})
        assert run.wait_exit("trainer-0") != 0
    finally:
        if frozen:
            subprocess.run(["fsfreeze", "-u", str(save_fs)], check=True)
        run.end()
        cluster.link("trainer-1", "up")
    assert latest() == "iter_0000003", "the half-written step-4 checkpoint must not become the latest"

    # 4. frozen: rank 0 stopped in step 5's update
    run = launch("4-frozen-rank-0", DIRECT, resume=True)
    try:
        run.wait_phase("update", after_saves=1)
        rank0 = [pid for pid in cluster.pids("trainer-0") if is_rank_worker(pid)]
        assert len(rank0) == 1, rank0
        os.kill(rank0[0], signal.SIGSTOP)
        at = time.monotonic()
        ended_in_bound(run, "frozen: rank 0 SIGSTOP", at, {
            # rank 1 may have finished its share of the update and wait for rank 0 in the sync's barrier
            "trainer-1": r"^watchdog: rank 0 on trainer-0 unheard for \d+ s \(its last phase: (update|sync)\); rank 1 "
                         r"on trainer-1 is in phase (update|sync) .*$"})
        assert run.wait_exit("trainer-1") != 0
    finally:
        run.end()
    assert latest() == "iter_0000004"

    # 5. malformed: from step 6 on, every /generate answer through the proxy is truncated
    mode.write_text("malformed after 2\n")  # step 5's two batched requests pass
    run = launch("5-malformed", PROXIED, resume=True)
    try:
        at = time.monotonic()
        line, _ = run.wait_line("trainer-0", r"^megatron_dppo: rank 0 on trainer-0 failed in phase rollouts after "
                                             r"\d+ s: RolloutServerError: generate for requests .* failed after 4 "
                                             r"attempts; last errors: http://rollout-0:3010[01].*$", at)
        said = time.monotonic()
        print(f"fault table: malformed bodies | trainer-0 | its phase's seconds | {line}", flush=True)
        assert run.wait_exit("trainer-0") != 0 and run.wait_exit("trainer-1", DETECT_BOUND_S) != 0
        print(f"fault table: malformed bodies | trainer-1 ended | {time.monotonic() - said:.1f} s after rank 0's "
              f"line | {run.text('trainer-1').strip().splitlines()[-1][:300]}", flush=True)
    finally:
        run.end()
    assert latest() == "iter_0000005"

    # 6. slow answers and three spoilt ones: the run trains through them to the end
    mode.write_text("delay 2 faults 500,truncated,layout\n")
    served_before = len(spoilt_answers(proxy_log))
    run = launch("6-slow-and-spoilt", PROXIED, resume=True)
    try:
        codes = {host: run.wait_exit(host) for host in run.processes}
        assert codes == {"trainer-0": 0, "trainer-1": 0}, run.details()
    finally:
        run.end()
        mode.write_text("pass\n")
    assert spoilt_answers(proxy_log)[served_before:] == [
        "fault 500 on /generate", "fault truncated on /generate", "fault layout on /generate"]

    reference_metrics, reference_checkpoint = reference
    metrics = deterministic(read_metrics(log_dir))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics == reference_metrics, "a resumed step differs from the uninterrupted run"
    assert all(m["logprob_gap_train_vs_rollout"] < LOGPROB_GAP_TOL for m in metrics if not m["skipped_update"])
    straight = export_weights(reference_checkpoint, tmp_path / "reference_hf")
    resumed = export_weights(save / f"iter_{STEPS:07d}", tmp_path / "resumed_hf")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), f"{name} differs from the uninterrupted run's"
    for host in ("trainer-0", "trainer-1", "rollout-0"):
        versions = [cluster.get_json(host, f"{url}/model_info")["weight_version"] for url in DIRECT]
        assert versions == [str(STEPS)] * 2, f"from {host}: {versions}"


def spoilt_answers(proxy_log: Path) -> list[str]:
    """The proxy's "fault F on /generate" lines, in order."""
    return [line for line in proxy_log.read_text().splitlines() if re.fullmatch(r"fault \S+ on /\S+", line)]


def is_rank_worker(pid: int) -> bool:
    """A trainer rank (examples/pretrain_dppo.py run by torchrun), not torchrun itself."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_text(errors="replace").split("\0")
    except OSError:
        return False
    return any(word.endswith("pretrain_dppo.py") for word in words) and "torch.distributed.run" not in words


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))

"""Multi-node for real on one machine: three hosts made of namespaces (tests/cluster/cluster.sh), each with its own
host name, address and Debian-style /etc/hosts (its own name on 127.0.1.1).

    warm start (the embedded default's tiny model, one process on trainer-0) ─► HF model dir + model-only checkpoint
    rollout-0: rollout_node.sh, two embedded engines (ROLLOUT_ENGINE=embedded), http://rollout-0:30000 and :30001
    trainer-0 + trainer-1: torchrun --nnodes 2 --nproc-per-node 1, c10d rendezvous on trainer-0, gloo
        ─► 3 DPPO steps, weights synced across hosts, a save at step 3 ─► every process of trainer-1 killed
        ─► trainer-0 ends on its own ─► both resume from the save to step 5 ─► the servers report version 5
    Slurm: slurmctld on trainer-0 and a slurmd per host; examples/slurm/dppo.sbatch as shipped with
        `sbatch --nodes 3`, ROLLOUT_NODES=1: Slurm orders the nodes by name, so the trainer runs on rollout-0 and
        trainer-0 and the engine on trainer-1

What this proves and what it cannot (NCCL, InfiniBand, GPUs): docs/multinode.md. Namespaces need root and iproute2
(cluster.sh installs it with apt-get when missing); where they cannot be made the tests fail with the reason: this is
the launch path users run, so it is never skipped.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_dppo.launch.arguments import EMBEDDED_DEFAULTS, EMBEDDED_TASK_DEFAULTS
from tests.launch import REPO_ROOT
from tests.test_slurm import running_slurm
from tests.test_trainer import ENTRY, SHORT, read_metrics

# a warm start and two trainer launches per test module, each bounded by LAUNCH_TIMEOUT_S
pytestmark = pytest.mark.timeout(3600)

CLUSTER_SCRIPT = REPO_ROOT / "tests" / "cluster" / "cluster.sh"
ROLLOUT_NODE = REPO_ROOT / "examples" / "slurm" / "rollout_node.sh"
WAIT_HEALTHY = REPO_ROOT / "examples" / "slurm" / "wait_healthy.py"
SBATCH = REPO_ROOT / "examples" / "slurm" / "dppo.sbatch"
ROLLOUT_PORT, RDZV_PORT = 30000, 29500  # fixed: each host's network namespace is new and empty
URLS = [f"http://rollout-0:{ROLLOUT_PORT + i}" for i in range(2)]
# Rollouts are the synced policy's: the engines' log-probs equal the trainer's (fp32; both CPU, observed ~1e-6)
LOGPROB_GAP_TOL = 1e-4
LAUNCH_TIMEOUT_S = 900  # a hang guard: one launch took 54-67 s on an idle 2-core machine, over 8 min on a loaded one
# A folder to keep the warm start in across test sessions (the embedded cache is keyed by its configuration): unset,
# each session makes its own
WARM_START_CACHE_VARIABLE = "DPPO_CLUSTER_WARM_START_CACHE"


class Cluster:
    """The hosts of a running tests/cluster/cluster.sh: commands run on a host through `cluster.sh exec`."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.nodes = (directory / "nodes").read_text().split()  # "name=address"

    def command(self, host: str, *command) -> list[str]:
        return ["bash", str(CLUSTER_SCRIPT), "exec", str(self.directory), host, *map(str, command)]

    def start(self, host: str, command: list, log: Path, env: dict | None = None) -> subprocess.Popen:
        """`command` on `host` in the background, its output in `log`."""
        with open(log, "w") as out:
            return subprocess.Popen(self.command(host, *command), stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                    env={**launch_env(), **(env or {})}, start_new_session=True)

    def run(self, host: str, command: list, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """`command` on `host`, to its end; past `timeout`, the command and everything it started (on the host, in
        any session) is killed, then TimeoutExpired is raised."""
        process = subprocess.Popen(self.command(host, *command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, cwd=REPO_ROOT, env={**launch_env(), **(env or {})},
                                   start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            process.communicate()
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    def link(self, host: str, state: str) -> None:
        """Pull `host`'s cable ("down") or plug it back ("up"): see cluster.sh link."""
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "link", str(self.directory), host, state], check=True,
                       timeout=30)

    def pids(self, host: str) -> list[int]:
        """Every process on `host` but the one holding its namespaces."""
        namespace = next(line.split()[0] for line in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.splitlines()
            if line.split()[0].endswith(f"-{host}") and line.startswith(self.tag))
        holder = int((self.directory / f"{host}.pid").read_text())
        listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True)
        return [int(pid) for pid in listed.stdout.split() if int(pid) != holder]

    @property
    def tag(self) -> str:
        return next(line.split("=", 1)[1] for line in (self.directory / "cluster.env").read_text().splitlines()
                    if line.startswith("TAG="))

    def kill(self, host: str) -> None:
        """SIGKILL every process on `host`, as if it crashed."""
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "kill", str(self.directory), host], check=True, timeout=30)

    def get_json(self, host: str, url: str) -> dict:
        """GET `url` from `host` (the address as that host resolves it)."""
        script = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
        result = self.run(host, [sys.executable, "-c", script, url], timeout=60)
        assert result.returncode == 0, f"GET {url} from {host} failed:\n{result.stderr}"
        return json.loads(result.stdout)


def launch_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, theirs, ...), read from /proc, whatever their session."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it. Each is stopped first, so none forks or is reparented (to init,
    out of reach) while the tree is read."""
    stopped: set[int] = set()
    while True:
        fresh = [p for p in [pid, *descendants(pid)] if p not in stopped]
        if not fresh:
            break
        for each in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, signal.SIGSTOP)
            stopped.add(each)
    for each in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def sweep_stale_clusters() -> None:
    """Remove the clusters (and namespaces) of test processes that are gone, so that hosts left by a killed test
    never collide with new ones (cluster.sh sweep)."""
    swept = subprocess.run(["bash", str(CLUSTER_SCRIPT), "sweep"], capture_output=True, text=True, timeout=120)
    assert swept.returncode == 0, swept.stderr


@contextlib.contextmanager
def running_cluster():
    """Three namespace hosts (cluster.sh start), stale clusters swept first, stopped at the end of the block."""
    sweep_stale_clusters()
    directory = Path(tempfile.mkdtemp(prefix="dppo-cluster-"))
    try:
        started = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start", str(directory)], capture_output=True,
                                 text=True, timeout=300, env={**os.environ, "CLUSTER_OWNER_PID": str(os.getpid())})
        if started.returncode != 0:
            pytest.fail(f"could not make the three namespace hosts with {CLUSTER_SCRIPT}:\n{started.stderr}",
                        pytrace=False)
        yield Cluster(directory)
    finally:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop", str(directory)], timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    with running_cluster() as hosts:
        yield hosts


@pytest.fixture(scope="module")
def warm_start(cluster, tmp_path_factory) -> tuple[Path, Path]:
    """(HF model dir, model-only warm-start checkpoint) of the embedded default's tiny model, from one process on
    trainer-0 (its own network: no port another test takes meanwhile): the model the rollout nodes serve (the
    trainer's first sync replaces its weights) and the trainer starts from."""
    cache = Path(os.environ.get(WARM_START_CACHE_VARIABLE) or tmp_path_factory.mktemp("warm_start"))
    result = cluster.run("trainer-0", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", 1,
                                       "--master-addr", "127.0.0.1", "--master-port", RDZV_PORT, ENTRY, *SHORT,
                                       "--train-iters", 0, "--cache-dir", cache, "--log-dir", cache / "log"],
                         timeout=2 * LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, f"the warm start failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    (root,) = [path for path in cache.glob("embedded_*") if (path / "init").is_dir()]
    return root / "init", root / "warm_start"


def trainer_args(warm_start: tuple[Path, Path]) -> list:
    """The warm-started tiny model as a user's model (--hf-checkpoint, --load), with the embedded default's sizes."""
    model, checkpoint = warm_start
    sizes = {**EMBEDDED_DEFAULTS, **EMBEDDED_TASK_DEFAULTS["worked"]}
    return [*SHORT, "--hf-checkpoint", model, "--load", checkpoint, "--max-tokens-per-gpu", sizes["max_tokens_per_gpu"],
            "--rollout-max-response-len", sizes["rollout_max_response_len"],
            "--rollout-timeout-s", 60]  # a fault (a group that cannot form) fails in a minute, not ten


def torchrun_on(cluster: Cluster, host: str, run_id: str, args: list, log: Path) -> subprocess.Popen:
    """docs/multinode.md's trainer step on one trainer host: torchrun --nnodes 2, c10d rendezvous on trainer-0."""
    return cluster.start(host, [sys.executable, "-m", "torch.distributed.run", "--nnodes", 2, "--nproc-per-node", 1,
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"trainer-0:{RDZV_PORT}",
                                "--rdzv-id", run_id, ENTRY, *args], log)


def wait_all(processes: dict[str, subprocess.Popen], logs: dict[str, Path], what: str) -> dict[str, int]:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    for host, process in processes.items():
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{what} on {host} still running after {LAUNCH_TIMEOUT_S} s:\n"
                                 f"{tail(logs[host])}") from None
    return {host: process.returncode for host, process in processes.items()}


def tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


ADDRESS_CHECK = """
import json, socket
from megatron_dppo.platform.network import address_reaching, gloo_interface, host_interfaces, sync_interface
print(json.dumps({"name": socket.gethostbyname(socket.gethostname()),
                  "interfaces": {i.name: [a for a in i.addresses if ":" not in a] for i in host_interfaces()},
                  "to_rollout": address_reaching(["rollout-0"]), "to_trainer_0": address_reaching(["trainer-0"]),
                  "gloo_master_here": gloo_interface("trainer-0", members_elsewhere=True),
                  "gloo_single_host": gloo_interface("127.0.0.1"), "sync_to_rollout": sync_interface("rollout-0")}))
"""


def test_each_host_is_reached_at_the_address_its_routes_leave_from_not_its_names_loopback(cluster):
    """The hosts resolve their own names to 127.0.1.1 (Debian's line), as the faults need; the address another host
    reaches (the weight-sync master's, gloo's interface) is the one the route to it leaves from."""
    addresses = dict(node.split("=") for node in cluster.nodes)
    for host in ("trainer-0", "trainer-1"):
        result = cluster.run(host, [sys.executable, "-c", ADDRESS_CHECK], timeout=60)
        assert result.returncode == 0, result.stderr
        seen = json.loads(result.stdout)
        assert seen["name"] == "127.0.1.1"
        assert seen["interfaces"] == {"lo": ["127.0.0.1"], "eth0": [addresses[host]]}
        assert seen["to_rollout"] == addresses[host]
        assert seen["to_trainer_0"] == ("127.0.0.1" if host == "trainer-0" else addresses[host])
        assert seen["gloo_master_here"] == "eth0" and seen["gloo_single_host"] is None
        assert seen["sync_to_rollout"] == "eth0"


def test_the_cluster_script_fails_with_the_reason_where_namespaces_cannot_be_made():
    """Not root: no namespaces, and the script says so (the tests then fail, never skip)."""
    with tempfile.TemporaryDirectory(prefix="dppo-cluster-") as directory:
        os.chmod(directory, 0o777)  # the unprivileged user's cluster directory
        result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash",
                                 str(CLUSTER_SCRIPT), "start", directory], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "network namespaces need root" in result.stderr, result.stderr


def test_a_timeout_on_a_host_kills_the_command_inside_it_not_only_the_wrapper(cluster, tmp_path):
    """What a timed-out command started on a host, in its session or a new one, is gone with it."""
    marker, started = "dppo-timeout-marker", tmp_path / "started"
    # two sleeps named by the marker (exec -a: sleep itself refuses extra words), one in a session of its own; each
    # writes its pid first, so the test knows both ran before the timeout (a loaded machine may start bash late)
    command = f"setsid bash -c 'echo $$ >> {started}; exec -a {marker} sleep 1000' & " \
              f"echo $$ >> {started}; exec -a {marker} sleep 1000"
    with pytest.raises(subprocess.TimeoutExpired):
        cluster.run("rollout-0", ["bash", "-c", command], timeout=20)
    pids = [int(pid) for pid in started.read_text().split()]
    assert len(pids) == 2, f"both sleeps should have started within the timeout: {pids}"

    def marked() -> list[int]:
        return [pid for pid in cluster.pids("rollout-0") if marker in Path(f"/proc/{pid}/cmdline").read_text(
            errors="replace").replace("\0", " ")]

    deadline = time.monotonic() + 10  # a SIGKILLed process is gone once the kernel runs it
    while marked() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked() == [], f"left running on rollout-0: {marked()}"
    assert all(is_gone(pid) for pid in pids), pids


def is_gone(pid: int) -> bool:
    """`pid` has ended: no such process, or a zombie not yet reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_cluster_whose_owner_is_gone_is_swept_and_a_live_ones_is_kept(cluster, tmp_path):
    owner = subprocess.Popen(["sleep", "1000"])
    stale_dir = tmp_path / "stale"
    try:
        started = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start", str(stale_dir)], capture_output=True,
                                 text=True, timeout=300, env={**os.environ, "CLUSTER_OWNER_PID": str(owner.pid),
                                                              "CLUSTER_HOSTS": "solo", "CLUSTER_SUBNET": "10.244.0"})
        assert started.returncode == 0, started.stderr
        holder = int((stale_dir / "solo.pid").read_text())
        stale_tag = Cluster(stale_dir).tag
    finally:
        owner.kill()
        owner.wait()
    sweep_stale_clusters()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert stale_tag not in namespaces, namespaces
    assert not Path(f"/proc/{holder}").exists() or "Z" in Path(f"/proc/{holder}/stat").read_text().split()[2]
    assert all(f"{cluster.tag}-{host}" in namespaces for host in ("bridge", "trainer-0", "trainer-1", "rollout-0"))


def test_torchrun_across_two_hosts_syncs_to_a_third_survives_a_killed_host_and_resumes_to_equal_versions(
        cluster, warm_start, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    servers = cluster.start("rollout-0", ["bash", ROLLOUT_NODE, warm_start[0], len(URLS), 1, ROLLOUT_PORT, logs,
                                          sys.executable], logs / "rollout-0.log", env={"ROLLOUT_ENGINE": "embedded"})
    try:
        healthy = cluster.run("trainer-0", [sys.executable, WAIT_HEALTHY, "--timeout-s", 120, *URLS], timeout=180)
        assert healthy.returncode == 0, f"{healthy.stderr}\n{tail(logs / 'rollout-0.log')}"
        common = [*trainer_args(warm_start), "--rollout-backend", "external", "--rollout-urls", *URLS,
                  "--train-iters", 5, "--save-interval", 3, "--save", tmp_path / "ckpt", "--log-dir", tmp_path / "run"]
        hosts = ("trainer-0", "trainer-1")
        first_logs = {host: logs / f"{host}.first.log" for host in hosts}
        first = {host: torchrun_on(cluster, host, "first", common, first_logs[host]) for host in hosts}
        latest = tmp_path / "ckpt" / "latest"
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not (latest.is_file() and latest.read_text().strip() >= "iter_0000003"):
            ended = {host: process.poll() for host, process in first.items() if process.poll() is not None}
            assert not ended, (f"trainer ended before its step-3 save: {ended}\n"
                               + "\n".join(f"--- {host}\n{tail(log)}" for host, log in first_logs.items()))
            assert time.monotonic() < deadline, "no step-3 checkpoint within the launch timeout"
            time.sleep(0.05)
        assert latest.read_text().strip() == "iter_0000003", "the first run got past step 3 before the kill"
        cluster.kill("trainer-1")
        # trainer-0 must notice its peer's death and end by itself (no hang in a collective)
        codes = wait_all({"trainer-0": first["trainer-0"]}, first_logs, "the survivor of the killed run")
        assert codes["trainer-0"] != 0, tail(first_logs["trainer-0"])
        first["trainer-1"].wait(timeout=30)

        resume_logs = {host: logs / f"{host}.resume.log" for host in hosts}
        resumed = {host: torchrun_on(cluster, host, "resume", [*common, "--load", tmp_path / "ckpt"],
                                     resume_logs[host]) for host in hosts}
        codes = wait_all(resumed, resume_logs, "the resumed run")
        assert codes == {"trainer-0": 0, "trainer-1": 0}, "\n".join(
            f"--- {host} exited {code}\n{tail(resume_logs[host])}" for host, code in codes.items())

        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["steps"] == 5
        metrics = read_metrics(tmp_path / "run")
        assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
        assert [m["weight_version"] for m in metrics] == [1, 2, 3, 4, 5]
        updated = [m for m in metrics if not m["skipped_update"]]
        assert updated, f"no step had a group with varied rewards: {metrics}"
        for m in updated:  # the engines on rollout-0 generated with the weights trainer rank 0 sent them
            assert m["logprob_gap_train_vs_rollout"] < LOGPROB_GAP_TOL, m
        for host in ("trainer-0", "trainer-1", "rollout-0"):  # each host reads the servers' own version
            versions = [cluster.get_json(host, f"{url}/model_info")["weight_version"] for url in URLS]
            assert versions == ["5", "5"], f"from {host}: {versions}"
    finally:  # whatever is left on the hosts (a hung trainer, the servers)
        for host in ("trainer-0", "trainer-1", "rollout-0"):
            cluster.kill(host)
        servers.wait(timeout=30)


@pytest.fixture(scope="module")
def slurm(cluster):
    """A real Slurm on the three hosts: munged here, slurmctld on the first host, `slurmd -N <host>` on each."""
    env = {**os.environ, "NODES": " ".join(cluster.nodes), "CPUS": "2",
           "ON_NODE": f"bash {CLUSTER_SCRIPT} exec {cluster.directory}"}
    with running_slurm(env, "a three-node Slurm") as directory:
        yield directory / "slurm.conf"


def test_dppo_sbatch_as_shipped_trains_on_two_slurm_nodes_with_servers_on_the_third(cluster, slurm, warm_start,
                                                                                    tmp_path):
    log_root = tmp_path / "logs"
    log_root.mkdir()
    env = {"SLURM_CONF": str(slurm), "PYTHON": sys.executable, "DPPO_REPO": str(REPO_ROOT), "LOG_DIR": str(log_root),
           "ROLLOUT_NODES": "1", "GPUS_PER_NODE": "1", "ROLLOUT_ENGINE": "embedded",
           "HF_CHECKPOINT": str(warm_start[0]), "SERVER_TIMEOUT_S": "120", "RDZV_PORT": str(RDZV_PORT)}
    submitted = cluster.run("trainer-0", [
        "sbatch", "--parsable", "--wait", "--nodes", 3, f"--output={log_root}/job-%j.out", f"--chdir={REPO_ROOT}",
        SBATCH, *trainer_args(warm_start), "--train-iters", 3, "--log-dir", tmp_path / "run"],
        timeout=2 * LAUNCH_TIMEOUT_S, env=env)
    job_id = submitted.stdout.strip().split(";")[0] or "?"
    job_out = log_root / f"job-{job_id}.out"
    logs = log_root / f"slurm-{job_id}"
    detail = "\n".join(f"--- {log.name}\n{tail(log, 30)}" for log in sorted(logs.glob("*.*")) if log.is_file())
    assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}\n{tail(job_out)}\n{detail}"
    stdout = job_out.read_text()
    # Slurm lists an allocation's nodes sorted by name: the first two train, the last serves
    assert "launch plan (dry run: nothing started): 3 nodes, 2 trainer, 1 rollout" in stdout, stdout
    assert "dppo.sbatch: starting 1 embedded servers on trainer-1" in stdout, stdout
    assert "dppo.sbatch: trainer on rollout-0,trainer-0, rendezvous rollout-0:" in stdout, stdout
    summary_line = next(line for line in stdout.splitlines() if line.startswith("dppo.sbatch: summary "))
    summary = json.loads(summary_line.removeprefix("dppo.sbatch: summary "))
    assert summary["steps"] == 3, summary
    metrics = read_metrics(tmp_path / "run")
    assert [m["weight_version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        if not m["skipped_update"]:
            assert m["logprob_gap_train_vs_rollout"] < LOGPROB_GAP_TOL, m
    assert {path.name for path in logs.glob("trainer-*.log")} == {"trainer-0.log", "trainer-1.log"}
    assert (logs / f"embedded-trainer-1-{ROLLOUT_PORT}.log").exists()

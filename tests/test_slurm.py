"""examples/slurm/dppo.sbatch under a real one-node Slurm (Debian's slurm-wlm + munge, daemons started here).

tests/slurm/local_slurm.sh installs the packages when they are missing (as root, with apt-get), writes a
localhost slurm.conf, starts munged, slurmctld and slurmd, and stops them at the end. If they cannot be installed
or started the tests fail: this is the launch path users run, so it is never skipped.

The tests at the end need no daemons: stand-in srun / sbatch / scontrol record what pipeline.sh and dppo.sbatch ask
of Slurm (containers, GPUs, the trainer's command) on allocations a one-node cluster cannot have.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_dppo.platform.network import free_port

REPO = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO / "tests" / "slurm" / "local_slurm.sh"
MUNGE_KEY = Path("/etc/munge/munge.key")
SBATCH = REPO / "examples" / "slurm" / "dppo.sbatch"


@contextlib.contextmanager
def running_slurm(env: dict, what: str):
    """The cluster local_slurm.sh starts with `env` (its settings: NODES, ON_NODE, CPUS, ports), running in the
    block, which gets its directory; the daemons stop afterwards, also on failure. A cluster that cannot start fails
    the test with local_slurm.sh's reason (`what`: the cluster, for that message). A munge key the start created is
    gone after the stop; one that was there before is kept."""
    directory = Path(tempfile.mkdtemp(prefix="dppo-slurm-"))  # short: Slurm keeps sockets under it
    key_before = MUNGE_KEY.exists()
    try:
        started = subprocess.run(["bash", str(LOCAL_SLURM), "start", str(directory)], env=env, capture_output=True,
                                 text=True, timeout=600)
        if started.returncode != 0:
            pytest.fail(f"could not start {what} (slurm-wlm + munge) with {LOCAL_SLURM}:\n"
                        f"{started.stdout}\n{started.stderr}", pytrace=False)
        yield directory
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop", str(directory)], env=env, timeout=60)
        shutil.rmtree(directory, ignore_errors=True)
    assert MUNGE_KEY.exists() == key_before, f"{MUNGE_KEY} {'left behind' if not key_before else 'removed'}"


@pytest.fixture(scope="module")
def slurm():
    """(directory, environment for sbatch) of a running one-node cluster; the daemons stop afterwards."""
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port()), "CPUS": "2"}
    with running_slurm(env, "a local Slurm") as directory:
        yield directory, {**env, "SLURM_CONF": str(directory / "slurm.conf")}


def sbatch(slurm_env: dict, log_root: Path, trainer_args: list[str], timeout_s: float) -> tuple[str, Path, str]:
    """Submit dppo.sbatch with --wait; return (job id, the job's log directory, the job's stdout)."""
    env = {**slurm_env, "PYTHON": sys.executable, "DPPO_REPO": str(REPO), "LOG_DIR": str(log_root),
           "RDZV_PORT": str(free_port()), "GPUS_PER_NODE": "2"}
    log_root.mkdir(parents=True, exist_ok=True)
    output = log_root / "job-%j.out"
    result = subprocess.run(["sbatch", "--parsable", "--wait", "--nodes", "1", f"--output={output}",
                             f"--chdir={REPO}", str(SBATCH), *trainer_args],
                            env=env, capture_output=True, text=True, timeout=timeout_s)
    job_id = result.stdout.strip().split(";")[0].splitlines()[0] if result.stdout.strip() else "?"
    job_out = log_root / f"job-{job_id}.out"
    stdout = job_out.read_text() if job_out.exists() else ""
    assert result.returncode == 0, f"sbatch failed ({result.returncode}): {result.stderr}\n{stdout}"
    return job_id, log_root / f"slurm-{job_id}", stdout


def test_sbatch_runs_the_embedded_default_to_completion_under_real_slurm(slurm, tmp_path):
    _, slurm_env = slurm
    run_dir = tmp_path / "run"
    job_id, logs, stdout = sbatch(slurm_env, tmp_path / "logs", [
        "--warm-start-steps", "20", "--train-iters", "3", "--eval-size", "20", "--cache-dir", str(tmp_path / "cache"),
        "--log-dir", str(run_dir)], timeout_s=400)
    assert "launch plan (dry run: nothing started): 1 nodes, 1 trainer, 0 rollout" in stdout
    assert (logs / "plan.txt").read_text().startswith("launch plan")
    trainer_log = (logs / "trainer-0.log").read_text().strip().splitlines()
    summary = json.loads(trainer_log[-1])
    assert summary["steps"] == 3
    assert 0.0 <= summary["heldout_accuracy_before"] <= 1.0 and 0.0 <= summary["heldout_accuracy_after"] <= 1.0
    assert f"dppo.sbatch: summary {trainer_log[-1]}" in stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_sbatch_dry_run_prints_the_plan_and_starts_no_trainer(slurm, tmp_path):
    _, slurm_env = slurm
    _, logs, stdout = sbatch(slurm_env, tmp_path / "logs", ["--dry-run", "--log-dir", str(tmp_path / "run")],
                             timeout_s=120)
    assert "parallel layout: world 2 = TP 1 x PP 1 x DP 2" in stdout
    assert (logs / "plan.txt").exists()
    assert not (logs / "trainer-0.log").exists() and not (tmp_path / "run").exists()
    assert "dppo.sbatch: trainer on" not in stdout


# -------------------------------------------------------------------------------- stand-in Slurm commands (no daemons)
PIPELINE = REPO / "examples" / "slurm" / "pipeline.sh"


def stand_in_slurm(tmp_path: Path, nodes: list[str]) -> tuple[dict, Path]:
    """A PATH directory whose srun, sbatch and scontrol record each call (command, arguments, SRUN_ARGS) as one JSON
    line and start nothing; `scontrol show hostnames` prints `nodes` (in Slurm's order). A trainer step's srun also
    writes per-node trainer logs as torchrun's c10d rendezvous would lay them out when rank 0 is not on the first node:
    see test_sbatch_reports_rank_0s_summary_from_whichever_node_holds_it. Returns (environment, record file)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "slurm-calls.jsonl"
    bin_dir.mkdir()
    recorder = (f"import json, os, re, sys\nfrom pathlib import Path\n"
                f"name = os.environ['STAND_IN_NAME']\n"
                f"with open({str(record)!r}, 'a') as out:\n"
                f"    out.write(json.dumps({{'command': name, 'args': sys.argv[1:],\n"
                f"                          'SRUN_ARGS': os.environ.get('SRUN_ARGS')}}) + '\\n')\n"
                f"if name == 'scontrol':\n"
                f"    print('\\n'.join({nodes!r}))\n"
                f"for arg in sys.argv[1:]:\n"
                f"    found = re.fullmatch(r'--output=(.*/trainer-)%n\\.log', arg)\n"
                f"    if found:  # node 0 of the step logs a rank's progress; node 1 holds rank 0 and its summary\n"
                f"        Path(found.group(1) + '0.log').write_text('rank 2: done\\n')\n"
                f"        Path(found.group(1) + '1.log').write_text('rank 0: done\\n{{\"steps\": 3}}\\n')\n")
    for name in ("srun", "sbatch", "scontrol"):
        # the stand-in's Python in stand_in_code(tmp_path, name), started with SIGTERM ignored (an ignored signal stays
        # ignored across exec): dppo.sbatch's clean-up kills the background rollout step when the trainer step ends,
        # which on a busy machine came before the stand-in had recorded its call
        stand_in_code(tmp_path, name).write_text(recorder)
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\ntrap '' TERM\nSTAND_IN_NAME={name} exec "
                                    f"{sys.executable} {stand_in_code(tmp_path, name)} \"$@\"\n")
        (bin_dir / name).chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SRUN_"))
           and key not in ("TRAINER_NODES", "ROLLOUT_NODES", "GPUS_PER_NODE", "SGLANG_TP", "STAGES", "EVAL_ARGS")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env, record


def stand_in_code(tmp_path: Path, name: str) -> Path:
    """The Python that stand-in `name` (srun, sbatch, scontrol) runs: a test may append to it."""
    return tmp_path / f"stand_in_{name}.py"


def recorded(record: Path, command: str) -> list[dict]:
    return [call for call in map(json.loads, record.read_text().splitlines()) if call["command"] == command]


def srun_options(args: list[str]) -> list[str]:
    """srun's own options: those before the command it runs (everything after that is the command's)."""
    options = []
    for arg in args:
        if not arg.startswith("-"):
            break
        options.append(arg)
    return options


def test_every_pipeline_srun_runs_in_the_srun_args_container_and_evaluation_gets_the_gpus(tmp_path):
    """pipeline.sh's data, convert, export and evaluate steps take SRUN_ARGS (e.g. pyxis' container) as dppo.sbatch's
    steps do, and the evaluate step asks for the GPUS_PER_NODE GPUs evaluate_node.sh starts one server on each."""
    env, record = stand_in_slurm(tmp_path, ["node1"])
    work = tmp_path / "work"
    (work / "eval").mkdir(parents=True)
    (work / "eval" / "results.md").write_text("| benchmark | pass@1 |\n")
    container = ["--container-image=/images/megatron-dppo.sqsh", "--container-mounts=/data:/data,/scratch:/scratch"]
    env.update(HF_CHECKPOINT="/data/Qwen3-4B", WORK_DIR=str(work), GPUS_PER_NODE="4", SRUN_ARGS=" ".join(container))
    result = subprocess.run(["bash", str(PIPELINE), "--train-iters", "3"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    steps = {next(arg.split("=", 1)[1] for arg in call["args"] if arg.startswith("--job-name=")): call["args"]
             for call in recorded(record, "srun")}
    assert set(steps) == {"dppo-data", "dppo-convert", "dppo-export", "dppo-eval"}, steps
    faults = [f"{name}: srun {srun_options(args)} runs outside SRUN_ARGS' container"
              for name, args in steps.items() if not all(flag in srun_options(args) for flag in container)]
    evaluate = srun_options(steps["dppo-eval"])
    if "--gpus-per-node=4" not in evaluate and "--gpus=4" not in evaluate:
        faults.append(f"dppo-eval starts 4 SGLang servers (one per GPU) but asks srun for no 4 GPUs: {evaluate}")
    assert not faults, "\n".join(faults)
    (train,) = recorded(record, "sbatch")
    assert train["SRUN_ARGS"] == " ".join(container), "dppo.sbatch's own steps read SRUN_ARGS from the environment"
    assert "--gpus-per-node=4" in train["args"]


def sbatch_with_stand_ins(tmp_path: Path, nodes: list[str], trainer_nodes: int, rollout_nodes: int):
    """Run dppo.sbatch as the batch script of an allocation of `nodes` (stand-in srun: nothing starts; the servers are
    taken as healthy). Returns (the script's result, the record file)."""
    env, record = stand_in_slurm(tmp_path, nodes)
    python = tmp_path / "bin" / "python-stand-in"  # the trainer's interpreter, except that the servers are "healthy"
    python.write_text(f'#!/usr/bin/env bash\ncase "${{1:-}}" in */wait_healthy.py) exit 0 ;; esac\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"{nodes[0]},{nodes[-1]}", DPPO_REPO=str(REPO),
               PYTHON=str(python), LOG_DIR=str(tmp_path / "logs"), TRAINER_NODES=str(trainer_nodes),
               ROLLOUT_NODES=str(rollout_nodes), GPUS_PER_NODE="2", HF_CHECKPOINT="/data/Qwen3-4B",
               RDZV_PORT="29500")
    result = subprocess.run(["bash", str(SBATCH), "--hf-checkpoint", "/data/Qwen3-4B"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result, record


def test_sbatch_leaves_the_weight_sync_address_to_trainer_rank_0_itself(tmp_path):
    """torchrun's c10d rendezvous numbers the nodes by sorted host name (node10 before node9), not by the
    allocation's order, so trainer rank 0 (which hosts the weight-sync group's TCPStore) need not be the first node:
    the servers must get rank 0's own address (run.py's default for external servers), not the first node's."""
    nodes = ["node9", "node10", "node11"]  # Slurm's order; torchrun's c10d gives node10 rank 0
    _, record = sbatch_with_stand_ins(tmp_path, nodes, trainer_nodes=2, rollout_nodes=1)
    # the rollout step runs in the background: the two stand-ins may record in either order (the plan step apart)
    steps = {next(arg for arg in call["args"] if arg.startswith("--nodelist=")): call
             for call in recorded(record, "srun") if "--dry-run" not in call["args"]}
    assert set(steps) == {"--nodelist=node11", "--nodelist=node9,node10"}, steps
    trainer = steps["--nodelist=node9,node10"]
    assert "--rdzv-backend=c10d" in trainer["args"] and "--rdzv-endpoint=node9:29500" in trainer["args"]
    command = trainer["args"][trainer["args"].index(str(REPO / "examples" / "pretrain_dppo.py")):]
    assert "--rollout-urls" in command and "http://node11:30000" in command
    assert "--weight-sync-master-address" not in command, (
        f"the trainer pins the weight-sync group's address to the first node by list order: {command}")


def test_sbatch_reports_rank_0s_summary_from_whichever_node_holds_it(tmp_path):
    """The summary line is rank 0's, which with c10d may be on trainer node 1 (stand-in srun's logs)."""
    result, _ = sbatch_with_stand_ins(tmp_path, ["node9", "node10", "node11"], trainer_nodes=2, rollout_nodes=1)
    assert 'dppo.sbatch: summary {"steps": 3}' in result.stdout, result.stdout

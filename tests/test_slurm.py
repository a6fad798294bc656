"""examples/slurm/dppo.sbatch under a real one-node Slurm (Debian's slurm-wlm + munge, daemons started here).

tests/slurm/local_slurm.sh installs the packages when they are missing (as root, with apt-get), writes a
localhost slurm.conf, starts munged, slurmctld and slurmd, and stops them at the end. If they cannot be installed
or started the tests fail: this is the launch path users run, so it is never skipped.
"""

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
SBATCH = REPO / "examples" / "slurm" / "dppo.sbatch"


@pytest.fixture(scope="module")
def slurm():
    """(directory, environment for sbatch) of a running one-node cluster; the daemons stop afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="dppo-slurm-"))  # short: Slurm keeps sockets under it
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port()), "CPUS": "2"}
    try:
        started = subprocess.run(["bash", str(LOCAL_SLURM), "start", str(directory)], env=env, capture_output=True,
                                 text=True, timeout=600)
        if started.returncode != 0:
            pytest.fail(f"could not start a local Slurm (slurm-wlm + munge) with {LOCAL_SLURM}:\n"
                        f"{started.stdout}\n{started.stderr}", pytrace=False)
        yield directory, {**env, "SLURM_CONF": str(directory / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop", str(directory)], env=env, timeout=60)
        shutil.rmtree(directory, ignore_errors=True)


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

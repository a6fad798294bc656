"""tools/gpu_check.sh, the GPU path's prepared check, kept runnable between GPU sessions.

Without a GPU the script says so in one line and exits non-zero (no traceback). Its checks themselves run on the
CPU at tiny sizes (`--rehearse-on-cpu`): the bf16 DPPO run with weight sync, save and a resume by a second launch, the
fused log-probs against the full path, the actor's step with its FLOP count, so that a GPU session finds a script
that ran on the last commit. The figures of a rehearsal are not measurements.
"""

import subprocess
import sys

from tests.launch import REPO_ROOT


def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_nonzero():
    finished = subprocess.run(["bash", str(REPO_ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True,
                              timeout=120, cwd=REPO_ROOT, env={"PATH": f"{sys.prefix}/bin:/usr/bin:/bin"})
    assert finished.returncode != 0
    lines = (finished.stdout + finished.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU is visible"), lines
    assert "Traceback" not in finished.stderr


def test_every_check_of_the_gpu_check_passes_in_a_rehearsal_on_the_cpu():
    finished = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_check.py"), "--rehearse-on-cpu"],
                              capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    lines = [line for line in finished.stdout.splitlines() if line.startswith("gpu_check ")]
    assert finished.returncode == 0, f"{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}"
    assert [line.split(":")[0] for line in lines] == [
        "gpu_check environment", "gpu_check rl_run", "gpu_check fused_logprobs", "gpu_check actor_step",
        "gpu_check tests_gpu"], lines
    assert all(": ok " in line for line in lines[:4]), lines
    assert "steps 1-3 saved at 3, a second launch resumed to 5" in lines[1]

"""tools/gpu_check.sh, the GPU path's prepared check, kept runnable between GPU sessions.

Without a GPU the script says so in one line and exits non-zero (no traceback). Its one-GPU parts run on the CPU at
tiny sizes (`--rehearse-on-cpu`): the bf16 DPPO run with the distributed optimizer, a save before any optimizer step,
weight sync, a stop and a resume by a second launch compared with an uninterrupted run; the fused log-probs and their
gradients against the full path; the actor's step; the decoder's step for 1 and 64 rows; bench/step_cost.py's
headline pair; so that a GPU session finds a script that ran on the last commit. The parts that need two GPUs, TE
or SGLang are reported SKIPPED with what they need, and fail the check when --require names that need. The state
comparison that decides the resume is shown to catch a resume that dropped Adam's moments. The figures of a
rehearsal are not measurements.
"""

import importlib.util
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT

GPU_CHECK = REPO_ROOT / "tools" / "gpu_check.py"


def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_nonzero():
    finished = subprocess.run(["bash", str(REPO_ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True,
                              timeout=120, cwd=REPO_ROOT, env={"PATH": f"{sys.prefix}/bin:/usr/bin:/bin"})
    assert finished.returncode != 0
    lines = (finished.stdout + finished.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU is visible"), lines
    assert "Traceback" not in finished.stderr


def rehearse(*flags: str, timeout: float) -> tuple[subprocess.CompletedProcess, list[str]]:
    finished = subprocess.run([sys.executable, str(GPU_CHECK), "--rehearse-on-cpu", *flags], capture_output=True,
                              text=True, timeout=timeout, cwd=REPO_ROOT)
    return finished, [line for line in finished.stdout.splitlines() if line.startswith("gpu_check ")]


@pytest.mark.timeout(1200)  # four training launches and bench/step_cost.py's two runs, on 2 shared cores
def test_every_part_the_cpu_can_run_passes_in_a_rehearsal_and_the_others_are_skipped_naming_their_needs():
    finished, lines = rehearse(timeout=1100)
    assert finished.returncode == 0, f"{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}"
    assert [line.split(":")[0] for line in lines] == [f"gpu_check {name}" for name in (
        "environment", "rl_run", "fused_logprobs", "actor_step", "decode_cost", "step_cost", "nccl_sync",
        "tests_gpu")], lines
    assert all(": ok " in line for line in lines[:6]), lines
    assert "saved before any optimizer step" in lines[1] and "a second launch resumed to 5" in lines[1]
    assert "restores the uninterrupted run's weights, main parameters, Adam moments and step counts" in lines[1]
    assert "gradient of h and W" in lines[2] and "partial_rollout_step_speedup" in lines[5]
    assert lines[6] == "gpu_check nccl_sync: SKIPPED, needs a second GPU and SGLang"
    assert lines[7] == "gpu_check tests_gpu: SKIPPED, needs Transformer Engine and SGLang"
    assert finished.stdout.strip().splitlines()[-1].startswith("gpu_check: 6 ok, 0 FAIL [], 2 SKIPPED")


def test_a_part_skipped_for_a_required_need_fails_the_check():
    finished, lines = rehearse("--checks", "environment,tests_gpu", "--require", "sglang", timeout=300)
    assert finished.returncode == 1, finished.stdout
    assert lines[1] == "gpu_check tests_gpu: SKIPPED, needs Transformer Engine and SGLang (required)"
    assert finished.stdout.strip().splitlines()[-1].endswith("exit status 1")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_resume_comparison_catches_dropped_adam_moments_and_step_counts_and_passes_rounding(gpu_check):
    import torch

    generator = torch.Generator().manual_seed(0)
    state = {"model.weight": torch.randn(8, 4, generator=generator),
             "optimizer0.group0.param0.main_param": torch.randn(8, 4, generator=generator),
             "optimizer0.group0.param0.exp_avg": torch.randn(8, 4, generator=generator) * 1e-3,
             "optimizer0.group0.param0.exp_avg_sq": torch.rand(8, 4, generator=generator) * 1e-6,
             "optimizer0.group0.param0.step": torch.tensor(5.0)}
    rounded = {name: tensor * (1 + 1e-3) if not name.endswith("step") else tensor for name, tensor in state.items()}
    assert gpu_check.state_differences(state, rounded, gpu_check.RESUME_STATE_TOL)[0] == []
    dropped = {**state, "optimizer0.group0.param0.exp_avg": state["optimizer0.group0.param0.exp_avg"] * 0.1,
               "optimizer0.group0.param0.step": torch.tensor(2.0)}
    problems, largest = gpu_check.state_differences(state, dropped, gpu_check.RESUME_STATE_TOL)
    assert len(problems) == 2 and largest == pytest.approx(0.9), problems
    assert any("exp_avg differs" in problem for problem in problems)
    assert any("step [2.0] != [5.0]" in problem for problem in problems)
    assert gpu_check.state_differences(state, {**state, "model.extra": torch.ones(1)}, 0.05)[0] == [
        "model.extra missing"]


def test_the_checks_launch_timeouts_are_the_gpu_tests_own(gpu_check):
    from tests.gpu.limits import LAUNCH_TIMEOUT_S, TEST_TIMEOUT_S

    # the check kills a launch only after the tests' own limit would have (its handler prints the run's log)
    assert gpu_check.SMOKE_LAUNCH_TIMEOUT_S == LAUNCH_TIMEOUT_S and gpu_check.TESTS_GPU_TIMEOUT_S > TEST_TIMEOUT_S

"""tools/gpu_check.sh, the GPU path's prepared check, kept runnable between GPU sessions.

Without a GPU the script says so in one line and exits non-zero (no traceback). Its one-GPU parts run on the CPU at
tiny sizes (`--rehearse-on-cpu`): the bf16 DPPO run with the distributed optimizer, a save before any optimizer step,
weight sync, a stop and a resume by a second launch compared with an uninterrupted run; the fused log-probs and their
gradients against the full path; the actor's step; the decoder's step for 1 and 64 rows; bench/step_cost.py's
headline pair; so that a GPU session finds a script that ran on the last commit. The parts that need two GPUs, TE
or SGLang are reported SKIPPED with what they need, and fail the check when --require names that need. The figures
of a rehearsal are not measurements.

Each check can fail, shown on broken input: decode_cost on a planted decoder that runs the rows one at a time (the
whole script, --plant-regression, taken by rehearsals only); step_cost's bound on bench output whose speedup is
below it or missing; actor_step's on a peak above the memory plan without its reserve or far below it; the resume
comparison on a resume that dropped Adam's moments or lost a step count, torch Adam's per parameter or FusedAdam's
per group, and Actor.restorable_state reading both layouts from a real actor (tests/workers/optimizer_state_checks.py
--step-count-layouts).
"""

import importlib.util
import os
import subprocess
import sys
import uuid

import pytest

from tests.launch import REPO_ROOT, kill_group, kill_marked, run_torchrun
from tests.workers.optimizer_state_checks import restored_state_differences

GPU_CHECK = REPO_ROOT / "tools" / "gpu_check.py"


def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_nonzero():
    finished = subprocess.run(["bash", str(REPO_ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True,
                              timeout=120, cwd=REPO_ROOT, env={"PATH": f"{sys.prefix}/bin:/usr/bin:/bin"})
    assert finished.returncode != 0
    lines = (finished.stdout + finished.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU is visible"), lines
    assert "Traceback" not in finished.stderr


def rehearse(*flags: str, timeout: float) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run a rehearsal; at its end or timeout, kill every process it started (torchrun's workers and the benchmark's
    runs live in sessions of their own: they carry a marker in their environment)."""
    marker = ("GPU_CHECK_REHEARSAL", uuid.uuid4().hex)
    process = subprocess.Popen([sys.executable, str(GPU_CHECK), "--rehearse-on-cpu", *flags], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, start_new_session=True,
                               env={**os.environ, marker[0]: marker[1]})
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        kill_group(process)
        kill_marked("=".join(marker))
    finished = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return finished, [line for line in stdout.splitlines() if line.startswith("gpu_check ")]


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
    assert "gradient of h and W" in lines[2] and "memory not compared" in lines[3]
    assert "(<= 20x, the CPU rehearsal's bound" in lines[4] and "PLANTED" not in lines[4]
    assert "partial_rollout_step_speedup" in lines[5] and "(> 0.5, the CPU rehearsal's bound" in lines[5]
    assert lines[6] == "gpu_check nccl_sync: SKIPPED, needs a second GPU and SGLang"
    assert lines[7] == "gpu_check tests_gpu: SKIPPED, needs Transformer Engine and SGLang"
    assert finished.stdout.strip().splitlines()[-1].startswith("gpu_check: 6 ok, 0 FAIL [], 2 SKIPPED")


@pytest.mark.timeout(600)
def test_decode_cost_fails_on_a_planted_decoder_that_runs_the_rows_one_at_a_time():
    finished, lines = rehearse("--checks", "decode_cost", "--plant-regression", "decode_per_row", timeout=550)
    assert finished.returncode == 1, finished.stdout[-3000:]
    assert lines[0].startswith("gpu_check decode_cost: FAIL a decode step for 64 rows costs "), lines
    assert "(bound 20x)" in lines[0] and "PLANTED one row at a time" in lines[0]


def test_a_planted_regression_is_refused_outside_a_rehearsal():
    finished = subprocess.run([sys.executable, str(GPU_CHECK), "--plant-regression", "decode_per_row"],
                              capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1].endswith("it is taken with --rehearse-on-cpu only")


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


def test_the_resume_comparisons_catch_a_lost_step_count_per_parameter_or_per_group(gpu_check):
    import torch

    state = {"model.weight": torch.ones(4), "optimizer0.group0.param0.exp_avg": torch.full((4,), 1e-3),
             "optimizer0.group0.param0.step": torch.tensor(5.0),  # torch Adam's count
             "optimizer0.group1.param0.exp_avg": torch.full((4,), 1e-3),
             "optimizer0.group1.step": torch.tensor(5.0, dtype=torch.float64)}  # FusedAdam's (TE, Apex)
    assert gpu_check.state_differences(state, dict(state), gpu_check.RESUME_STATE_TOL)[0] == []
    assert restored_state_differences(state, dict(state)) == []
    for name in ("optimizer0.group0.param0.step", "optimizer0.group1.step"):
        dropped = {key: value for key, value in state.items() if key != name}
        reset = {**state, name: torch.zeros_like(state[name])}
        assert gpu_check.state_differences(state, dropped, gpu_check.RESUME_STATE_TOL)[0] == [f"{name} missing"]
        assert gpu_check.state_differences(state, reset, gpu_check.RESUME_STATE_TOL)[0] == [f"{name} [0.0] != [5.0]"]
        assert restored_state_differences(state, dropped) == [f"{name} missing from the second"]
        assert restored_state_differences(state, reset) == [f"{name} differs"]
    no_counts = {key: value for key, value in state.items() if not key.endswith(".step")}
    assert gpu_check.state_differences(no_counts, no_counts, 0.05)[0] == [
        "no Adam step count above 0 is restored (per parameter or per group)"]
    assert restored_state_differences(no_counts, no_counts) == [
        "no Adam step count was restored (torch Adam's per parameter or FusedAdam's per group)"]


@pytest.mark.timeout(420)
def test_the_restored_state_holds_the_step_counts_where_torch_adam_and_fused_adam_keep_them():
    worker = REPO_ROOT / "tests" / "workers" / "optimizer_state_checks.py"
    output = run_torchrun(worker, 1, ["--step-count-layouts"], timeout=360)
    assert "CHECK step_count_layouts ok" in output, output[-4000:]


def test_decode_cost_bound_passes_a_flat_cost_and_fails_one_that_grows_with_the_rows(gpu_check):
    flat = {1: [0.010, 0.011, 0.012], 64: [0.013, 0.014, 0.013]}  # the 64 rows' logits copy adds a little
    assert gpu_check.decode_cost_problems(flat, gpu_check.DECODE_COST_BOUND["cuda"]) == ([], pytest.approx(13 / 11))
    per_row = {1: [0.010, 0.011, 0.012], 64: [0.64, 0.70, 0.66]}
    problems, ratio = gpu_check.decode_cost_problems(per_row, gpu_check.DECODE_COST_BOUND["cuda"])
    assert ratio == pytest.approx(60) and problems == [
        "a decode step for 64 rows costs 60.00x the step for 1 row (bound 2x)"]
    assert gpu_check.DECODE_COST_BOUND["cpu"] < 64 / 2  # the rehearsal's bound still catches one row at a time


def test_step_cost_bound_fails_a_speedup_at_or_below_it_and_a_missing_one(gpu_check):
    bound = gpu_check.PARTIAL_SPEEDUP_BOUND["cuda"]
    table = "| synchronous | 40 | 2.000 |\n| partial, chunks of 64 | 60 | 3.000 |\n"
    assert gpu_check.partial_speedup_problems(table + "partial_rollout_step_speedup: 1.500\n", bound) == ([], 1.5)
    for value in ("1.100", "0.960", "nan"):
        problems, _ = gpu_check.partial_speedup_problems(table + f"partial_rollout_step_speedup: {value}\n", bound)
        assert problems == [f"partial rollouts give {float(value):.3f}x the synchronous steps per second (must exceed "
                            "1.1x)"], problems
    assert gpu_check.partial_speedup_problems(table, bound)[0] == [
        "bench/step_cost.py printed no partial_rollout_step_speedup line"]


def test_actor_step_fails_a_peak_above_the_plan_without_its_reserve_or_far_below_it(gpu_check):
    from types import SimpleNamespace

    from megatron_dppo.convert.mapping import model_shape
    from megatron_dppo.launch.memory_plan import GIB, TrainerLayout, plan_memory

    config, *_ = gpu_check.qwen3_shape(SimpleNamespace(rehearse_on_cpu=False))
    (plan,) = plan_memory(TrainerLayout(model_shape(config.to_dict()), dtype="bf16", tokens=8192))
    assert plan.total > plan.estimate * 1.1  # the reserve the comparison leaves out
    assert gpu_check.memory_plan_problems(plan.estimate * 0.98, plan) == []
    above = gpu_check.memory_plan_problems(plan.estimate * 1.01, plan)
    assert above == [f"allocator peak {plan.estimate * 1.01 / GIB:.2f} GiB above the memory plan's "
                     f"{plan.estimate / GIB:.2f} GiB without its reserve (the plan underestimates by 1.0%)"]
    assert plan.estimate * 1.01 < plan.total  # the comparison with the total, reserve included, let this peak pass
    twice = gpu_check.memory_plan_problems(plan.estimate / 2, plan)
    assert twice == [f"the memory plan's {plan.estimate / GIB:.2f} GiB without its reserve is 2.00x the allocator "
                     f"peak {plan.estimate / 2 / GIB:.2f} GiB (at most 1.25x)"]


def test_the_checks_launch_timeouts_are_the_gpu_tests_own(gpu_check):
    from tests.gpu.limits import LAUNCH_TIMEOUT_S, TEST_TIMEOUT_S

    # the check kills a launch only after the tests' own limit would have (its handler prints the run's log)
    assert gpu_check.SMOKE_LAUNCH_TIMEOUT_S == LAUNCH_TIMEOUT_S and gpu_check.TESTS_GPU_TIMEOUT_S > TEST_TIMEOUT_S

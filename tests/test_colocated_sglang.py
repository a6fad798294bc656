"""launch/colocated_sglang.py: the share of a trainer GPU a colocated SGLang server takes (--rollout-colocate), in
the memory plan, and the --mem-fraction-static the trainer passes it.

- the Qwen3-4B recipe (examples/configs/qwen3_4b_math_dppo.sh) with --rollout-colocate, through pipeline.sh and
  dppo.sbatch to its --dry-run (stand-in Slurm, one 8-GPU node): the plan prints the server's share and the fraction,
  each server's command carries that fraction and SGLang's own parser reads it as such;
- fit: at the fraction passed, the trainer's peak, the server's static share, runtime and context fit the GPU on
  every stage, and its KV cache holds a response; 0.01 more, or SGLang's own default, would not fit;
- refuse: a layout that leaves the server too little, and a given --sglang-mem-fraction-static outside what fits,
  each in one line naming the flags; the changes the line offers do fit;
- a start on a GPU derives the same fraction, and a start on the CPU plans none.
"""

import re
import shlex
import subprocess
from dataclasses import replace

import pytest

from megatron_dppo.convert.mapping import model_shape
from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.launch.colocated_sglang import (
    ColocatedServer,
    colocated_error,
    colocated_share,
    start_colocated_share,
)
from megatron_dppo.launch.memory_plan import GIB, H100_80GB_GIB, TrainerLayout
from tests import test_recipe_plans as recipe_plans
from tests.launch import REPO_ROOT
from tests.test_engine_parsers import sglang_parse
from tests.test_launch_plan import printed_servers
from tests.test_recipe_plans import QWEN3_4B, slurm_that_runs_the_plan_step

RECIPE = REPO_ROOT / "examples" / "configs" / "qwen3_4b_math_dppo.sh"
qwen3_4b = recipe_plans.qwen3_4b  # the recipe plans' fixture: Qwen3-4B's config.json
SHAPE = model_shape(QWEN3_4B)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
# the recipe's model on two GPUs (DP 2, distributed optimizer), 8192-token micro-batches
TWO_GPUS = TrainerLayout(SHAPE, dtype="bf16", dp=2, distributed_optimizer=True, tokens=8192, **RECOMPUTE)
RESPONSE = ColocatedServer(response_tokens=4096)


def test_the_recipes_colocated_dry_run_prints_sglangs_share_and_passes_the_fraction_sglang_reads(qwen3_4b, tmp_path):
    env, _, _ = slurm_that_runs_the_plan_step(tmp_path, ["node1"])
    env.update(HF_CHECKPOINT=str(qwen3_4b), WORK_DIR=str(tmp_path / "work"), STAGES="train", ROLLOUT_NODES="0",
               TRAINER_NODES="1")
    result = subprocess.run(["bash", str(RECIPE), "--dry-run", "--rollout-backend", "sglang", "--rollout-colocate",
                             "--rollout-num-servers", "8"], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    plan = result.stdout
    print(plan[plan.index("memory plan per trainer GPU"):])
    lines = plan.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["stage", "trainer_then"])
    header, row = lines[at].split(), lines[at + 1].split()
    values = dict(zip(header, row))
    assert values["fits"] == "yes" and float(values["total"]) <= 80, lines[at:at + 2]
    assert float(values["static"]) == pytest.approx(float(values["weights"]) + float(values["kv_cache"]), abs=0.11)
    passed = re.search(r"--mem-fraction-static (0\.\d{3}) passed to SGLang: the largest that fits", plan)
    default = re.search(r"SGLang's own default on this GPU, (0\.\d{3}), would overrun the GPU by", plan)
    assert passed and default and float(passed.group(1)) < float(default.group(1)), plan[-2000:]
    servers = printed_servers(plan)
    assert [devices for devices, _ in servers] == [str(gpu) for gpu in range(8)]  # the trainer's own GPUs
    for (_, command), parsed in zip(servers, sglang_parse([command for _, command in servers]), strict=True):
        assert parsed["error"] is None, f"SGLang refuses {shlex.join(command)}: {parsed['error']}"
        assert parsed["values"]["mem_fraction_static"] == float(passed.group(1)), shlex.join(command)


def test_at_the_fraction_passed_everything_fits_and_a_little_more_or_sglangs_default_would_not():
    for layout in (TWO_GPUS, replace(TWO_GPUS, pp=2), TrainerLayout(SHAPE, dp=8, distributed_optimizer=True,
                                                                 tokens=16384, **RECOMPUTE)):
        share = colocated_share(layout, 80, RESPONSE)
        assert share.fits and colocated_error(share, layout, 80, RESPONSE) is None
        fraction = share.fraction
        assert fraction == share.largest < share.sglang_default
        for stage in share.stages:
            assert stage.total(fraction) <= 80 * GIB and stage.kv_cache(fraction) >= share.response_kv
            assert share.stage_fits(stage)
        assert any(stage.total(fraction + 0.01) > 80 * GIB for stage in share.stages)
        assert all(stage.total(share.sglang_default) > 80 * GIB for stage in share.stages)


def test_a_layout_that_leaves_the_server_too_little_is_refused_in_one_line_naming_flags_that_fit():
    layout = replace(TWO_GPUS, tokens=16384)
    share = colocated_share(layout, 80, RESPONSE)
    assert not share.fits and share.largest < share.smallest
    error = colocated_error(share, layout, 80, RESPONSE)
    assert error and "\n" not in error and error.startswith("--rollout-colocate: the trainer's plan")
    assert "--rollout-max-response-len 4096" in error and "drop --rollout-colocate" in error
    offered = re.search(r"fits with --max-tokens-per-gpu (\d+)", error)
    assert offered, error
    fixed = replace(layout, tokens=int(offered.group(1)))
    assert colocated_share(fixed, 80, RESPONSE).fits  # what the line offers does fit
    assert "--sglang-chunked-prefill-size 2048" in error
    assert colocated_share(layout, 80, replace(RESPONSE, chunked_prefill=2048)).fits


@pytest.mark.parametrize("given,words", [(0.85, "give at most"), (0.1, "give at least")])
def test_a_given_fraction_outside_what_fits_is_refused_naming_the_flag_and_the_bound(given, words):
    share = colocated_share(TWO_GPUS, 80, replace(RESPONSE, fraction=given))
    error = colocated_error(share, TWO_GPUS, 80, replace(RESPONSE, fraction=given))
    assert error and error.startswith(f"--sglang-mem-fraction-static {given:g} gives the colocated SGLang server")
    assert words in error and f"{share.smallest:.3f} to {share.largest:.3f} fit" in error
    inside = round((share.smallest + share.largest) / 2, 3)
    assert colocated_error(colocated_share(TWO_GPUS, 80, replace(RESPONSE, fraction=inside)), TWO_GPUS, 80,
                           replace(RESPONSE, fraction=inside)) is None


def test_a_start_on_a_gpu_derives_the_dry_runs_fraction_and_the_cpu_plans_none():
    flags = ["--rollout-backend", "sglang", "--rollout-colocate", "--hf-checkpoint", "model", "--dry-run", "--bf16",
             "--use-distributed-optimizer",
             "--rollout-max-response-len", "4096", "--max-tokens-per-gpu", "8192", "--recompute-granularity", "full",
             "--recompute-method", "uniform", "--recompute-num-layers", "1", "--prompt-data", "math"]
    args = parse_args(flags)
    error, server_flags = start_colocated_share(args, 2, SHAPE, gpu_bytes=80 * GIB)
    expected = colocated_share(TWO_GPUS, H100_80GB_GIB, RESPONSE).fraction  # --gpu-memory-gib's default: smaller
    assert error is None and server_flags[-2:] == ["--mem-fraction-static", f"{expected:.3f}"]
    assert args.sglang_args == ["--tp-size", "1"]  # the run's own flags are left as parsed
    error, _ = start_colocated_share(args, 2, SHAPE, gpu_bytes=64 * GIB)  # the GPU's own memory, if smaller
    assert error and "--gpu-memory-gib 64" in error
    assert start_colocated_share(args, 2, SHAPE, gpu_bytes=None) == (None, None)
    given = parse_args([*flags, "--sglang-mem-fraction-static", "0.2"])
    assert start_colocated_share(given, 2, SHAPE, gpu_bytes=80 * GIB) == (None, given.sglang_args)

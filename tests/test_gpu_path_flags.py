"""The GPU path's flags, checked at parse time: Megatron-LM's activation-recompute rules, --no-load-optim and the
memory plan's --gpu-memory-gib in --help, and SGLang layouts the weight sync cannot serve.

Every refusal is one line naming the flag and the fix, exit status 2, no traceback (the parser's own path: these run
the entry point as a user does, with --dry-run so nothing starts)."""

import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT

ENTRY = REPO_ROOT / "examples" / "pretrain_dppo.py"


def dry_run(*flags: str, gpus: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ENTRY), "--dry-run", *flags], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT),
                                                           "DPPO_GPUS_PER_NODE": str(gpus), "WORLD_SIZE": "1"})


def refused_in_one_line(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    error = result.stderr.strip().splitlines()
    assert len(error) == 2 and error[1] == "(--help lists every flag)", error
    assert "Traceback" not in result.stderr and all(word in error[0] for word in words), error[0]


def test_help_lists_megatron_lms_recompute_flags_no_load_optim_and_the_gpu_memory_of_the_plan():
    result = subprocess.run([sys.executable, str(ENTRY), "--help"], capture_output=True, text=True, cwd=REPO_ROOT,
                            timeout=120)
    assert result.returncode == 0
    for flag in ("--recompute-granularity {full,selective}", "--recompute-method {uniform,block}",
                 "--recompute-num-layers", "--no-load-optim", "--gpu-memory-gib"):
        assert flag in result.stdout, flag


@pytest.mark.parametrize("flags, words", [
    (["--recompute-granularity", "full"], ["--recompute-granularity full needs --recompute-method"]),
    (["--recompute-granularity", "full", "--recompute-method", "block"], ["--recompute-num-layers"]),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     ["selective", "takes no --recompute-method uniform"]),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], ["takes no --recompute-num-layers 2"]),
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"],
     ["--recompute-method uniform and --recompute-num-layers 1", "add --recompute-granularity full"]),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     ["--recompute-num-layers", "0 is out of range"]),
])
def test_recompute_flags_outside_megatron_lms_rules_are_refused_in_one_line_at_parse_time(flags, words):
    refused_in_one_line(dry_run(*flags), *words)


@pytest.mark.parametrize("flag", ["--sglang-pp-size", "--sglang-pipeline-parallel-size"])
def test_an_sglang_server_split_into_pipeline_stages_is_refused_in_one_line(flag):
    # SGLang joins the weight-sync group at rank_offset + tp_rank: two pipeline stages would take the same rank
    refused_in_one_line(dry_run("--rollout-backend", "sglang", flag, "2", gpus=4), "--sglang-pp-size 2", "pipeline")
    assert dry_run("--rollout-backend", "sglang", flag, "1", gpus=4).returncode == 0


def test_the_engine_device_applies_to_the_embedded_engine_alone_and_reaches_its_command(monkeypatch):
    refused_in_one_line(dry_run("--rollout-backend", "sglang", "--rollout-engine-device", "cuda", gpus=4),
                        "--rollout-engine-device cuda", "--rollout-backend embedded")
    from megatron_dppo.launch.arguments import parse_args
    from megatron_dppo.launch.run import embedded_engine_options
    from megatron_dppo.rollout.launcher import embedded_engine_command

    monkeypatch.setenv("WORLD_SIZE", "1")
    options = embedded_engine_options(parse_args(["--rollout-engine-device", "cuda"]), 1)
    command = embedded_engine_command("model", "127.0.0.1", 1234, **options)
    assert command[command.index("--device") + 1] == "cuda"
    assert "--device" not in embedded_engine_command("model", "127.0.0.1", 1234,
                                                     **embedded_engine_options(parse_args([]), 1))

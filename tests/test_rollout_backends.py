"""bench/rollout_backends.py runs at this revision, on a tiny case of both workloads, so that it cannot break unseen:
the main job's warm start (built here with 1 supervised step), exported and served as the trainer serves it, and
the fixed-length model; against in-process HF generate. It checks what the bench prints, not its speeds."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.launch.run import embedded_engine_options
from tests.launch import finish

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rollout_backends.py"


def test_the_engine_is_started_with_the_options_the_trainer_computes_from_its_own_flags():
    """The bench passes the trainer's parsed flags, so a new engine option cannot leave it behind again: under 2
    trainer processes that is 1 worker x 2 threads, deterministic."""
    options = embedded_engine_options(parse_args([]), 2)
    assert options["workers"] == 1 and options["threads"] == 2 and options["enable_deterministic_inference"]


@pytest.mark.timeout(900)
def test_the_bench_runs_both_workloads_and_ends_with_the_two_ratio_lines(tmp_path):
    command = [sys.executable, str(BENCH), "--backends", "embedded", "hf-generate", "--repeats", "1",
               "--out-dir", str(tmp_path / "runs"), "--warm-start-steps", "1", "--eval-size", "4",
               "--main-job-prompts", "2", "--main-job-max-tokens", "8", "--hidden", "64", "--layers", "1",
               "--vocab", "128", "--prompts", "2", "--samples", "2", "--new-tokens", "3", "--prompt-len", "4"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(BENCH.parents[1])}, cwd=tmp_path,
                               start_new_session=True)
    output = finish(process, 840, "bench/rollout_backends.py")
    assert process.returncode == 0, output[-6000:]
    lines = [line for line in output.splitlines() if line.strip()]
    assert re.fullmatch(r"embedded_vs_hf_generate_main_job: \d+\.\d{3}", lines[-2]), lines[-2:]
    assert re.fullmatch(r"embedded_vs_hf_generate_fixed_length: \d+\.\d{3}", lines[-1]), lines[-2:]
    assert all(float(line.split(": ")[1]) > 0 for line in lines[-2:])
    # the main job's model and batch: the warm start's tiny model, 2 prompts x the run's 8 samples, the trainer's
    # engine layout; the fixed-length workload: every sample exactly 3 tokens (the bench checks each round)
    assert re.search(r"### main-job: the main job's warm-started model \(.*hidden 128, 3 layers.*\), 2 prompts x 8 "
                     r"samples, up to 8 tokens each, stopping at the end token; embedded engine 1 worker\(s\) x 2 "
                     r"thread\(s\)", output), output[-4000:]
    assert re.search(r"### fixed-length: .* 2 prompts of 4 tokens x 2 samples x 3 tokens, no end token; embedded "
                     r"engine 1 worker\(s\) x 2 thread\(s\)", output), output[-4000:]
    fixed = output[output.index("### fixed-length"):]
    assert re.search(r"embedded engine +[\d.]+ +[\d.]+ +12 ", fixed) and re.search(r"HF generate .* 12 ", fixed)

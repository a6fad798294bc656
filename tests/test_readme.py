"""The README's "A real run" block, run line by line as a new user would: a fresh copy of the repository with no
../shared beside it, data from DPPO_DATA_DIR written to Parquet by tools/prepare_data.py, training from that file.

Only the block's own settings change (its first four lines read them from the environment): a tiny local model
with a chat template instead of Qwen3-4B, 2 CPU processes and TP 1, 2 steps, the embedded engine instead of SGLang
servers, small batches (`--bf16` kept), 2 problems per benchmark. Everything else runs exactly as written: the bf16
run saves at its end (the export and evaluation read that checkpoint), then the resume the README gives (its
torchrun line with `--load ckpt/run`) takes 2 more steps from it and saves step 4.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT

SETTINGS = {
    "NPROC": "2", "TP": "1", "STEPS": "2",
    "ROLLOUT": "--rollout-backend embedded",
    "SIZES": "--bf16 --rollout-batch-size 2 --n-samples-per-prompt 2 --rollout-max-response-len 8 --eval-size 4 "
             "--max-tokens-per-gpu 16384",
    "EVAL": "--limit 2 --max-new-tokens 8 --no-progress",
}


def real_run_block() -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## A real run", 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert match, "README.md has no bash block under '## A real run'"
    return match.group(1)


def torchrun_line(block: str) -> str:
    """The block's torchrun command, its continuation lines joined."""
    command = re.search(r"^torchrun .*?(?<!\\)\n", block, re.DOTALL | re.MULTILINE)
    assert command, "the real-run block has no torchrun command"
    return command.group(0)


def fresh_copy(destination: Path) -> Path:
    """The repository's files (tracked and new, not ignored) as a clone has them, with no ../shared beside."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


@pytest.mark.shared_data
def test_readme_real_run_block_runs_as_written_from_a_prepared_parquet_file(tmp_path):
    from megatron_dppo.data.paths import data_dir
    from tests.tiny_chat import save_tiny_chat_model

    clone = fresh_copy(tmp_path / "clone" / "megatron_dppo")
    assert not (clone.parent / "shared").exists()
    model = tmp_path / "tiny-chat-model"
    save_tiny_chat_model(model)
    environment = {**os.environ, **SETTINGS, "MODEL": str(model), "DPPO_DATA_DIR": str(data_dir().resolve()),
                   "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1",
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    finished = subprocess.run(["bash", "-euo", "pipefail", "-c", real_run_block()], cwd=clone, env=environment,
                              capture_output=True, text=True, timeout=600, start_new_session=True)
    assert finished.returncode == 0, f"{finished.stdout[-4000:]}\n{finished.stderr[-6000:]}"
    assert (clone / "ckpt" / "run" / "latest").read_text().strip() == "iter_0000002"
    # the README's resume: the same torchrun line with --load ckpt/run, here to 2 more steps
    resume = torchrun_line(real_run_block()).rstrip() + " --load ckpt/run --train-iters 4\n"
    resumed = subprocess.run(["bash", "-euo", "pipefail", "-c", resume], cwd=clone, env=environment,
                             capture_output=True, text=True, timeout=600, start_new_session=True)
    assert resumed.returncode == 0, f"{resumed.stdout[-4000:]}\n{resumed.stderr[-6000:]}"
    assert (clone / "ckpt" / "run" / "latest").read_text().strip() == "iter_0000004"
    steps = [json.loads(line) for line in (clone / "runs" / "dppo" / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2, 3, 4]

    assert (clone / "data" / "math_train.parquet").is_file()
    summary = json.loads((clone / "runs" / "dppo" / "summary.json").read_text())
    assert summary["steps"] == 4
    results = json.loads((clone / "eval" / "run" / "results.json").read_text())
    assert list(results["benchmarks"]) == ["math500", "gsm8k", "aime24", "amc23", "minerva_math", "olympiadbench"]
    assert all(summary["num_problems"] == 2 for summary in results["benchmarks"].values())

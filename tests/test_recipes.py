"""The shipped recipes (examples/configs/qwen3_4b_math_{dppo,grpo}.sh) run end to end as a practitioner runs them:
each file as written, from a fresh copy of the repository with no ../shared beside it, no local data and no network
(HF_HUB_OFFLINE=1), through every stage of examples/slurm/pipeline.sh: data (tools/prepare_data.py), convert from
the Hub name, train (dppo.sbatch: its plan step, a rollout node's servers, torchrun), export, evaluate.

Only the settings' values change (each recipe's settings block reads them from the environment): the model is a tiny
chat model under the recipe's own Hub name, Qwen/Qwen3-4B, in a Hugging Face cache built on disk, and the data sets'
public sources are tiny copies in the same cache (tests/hub_cache.py); one trainer node of 2 CPU processes and one
rollout node serving the embedded engine in place of SGLang (ROLLOUT_ENGINE=embedded, dppo.sbatch's setting), 2 steps
of small batches, a checkpoint and an evaluation of the three named held-out sets every step, 2 problems per
benchmark. Slurm's srun, sbatch and scontrol are stand-ins that run each job step on this machine (the allocation's
two nodes are this host under two names), honouring the steps' --output and --error files.

The two recipes differ only in their trainer flags, so they share launches: DPPO's recipe runs every stage; GRPO's
is given DPPO's data and converted checkpoint in its own WORK_DIR, so the pipeline skips those two stages as after a
failure (a stage whose output is complete), and trains; its export and evaluation, the same commands on a checkpoint
of the same layout, are left to DPPO's (STAGES="data convert train", pipeline.sh's setting).
"""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from megatron_dppo.platform.network import free_port
from tests.launch import kill_marked
from tests.test_readme import BENCHMARKS, new_user, source_rows

MODEL = "Qwen/Qwen3-4B"  # the recipes' own Hub name, holding the tiny chat model here
RECIPES = ("qwen3_4b_math_dppo.sh", "qwen3_4b_math_grpo.sh")
SETTINGS = {  # the recipes' settings, small; everything else as shipped
    "GPUS_PER_NODE": "2", "ROLLOUT_ENGINE": "embedded", "SGLANG_ARGS": "",
    "BATCH_PROMPTS": "2", "RESPONSE_LEN": "8", "EVAL_SIZE": "2", "INTERVAL": "1", "TRAIN_ITERS": "2",
    "EVAL_ARGS": "--k 1 --temperature 0 --max-new-tokens 8 --apply-chat-template --limit 2 --no-progress",
}
NODES = ("localhost", "127.0.0.1")  # the allocation: a trainer node and a rollout node, both this host
HELD_OUT = ("math500", "amc23", "aime24")  # the recipes' named held-out sets, in their order
RECIPE_TIMEOUT_S = 1500  # one recipe's run: DPPO's every stage took over 14 minutes on 2 cores shared with other work

SRUN = """#!/usr/bin/env bash
# srun here: run the step's command on this host (one task), its output and error where --output / --error say
out= err=
while [ $# -gt 0 ] && [[ $1 == -* ]]; do
    case $1 in --output=*) out=${1#--output=} ;; --error=*) err=${1#--error=} ;; esac
    shift
done
export SLURM_STEP_ID=0 SLURMD_NODENAME=localhost
out=${out//%n/0} err=${err//%n/0}
if [ -n "$out" ]; then exec >"$out"; fi
if [ -n "$err" ]; then exec 2>"$err"; elif [ -n "$out" ]; then exec 2>&1; fi
exec "$@"
"""
SBATCH = f"""#!/usr/bin/env bash
# sbatch --wait here: run the batch script on this host as the allocation of {' and '.join(NODES)}
out=
while [ $# -gt 0 ] && [[ $1 == -* ]]; do
    case $1 in --output=*) out=${{1#--output=}} ;; esac
    shift
done
export SLURM_JOB_ID=$$ SLURM_JOB_NODELIST={','.join(NODES)} SLURM_SUBMIT_DIR=$PWD
exec >"${{out//%j/$SLURM_JOB_ID}}" 2>&1
exec bash "$@"
"""
SCONTROL = f"""#!/usr/bin/env bash
printf '%s\\n' {' '.join(NODES)}
"""


def slurm_here(directory: Path) -> Path:
    """A PATH folder whose srun, sbatch and scontrol run each job step on this host."""
    directory.mkdir(parents=True)
    for name, text in (("srun", SRUN), ("sbatch", SBATCH), ("scontrol", SCONTROL)):
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
    return directory


def run_recipe(recipe: str, clone: Path, work_dir: Path, environment: dict) -> str:
    """`WORK_DIR=... bash examples/configs/RECIPE` in the clone, as its header says; its output, or the test fails
    with the logs of the step that stopped it."""
    ports = {name: str(free_port()) for name in ("EVAL_PORT", "ROLLOUT_PORT", "RDZV_PORT")}
    finished = subprocess.run(["bash", f"examples/configs/{recipe}"], cwd=clone, capture_output=True, text=True,
                              timeout=RECIPE_TIMEOUT_S, env={**environment, "WORK_DIR": str(work_dir), **ports},
                              start_new_session=True)
    if finished.returncode != 0:
        logs = "\n".join(f"--- {path}\n{path.read_text()[-3000:]}" for path in sorted(work_dir.rglob("*"))
                         if path.is_file() and path.suffix in (".log", ".err", ".out"))
        raise AssertionError(f"{recipe} exited {finished.returncode}\n{finished.stdout[-3000:]}\n"
                             f"{finished.stderr[-3000:]}\n{logs}")
    return finished.stdout


def check_trained(work_dir: Path) -> dict:
    """2 steps trained and saved, each logging every named held-out set; the run's summary."""
    assert (work_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    steps = [json.loads(line) for line in (work_dir / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        named = [step[f"heldout_accuracy/{name}"] for name in HELD_OUT]
        assert all(0.0 <= value <= 1.0 for value in named) and step["heldout_accuracy"] == named[0], step
    summary = json.loads((work_dir / "metrics" / "summary.json").read_text())
    assert summary["steps"] == 2 and list(summary["heldout_sets"]) == list(HELD_OUT)
    return summary


def check_exported_and_evaluated(work_dir: Path, snapshot: Path) -> None:
    """The export carries the Hub name's tokenizer; the six benchmarks evaluated on the exported model, 2 problems
    each (fewer where a tiny source has fewer)."""
    assert (work_dir / "hf-final" / "tokenizer.json").read_bytes() == (snapshot / "tokenizer.json").read_bytes()
    results = json.loads((work_dir / "eval" / "results.json").read_text())
    assert {name: result["num_problems"] for name, result in results["benchmarks"].items()} == {
        name: min(2, source_rows(name)) for name in BENCHMARKS}


@pytest.mark.timeout(2 * RECIPE_TIMEOUT_S + 180)  # two recipe runs and the test's own setup
def test_each_shipped_recipe_trains_end_to_end_as_written_from_its_hub_name_and_prepared_data(tmp_path):
    clone, snapshot, environment = new_user(tmp_path, MODEL)
    marker = f"DPPO_RECIPE_TEST={uuid.uuid4().hex}"  # every process the recipes start inherits it
    for key in ("TRAINER_NODES", "ROLLOUT_NODES", "SGLANG_TP", "TP", "PP", "STAGES", "DATA_DIR", "LOG_DIR"):
        environment.pop(key, None)
    environment.update(SETTINGS, PYTHON=sys.executable, DPPO_RECIPE_TEST=marker.split("=")[1],
                       PATH=os.pathsep.join([str(slurm_here(tmp_path / "slurm")), environment["PATH"]]))
    dppo, grpo = tmp_path / "qwen3-4b-dppo", tmp_path / "qwen3-4b-grpo"
    try:
        output = run_recipe(RECIPES[0], clone, dppo, environment)
        prepared = [line for line in output.splitlines() if " bad rows left out; --reward-type " in line]
        assert len(prepared) == 10 and all("from https://huggingface.co/datasets/" in line for line in prepared)
        plan = (next((dppo / "logs").glob("slurm-*")) / "plan.txt").read_text().splitlines()
        header = next(i for i, line in enumerate(plan) if line.split()[:2] == ["stage", "weights"])
        assert plan[header - 1].startswith("memory plan per trainer GPU") and plan[header + 1].split()[-1] == "yes"
        check_trained(dppo)
        check_exported_and_evaluated(dppo, snapshot)

        for shared in ("data", "megatron-init-tp1-pp1"):  # the same data and converted model: skipped stages
            shutil.copytree(dppo / shared, grpo / shared)
        output = run_recipe(RECIPES[1], clone, grpo, {**environment, "STAGES": "data convert train"})
        assert "pipeline: the built-in data sets" not in output and "pipeline: HF -> Megatron" not in output
        assert check_trained(grpo)["prompts_pruned_fraction"] == 0.0  # plain GRPO: no prompt pruned
    finally:
        kill_marked(marker)

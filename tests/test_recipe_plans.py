"""The shipped recipes' launch and memory plans, as Slurm would run them (stand-in srun / sbatch / scontrol from
tests/test_slurm.py, no daemons): examples/configs/qwen3_4b_math_*.sh ─► pipeline.sh ─► sbatch dppo.sbatch
--dry-run ─► the plan step, an srun job step in SRUN_ARGS' container ─► pretrain_dppo.py --dry-run.

- dppo.sbatch runs its plan step (pretrain_dppo.py --dry-run) as a job step in the SRUN_ARGS container, never with
  the batch host's Python (which may lack numpy or be older than the trainer's);
- each recipe's memory plan fits an 80 GB H100 (the plan's default --gpu-memory-gib, what one offers) on Qwen3-4B's
  config.json;
- without its activation recompute the same recipe cannot fit, and the dry run ends in one line naming the flags
  that would make it fit (exit status 2, no traceback);
- the README's dry run, as written with its default MODEL=Qwen/Qwen3-4B on a machine with no GPU and no weights,
  plans from the config.json alone in the Hugging Face cache (what a config-only download leaves) and checks the plan
  there too: its TP 2 command fits; at TP 1 with 16,384-token micro-batches it does not, in one line.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT
from tests.test_slurm import recorded, srun_options, stand_in_code, stand_in_slurm

RECIPES = [REPO_ROOT / "examples" / "configs" / name for name in ("qwen3_4b_math_dppo.sh", "qwen3_4b_math_grpo.sh")]
ENTRY = REPO_ROOT / "examples" / "pretrain_dppo.py"
CONTAINER = ["--container-image=/images/megatron-dppo.sqsh", "--container-mounts=/data:/data"]
# Qwen3-4B's config.json (huggingface.co/Qwen/Qwen3-4B): the fields the plan reads
QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
            "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 40960,
            "rope_theta": 1000000, "rms_norm_eps": 1e-6, "attention_bias": False}


@pytest.fixture(scope="module")
def qwen3_4b(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("Qwen3-4B")
    (model / "config.json").write_text(json.dumps(QWEN3_4B))
    return model


def slurm_that_runs_the_plan_step(tmp_path: Path, nodes: list[str]) -> tuple[dict, Path, Path]:
    """Stand-in Slurm whose sbatch runs the batch script on this host as an allocation of `nodes` would (the job's
    variables set) and whose srun runs a job step's command when it is the dry run (every call recorded; the step
    marked by SLURM_STEP_ID, as Slurm marks it); the batch host's Python records each script it runs outside a step.
    Returns (environment, Slurm's record, the host Python's record)."""
    env, record = stand_in_slurm(tmp_path, nodes)
    bin_dir, host_record = tmp_path / "bin", tmp_path / "host-python.jsonl"
    recorder = stand_in_code(tmp_path, "srun").read_text()
    stand_in_code(tmp_path, "srun").write_text(
        recorder + "command = [arg for arg in sys.argv[1:] if not arg.startswith('-')][:1]\n"
        "if '--dry-run' in sys.argv:\n"
        "    import subprocess\n"
        "    start = sys.argv.index(command[0])\n"
        "    step = dict(os.environ, SLURM_STEP_ID='0')  # a job step, as Slurm marks one\n"
        "    sys.exit(subprocess.run(sys.argv[start:], env=step).returncode)\n")
    stand_in_code(tmp_path, "sbatch").write_text(
        recorder + "script = next(arg for arg in sys.argv[1:] if arg.endswith('.sbatch'))\n"
        f"env = dict(os.environ, SLURM_JOB_ID='77', SLURM_JOB_NODELIST={','.join(nodes)!r})\n"
        "import subprocess\n"
        "sys.exit(subprocess.run(['bash', script, *sys.argv[sys.argv.index(script) + 1:]], env=env).returncode)\n")
    host_python = bin_dir / "host-python"
    host_python.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                           "if 'SLURM_STEP_ID' not in os.environ:  # the batch host itself, outside any job step\n"
                           f"    with open({str(host_record)!r}, 'a') as out:\n"
                           "        out.write(json.dumps(sys.argv[1:]) + '\\n')\n"
                           f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n")
    host_python.chmod(0o755)
    env.update(PYTHON=str(host_python), SRUN_ARGS=" ".join(CONTAINER), DPPO_REPO=str(REPO_ROOT),
               PYTHONPATH=str(REPO_ROOT))
    return env, record, host_record


def run_recipe(recipe: Path, tmp_path: Path, model: Path, *flags: str) -> tuple[subprocess.CompletedProcess, Path,
                                                                                  Path]:
    env, record, host_record = slurm_that_runs_the_plan_step(tmp_path, ["node1", "node2"])
    env.update(HF_CHECKPOINT=str(model), WORK_DIR=str(tmp_path / "work"), STAGES="train")
    result = subprocess.run(["bash", str(recipe), "--dry-run", *flags], env=env, cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    return result, record, host_record


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_the_recipes_plan_runs_as_a_job_step_in_the_container_and_fits_an_80_gb_h100(recipe, qwen3_4b, tmp_path):
    result, record, host_record = run_recipe(recipe, tmp_path, qwen3_4b)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    plan_steps = [call["args"] for call in recorded(record, "srun") if "--dry-run" in call["args"]]
    assert len(plan_steps) == 1, "dppo.sbatch's plan step is not a job step"
    assert all(flag in srun_options(plan_steps[0]) for flag in CONTAINER), (
        f"the plan step runs outside SRUN_ARGS' container: srun {srun_options(plan_steps[0])}")
    on_host = [args for args in map(json.loads, host_record.read_text().splitlines())
               if args and args[0].endswith("pretrain_dppo.py")] if host_record.exists() else []
    assert not on_host, f"the batch host's Python ran the trainer's entry point: {on_host}"
    plan = result.stdout
    assert "memory plan per trainer GPU" in plan and "TP 1 x PP 1 x DP 8" in plan, plan[-3000:]
    assert "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" in plan
    lines = plan.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["stage", "weights"])
    header, row = lines[at], lines[at + 1]
    total = float(row.split()[header.split().index("total")])
    assert row.split()[-1] == "yes" and total <= 80, row
    print(f"{recipe.name}: {header.strip()} / {row.strip()}")


def test_a_recipe_without_recompute_cannot_fit_and_its_dry_run_ends_in_one_line_naming_the_flags(qwen3_4b):
    flags = ["--dry-run", "--hf-checkpoint", str(qwen3_4b), "--prompt-data", "math", "--bf16",
             "--use-distributed-optimizer", "--max-tokens-per-gpu", "16384", "--rollout-backend", "external",
             "--rollout-urls", *[f"http://node2:{30000 + i}" for i in range(8)]]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "DPPO_NODES": "node1,node2",
           "DPPO_TRAINER_NODES": "1", "DPPO_ROLLOUT_NODES": "1", "DPPO_GPUS_PER_NODE": "8", "WORLD_SIZE": "8"}
    result = subprocess.run([sys.executable, str(ENTRY), *flags], capture_output=True, text=True, cwd=REPO_ROOT,
                            env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and "Traceback" not in result.stderr, error
    for words in ("--gpu-memory-gib is 79.17", "fits with --recompute-granularity full --recompute-method uniform "
                  "--recompute-num-layers 1", "--max-tokens-per-gpu", "--tensor-model-parallel-size 2"):
        assert words in error[0], error[0]
    assert "fits" in result.stdout and " NO" in result.stdout  # the table still shows where the memory goes


def test_the_readme_dry_run_without_gpus_plans_the_hub_name_from_its_cached_config_and_refuses_what_cannot_fit(
        tmp_path):
    import os
    import re

    from tests.hub_cache import place_in_hub_cache
    from tests.test_readme import cluster_blocks, run_bash, training_command

    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text(json.dumps(QWEN3_4B))
    place_in_hub_cache(tmp_path / "hf_home", "Qwen/Qwen3-4B", tmp_path / "config-only")
    blocks = cluster_blocks()
    dry_run = next(line for block in blocks["flow"] for line in block.splitlines() if "--dry-run" in line)
    script = "\n".join([*blocks["settings"], training_command(blocks["flow"]), dry_run])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for key in ("MODEL", "NPROC", "TP", "SIZES", "DPPO_GPUS_PER_NODE"):
        env.pop(key, None)
    plan = run_bash(script, REPO_ROOT, env).stdout
    header = re.search(r"^memory plan per trainer GPU .*$", plan, re.MULTILINE).group(0)
    assert "against --gpu-memory-gib 79.17: bf16, TP 2 x PP 1 x DP 4, distributed optimizer" in header, header
    row = plan.split(header, 1)[1].splitlines()[2].split()
    assert row[-1] == "yes" and float(row[-2]) < 79.17, row
    assert "(no GPU here: checked against --gpu-memory-gib 79.17" in plan

    refused = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=300, env={**env, "TP": "1", "SIZES": "--bf16 --rollout-batch-size 32 "
                                                          "--n-samples-per-prompt 8 --rollout-max-response-len 4096 "
                                                          "--max-tokens-per-gpu 16384"})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("pretrain_dppo.py --dry-run: error: the memory plan needs an estimated") and (
        "but --gpu-memory-gib is 79.17; fits with --recompute-granularity full" in line), line

"""bf16 and fp16 runs save, stop and resume exactly, as the README's cluster run does (`--bf16 --save`), local spec.

    tiny Qwen3 (HF, random) ──► tools/convert_hf_to_megatron.py --dtype bf16|fp16 ──► torchrun 2 ranks
        straight:  --load converted, 4 steps, --save-interval 2                        ──► straight/iter_0000004
        stopped:   bf16: the straight command into stopped/, killed (SIGKILL) after its step-2 save;
                   fp16: --load converted, 2 steps (the run ends after its save)      ──► stopped/iter_0000002
        resumed:   the straight command into stopped/ (--load converted, 4 steps): it resumes from stopped's latest
                   by itself, saying so in one line (the converted --load is where the run started) ──► stopped/
                   iter_0000004

Checked per configuration: every step of both runs has a finite, positive gradient norm (the entropy bonus gives a
gradient where a random model earns no reward), the resumed steps' gradient norms equal the straight run's, and
the resumed step-4 checkpoint equals the straight one bitwise: every tensor the files hold (the model's bf16/fp16
weights, the optimizer's model-space state) and, loaded back into the actor, every restored tensor (fp32 main
parameters, Adam moments and step counts, fp16's loss scaler). Bitwise, as the fp32 resume test is: the same
operations on the same CPU in the same order, so a resume that restores everything leaves no rounding to tolerate.

Configurations (a pairwise cover of precision x layout x optimizer: each pair of settings runs together once):
bf16 DP2 with the distributed optimizer, bf16 TP2 without, fp16 DP2 without, fp16 TP2 with. The bf16 checkpoint
then exports to HF with tools/convert_megatron_to_hf.py and loads in transformers.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.launch import REPO_ROOT, kill_once_saved, run_torchrun, start_torchrun

ENTRY = REPO_ROOT / "examples" / "pretrain_dppo.py"
RESTORED_STATE = REPO_ROOT / "tests" / "workers" / "optimizer_state_checks.py"
FLAT_BUFFERS = "optimizer.distributed."
CONFIGS = {  # name: (dtype, tensor-parallel size, distributed optimizer); 2 ranks, so TP 1 is DP 2
    "bf16-dp2-distributed-optimizer": ("bf16", 1, True),
    "bf16-tp2": ("bf16", 2, False),
    "fp16-dp2": ("fp16", 1, False),
    "fp16-tp2-distributed-optimizer": ("fp16", 2, True),
}
RUN = ["--rollout-backend", "embedded", "--algorithm", "dppo", "--lr", "1e-3", "--entropy-coef", "0.05",
       "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
       "--data-train-size", "32", "--eval-size", "4", "--keep-last-checkpoints", "0"]


def run_tool(script: str, *args) -> None:
    finished = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / script), *map(str, args)],
                              capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert finished.returncode == 0, f"{script} failed:\n{finished.stderr[-4000:]}"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A random tiny Qwen3 (q/k norms: the local spec's torch RMSNorms that stayed fp32) with a tokenizer."""
    from megatron_dppo.data.tokenizer import CharTokenizer

    return CharTokenizer.for_synthetic_task().save_random_model(
        tmp_path_factory.mktemp("tiny_qwen3") / "hf", "qwen3", hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, ffn_hidden_size=128, head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def converted(tiny_qwen3, tmp_path_factory):
    """dtype -> the tiny Qwen3 converted by the README's converter command (TP 1; TP 2 runs reshard on load)."""
    root = tmp_path_factory.mktemp("converted")
    for dtype in ("bf16", "fp16"):
        run_tool("convert_hf_to_megatron.py", "--hf-dir", tiny_qwen3, "--out", root / dtype, "--tp", 1, "--pp", 1,
                 "--dtype", dtype)
    return root


def train_command(model_dir: Path, load: Path, dtype: str, layout: list[str], steps: int, save: Path,
                  log_dir: Path) -> list:
    return ["--hf-checkpoint", model_dir, "--load", load, f"--{dtype}", *RUN, *layout, "--train-iters", steps,
            "--save", save, "--save-interval", 2, "--log-dir", log_dir]


def train(*command_fields) -> str:
    return run_torchrun(ENTRY, 2, train_command(*command_fields), timeout=300)


def saved_tensors(checkpoint: Path, scratch: Path) -> dict:
    """What the checkpoint files hold, merged over ranks: every tensor but the distributed optimizer's flat buffers,
    whose alignment gaps are written from uninitialised memory (its restored state is compared in memory instead,
    tests/workers/optimizer_state_checks.py), and the common state (loss scaler, schedule)."""
    dcp_to_torch_save(checkpoint, scratch)
    merged = torch.load(scratch, weights_only=False)
    return {"sharded": {key: value for key, value in merged.items() if not key.startswith(FLAT_BUFFERS)},
            "common": torch.load(checkpoint / "common.pt", weights_only=False)}


def assert_equal(expected, actual, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and expected.dtype == actual.dtype, where
        assert torch.equal(expected, actual), f"{where} differs after the resume"
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), f"{where}: {sorted(expected)} != {sorted(actual)}"
        for key in expected:
            assert_equal(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(expected) == len(actual), where
        for index, (left, right) in enumerate(zip(expected, actual)):
            assert_equal(left, right, f"{where}[{index}]")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def grad_norms(log_dir: Path) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", CONFIGS)
def test_half_precision_run_saves_stops_and_resumes_bitwise_as_an_uninterrupted_run(name, tiny_qwen3, converted,
                                                                                    tmp_path):
    dtype, tp, distributed_optimizer = CONFIGS[name]
    layout = ["--tensor-model-parallel-size", str(tp)] + ["--use-distributed-optimizer"] * distributed_optimizer
    train(tiny_qwen3, converted / dtype, dtype, layout, 4, tmp_path / "straight", tmp_path / "straight_log")
    again = (tiny_qwen3, converted / dtype, dtype, layout, 4, tmp_path / "stopped", tmp_path / "stopped_log")
    if dtype == "bf16":  # the README's precision: a run lost mid-way after a save
        saved = kill_once_saved(start_torchrun(ENTRY, 2, train_command(*again)), tmp_path / "stopped", 2)
    else:  # a run that ended at its --train-iters, extended by the same command with more
        train(tiny_qwen3, converted / dtype, dtype, layout, 2, tmp_path / "stopped", tmp_path / "stopped_log")
        saved = 2
    output, stopped = train(*again), tmp_path / "stopped"
    assert f"resuming from {stopped / f'iter_{saved:07d}'} (step {saved}): --save {stopped} holds this run's " \
           f"checkpoints; --load {converted / dtype} is where it started" in output, output[-3000:]

    straight_norms, resumed_norms = grad_norms(tmp_path / "straight_log"), grad_norms(tmp_path / "stopped_log")
    assert len(straight_norms) == 4 and len(resumed_norms) == 4, (straight_norms, resumed_norms)
    assert all(math.isfinite(norm) and norm > 0 for norm in straight_norms + resumed_norms), resumed_norms
    straight = saved_tensors(tmp_path / "straight" / "iter_0000004", tmp_path / "straight.pt")
    resumed = saved_tensors(tmp_path / "stopped" / "iter_0000004", tmp_path / "resumed.pt")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    weights = [key for key, value in straight["sharded"].items() if not key.startswith("optimizer.")
               and isinstance(value, torch.Tensor)]
    assert weights and all(straight["sharded"][key].dtype == torch_dtype for key in weights), "weights not in dtype"
    assert_equal(straight, resumed, name)
    output = run_torchrun(RESTORED_STATE, 2, ["--first", tmp_path / "straight", "--second", tmp_path / "stopped",
                                              "--dtype", dtype, "--tp", tp,
                                              *["--use-distributed-optimizer"] * distributed_optimizer])
    assert "CHECK restored_state_equal ok" in output, output[-4000:]
    assert straight_norms[2:] == resumed_norms[2:]

    if dtype == "bf16":
        from transformers import AutoModelForCausalLM

        run_tool("convert_megatron_to_hf.py", "--megatron-dir", tmp_path / "stopped", "--out", tmp_path / "hf")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        assert model.dtype == torch.bfloat16
        norm = dict(model.named_parameters())["model.layers.0.self_attn.q_norm.weight"]
        saved = straight["sharded"]["decoder.layers.self_attention.q_layernorm.weight"][0]
        assert torch.equal(norm, saved), "the exported q norm is not the checkpoint's"
        with torch.no_grad():
            logits = model(torch.tensor([[1, 5, 9, 4]])).logits
        assert torch.isfinite(logits).all()

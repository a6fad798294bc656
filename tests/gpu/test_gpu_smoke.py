"""The GPU path on one GPU, end to end: the same entry point as the CPU runs, switched by the device alone.

tiny Qwen3 (random, bf16-friendly: head_dim 64) ──► our converter (local spec, no TE extra state) ──► torchrun 1 rank:
TE actor loads it ──► a real SGLang 0.5.23 server on the same GPU (--rollout-colocate, deterministic inference) ──►
3 DPPO steps, each ending with a weight sync (pause → flush → begin → buckets → end → continue, over gloo: NCCL
refuses two ranks on one GPU) ──► metrics.jsonl.

Checks, per step: the weight version the server reports after the sync equals the step; the update ran (finite,
positive gradient norm: the entropy bonus gives a gradient even when a random model earns no reward); and the
server's log-probs of the trained tokens match the trainer's recomputation: `logprob_gap_train_vs_rollout`, the
mean |trainer - engine| per trained token, is at most 0.05. Tolerance: both sides run bf16 (8 mantissa bits, a
relative step of 2^-8 ~ 0.004 on logits of order 1-10, summed through a log-softmax over the vocabulary), so gaps of
~1e-2 are expected; a stale engine (weights not synced) adds the update's own change on top.

Run with examples/gpu_smoke.sh (or pytest tests/gpu) on a machine with a CUDA GPU, Transformer Engine and SGLang
(the Docker image). On a CPU machine pytest reports these tests as skipped, with the reason.
"""

import importlib.util
import json
import math

import pytest
import torch

from tests.gpu.limits import LAUNCH_TIMEOUT_S, TEST_TIMEOUT_S
from tests.launch import REPO_ROOT, run_torchrun

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="GPU smoke run: needs a CUDA GPU (with Transformer Engine and SGLang: the "
                                        "Docker image); run examples/gpu_smoke.sh there"),
              pytest.mark.timeout(TEST_TIMEOUT_S)]

ENTRY = REPO_ROOT / "examples" / "pretrain_dppo.py"
STEPS = 3
LOGPROB_GAP_TOL = 0.05  # mean |trainer - engine| log-prob per trained token, bf16 on both sides (see above)


def require(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"the GPU smoke run needs {module}: {install}", pytrace=False)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A random tiny Qwen3 with our character tokenizer, and its Megatron checkpoint written by our converter."""
    from megatron_dppo.actor.conversion import hf_to_megatron
    from megatron_dppo.data.tokenizer import CharTokenizer

    root = tmp_path_factory.mktemp("gpu_smoke")
    model_dir = CharTokenizer.for_synthetic_task().save_random_model(
        root / "hf", "qwen3", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=512,
        head_dim=64, max_position_embeddings=256)
    converted = hf_to_megatron(model_dir, root / "megatron", tp=1, pp=1, dtype="bf16")
    return model_dir, converted, root


def test_one_gpu_te_actor_and_sglang_run_three_dppo_steps_with_synced_weights(tiny_qwen3):
    require("transformer_engine", "pip install 'transformer-engine[core_cu13,pytorch]==2.11.0' (see Dockerfile)")
    require("sglang", "pip install sglang==0.5.23 (see Dockerfile)")
    model_dir, converted, root = tiny_qwen3
    log_dir = root / "run"
    output = run_torchrun(ENTRY, 1, [
        "--hf-checkpoint", model_dir, "--load", converted, "--bf16", "--train-iters", STEPS,
        "--algorithm", "dppo", "--lr", "1e-4", "--entropy-coef", "0.01",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
        "--data-train-size", "64", "--eval-size", "8", "--log-dir", log_dir,
        "--rollout-backend", "sglang", "--rollout-colocate", "--sglang-skip-tokenizer-init",
        "--sglang-dtype", "bfloat16", "--sglang-mem-fraction-static", "0.3", "--sglang-context-length", "256",
    ], timeout=LAUNCH_TIMEOUT_S)
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == list(range(1, STEPS + 1)), output[-4000:]
    for step in steps:
        assert step["weight_version"] == step["step"], step  # the server reports the synced version
        assert step["skipped_update"] == 0.0 and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0, step
        gap = step["logprob_gap_train_vs_rollout"]
        assert gap <= LOGPROB_GAP_TOL, f"step {step['step']}: engine vs trainer log-probs differ by {gap} per token"
    print("GPU smoke:", [{key: step[key] for key in ("step", "weight_version", "grad_norm",
                                                    "logprob_gap_train_vs_rollout")} for step in steps])

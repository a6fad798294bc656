"""Megatron actor on CPU/gloo under TP=2, PP=2 and DP=2, each launch grouping several checks (tests/workers).

Tolerances: fp32 everywhere; logits and log-probs 1e-5 absolute (observed ~2e-7: the same math summed in another
order), gradients 1e-5 relative (the fused output layer and log-probs against GPTModel's own output layer and a full
softmax included, tied and untied; with and without sequence parallelism at the output layer), weights after 3
optimizer steps 1e-6 absolute against a single-process transformers reference (observed ~1e-8), and a resharded
checkpoint load bit-identical. Every tensor reaching the
model or the loss was moved to the model's device (checked with tests/workers/emulated_device.py standing in for
CUDA), in the forward-only pass and in the update. The actor and the reference are built as Megatron-LM builds a
model: every parameter and buffer on the actor's device (the `meta` device proves the move on the CPU) and in the
bf16/fp16 training dtype.
"""

from pathlib import Path

import pytest

from tests.launch import run_torchrun

WORKER = Path(__file__).parent / "workers" / "actor_checks.py"


def assert_checks(output: str, names: list[str]):
    for name in names:
        assert f"CHECK {name} ok" in output, f"check {name} did not pass:\n{output[-6000:]}"


@pytest.fixture(scope="module")
def tp2_checkpoint(tiny_models, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("ckpt") / "tp2"
    output = run_torchrun(WORKER, 2, ["--models", tiny_models, "--tp", 2, "--pp", 1, "--checks",
                                      "hf_logits,packed_equals_padded,vocab_parallel_logprobs,output_layer_input,"
                                      "fused_equals_unfused,training,device_move,model_placement",
                                      "--save-ckpt", checkpoint])
    return checkpoint, output


def test_tp2_logits_match_transformers_fused_output_equals_unfused_packed_equals_padded_training_matches_reference(
        tp2_checkpoint):
    _, output = tp2_checkpoint
    assert_checks(output, ["hf_logits_qwen2", "hf_logits_qwen3", "hf_logits_llama", "packed_logprobs",
                           "packed_grads", "vocab_parallel_logprobs_tp2", "output_layer_input_sp0",
                           "output_layer_input_sp1", "fused_equals_unfused_qwen2", "fused_equals_unfused_qwen3",
                           "training_matches_reference", "dist_checkpoint_saved", "device_move", "model_placement"])


def test_pp2_logits_match_transformers_fused_output_equals_unfused_trains_and_loads_tp2_checkpoint(tiny_models,
                                                                                                   tp2_checkpoint):
    checkpoint, _ = tp2_checkpoint
    output = run_torchrun(WORKER, 2, ["--models", tiny_models, "--tp", 1, "--pp", 2, "--checks",
                                      "hf_logits,packed_equals_padded,fused_equals_unfused,training,resharded_load,"
                                      "device_move", "--load-ckpt", checkpoint])
    assert_checks(output, ["hf_logits_qwen2", "hf_logits_qwen3", "hf_logits_llama", "packed_logprobs",
                           "packed_grads", "fused_equals_unfused_qwen2", "fused_equals_unfused_qwen3",
                           "training_matches_reference", "resharded_load", "device_move"])


def test_dp2_distributed_optimizer_matches_reference_loads_tp2_checkpoint_d3s_selects_over_the_step_fp16_scales(
        tiny_models, tp2_checkpoint):
    checkpoint, _ = tp2_checkpoint
    output = run_torchrun(WORKER, 2, ["--models", tiny_models, "--tp", 1, "--pp", 1, "--checks",
                                      "hf_logits,vocab_parallel_logprobs,training,resharded_load,"
                                      "d3s_tokens_over_data_parallel,fp16_loss_scaling,model_placement",
                                      "--load-ckpt", checkpoint])
    assert_checks(output, ["hf_logits_qwen2", "vocab_parallel_logprobs_tp1", "training_matches_reference",
                           "resharded_load", "d3s_tokens_over_data_parallel", "fp16_loss_scaling", "model_placement"])
    assert "dp=2" in output

"""Megatron-LM's activation recompute through the actor on the CPU, and the memory plan's count of what autograd
keeps, in one torchrun launch of 2 ranks (tests/workers/recompute_checks.py).

Recompute: full (uniform in units of 1 and 2 layers, block of 1 layer) and selective, each against no recompute, at
TP 1 (DP 2) and TP 2. Tolerance: none. fp32 on the CPU, the recomputed forward runs the same kernels on the same
inputs in the same order, so the loss and every gradient are bitwise equal; the worker also proves the recompute ran
(the recomputed modules' forward runs twice per micro-batch). It runs through megatron-core's own
`tensor_parallel.checkpoint`, whose CUDA RNG bookkeeping the CPU mode stands in for (platform/cpu.py, assumption 6).

The plan: the bytes a layer keeps for backward, per token, without recompute and under each setting, at TP 1 and 2,
equal launch/memory_plan.py's figures (its CPU variant: torch's composite RMSNorm on the CPU keeps fp32 copies where
the GPU's fused kernel keeps the input), up to a few bytes of fixed-size tensors."""

from pathlib import Path

from tests.launch import run_torchrun

WORKER = Path(__file__).parent / "workers" / "recompute_checks.py"


def test_recompute_gives_the_loss_and_gradients_of_none_and_the_memory_plan_counts_what_autograd_keeps(tiny_models):
    output = run_torchrun(WORKER, 2, ["--models", tiny_models, "--checks", "recompute_equals_none,saved_activations"],
                          timeout=300)
    for tp in (1, 2):
        assert f"CHECK recompute_equals_none_tp{tp} ok full-uniform-1, full-uniform-2, full-block-1, selective" in \
            output, output[-4000:]
        assert f"CHECK saved_activations_tp{tp} ok" in output, output[-4000:]

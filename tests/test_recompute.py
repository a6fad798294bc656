"""Megatron-LM's activation recompute through the actor on the CPU: full (uniform in units of 1 and 2 layers, block
of 1 layer) and selective, each against no recompute, at TP 1 (DP 2) and TP 2, in one torchrun launch
(tests/workers/recompute_checks.py).

Tolerance: none. fp32 on the CPU, the recomputed forward runs the same kernels on the same inputs in the same order,
so the loss and every gradient are bitwise equal; the worker also proves the recompute ran (the recomputed modules'
forward runs twice per micro-batch). It runs through megatron-core's own `tensor_parallel.checkpoint`, whose CUDA
RNG bookkeeping the CPU mode stands in for (platform/cpu.py, assumption 6)."""

from pathlib import Path

from tests.launch import run_torchrun

WORKER = Path(__file__).parent / "workers" / "recompute_checks.py"


def test_full_and_selective_recompute_give_the_loss_and_gradients_of_no_recompute_at_tp1_and_tp2(tiny_models):
    output = run_torchrun(WORKER, 2, ["--models", tiny_models, "--checks", "recompute_equals_none"], timeout=300)
    for tp in (1, 2):
        assert f"CHECK recompute_equals_none_tp{tp} ok full-uniform-1, full-uniform-2, full-block-1, selective" in \
            output, output[-4000:]

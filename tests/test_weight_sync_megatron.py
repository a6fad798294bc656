"""A TP=2 (then PP=2) Megatron actor under torchrun syncs its trained weights into the embedded engine running in
another process; the engine then scores and generates exactly as the actor does (tests/workers/weight_sync_checks.py).

Tolerance: 1e-5 absolute on fp32 log-probs (Megatron's TP/PP forward vs transformers in the engine).
"""

from pathlib import Path

from tests.launch import run_torchrun

WORKER = Path(__file__).parent / "workers" / "weight_sync_checks.py"


def test_megatron_tp2_then_pp2_actor_syncs_to_engine_logprobs_match_generation_works_version_advances(tiny_models):
    output = run_torchrun(WORKER, 2, ["--models", tiny_models, "--tp", 2, "--pp", 1, "--checks", "engine_sync",
                                      "--layouts", "2x1,1x2"], timeout=240)
    for layout, version in (("tp2_pp1", 1), ("tp1_pp2", 2)):
        for check in ("synced_logprobs", "generation_greedy_equals_megatron_argmax", "generation_sampled_logprobs"):
            assert f"CHECK {check}_{layout} ok" in output, f"{check}_{layout} did not pass:\n{output[-6000:]}"
        assert f"weight_version={version}" in output

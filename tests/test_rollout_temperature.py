"""Log-probs at the rollout temperature: the trainer's are those of logits / --rollout-temperature, which the engines
report, so that the rollout correction's ratios carry only the gap between engine and trainer.

- A Megatron actor (TP=2, torchrun) computes the log-probs of the embedded engine's seeded samples at temperatures
  0.6, 1.0 and 0 (greedy) as the trainer does, and they equal the engine's (tests/workers/temperature_checks.py);
  the same check against vLLM's CPU server runs in tests/test_vllm_backend.py on its server.
- The embedded default trained at --rollout-temperature 0.6: the gap between the update's log-probs and the engine's
  is what fp32 leaves (as at temperature 1; observed ~1.6e-7), where a trainer without the temperature showed a mean
  gap of 0.18-0.20 per token on the same run (docs/rollout.md).

Tolerances: 1e-5 absolute per token (fp32, as every engine-vs-trainer log-prob check here); 1e-4 for the run's mean
gap (test_vllm_backend's for its run at temperature 1).
"""

from pathlib import Path

from megatron_dppo.rollout.launcher import launch_embedded_engine
from tests.launch import finish, run_torchrun, start_torchrun
from tests.test_trainer import ENTRY, SHORT, read_metrics

WORKER = Path(__file__).parent / "workers" / "temperature_checks.py"
RUN_GAP_TOL = 1e-4


def assert_trainer_logprobs_equal_the_engines(models: Path, url: str, api: str) -> None:
    """The worker's checks at 0.6, 1.0 and 0 against the engine at `url` (serving `models`' weights)."""
    output = run_torchrun(WORKER, 2, ["--models", models, "--tp", 2, "--checks", "engine_temperature",
                                      "--engine-url", url, "--api", api], timeout=300)
    for temperature in (0.6, 1.0, 0.0):
        check = f"CHECK {api}_temperature_{temperature}_trainer_equals_engine ok"
        assert check in output, f"{check} missing:\n{output[-6000:]}"


def test_trainer_logprobs_equal_the_embedded_engines_at_temperatures_0_6_1_and_greedy(tiny_models):
    model = tiny_models / "qwen3"
    with launch_embedded_engine(str(model), startup_timeout_s=120, enable_deterministic_inference=True) as handle:
        assert_trainer_logprobs_equal_the_engines(model, handle.url, "sglang")


def test_embedded_default_at_temperature_0_6_trains_with_the_engines_own_logprobs(tmp_path):
    # no warm start (the random model's groups all score 0): without the DAPO filter and pruning, they still train
    process = start_torchrun(ENTRY, 2, [*SHORT, "--warm-start-steps", "0", "--rollout-temperature", "0.6",
                                        "--no-dapo-filter", "--algorithm", "grpo", "--train-iters", "2",
                                        "--cache-dir", tmp_path / "cache", "--log-dir", tmp_path / "log"])
    output = finish(process, 600, "the embedded default at temperature 0.6")
    assert process.returncode == 0, f"exit {process.returncode}:\n{output[-8000:]}"
    trained = [m for m in read_metrics(tmp_path / "log") if not m["skipped_update"]]
    assert trained, "no step trained"
    for metrics in trained:
        assert metrics["logprob_gap_train_vs_rollout"] < RUN_GAP_TOL, metrics

"""An engine killed mid-generation: supervised, it comes back with the synced weights; unsupervised, a clear error."""

import os
import signal
import threading
import time

import pytest
import torch

from megatron_dppo.rollout.client import RolloutClient, RolloutServerError, SamplingParams
from megatron_dppo.rollout.launcher import ServerHandle, ServerPool, launch_embedded_engine
from megatron_dppo.rollout.weight_sync import WeightSyncer
from tests.test_rollout_engine import save_tiny_model, sequence_logprobs
from tests.test_weight_sync import PROBES, engine_probe_logprobs, perturbed_model

# long enough that the kill lands mid-generation: 128 sequences of 240 tokens take the engine's own decode path
# several seconds on 2 cores (16 sequences finished within the 0.3 s before the kill)
LONG = SamplingParams(max_new_tokens=240)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]] * 8


def kill_after(handle: ServerHandle, delay_s: float) -> threading.Thread:
    pid = handle.process.pid

    def kill():
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


def test_killed_engine_is_restarted_resynced_and_the_request_retried(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    trainer = perturbed_model(model_dir, seed=5)
    with launch_embedded_engine(model_dir, startup_timeout_s=120) as engine:
        syncer = WeightSyncer([engine.url], timeout_s=60)
        syncer.sync(trainer.state_dict().items(), version=1)
        pool = ServerPool([engine], weight_syncer=syncer,
                          resync=lambda: syncer.sync(trainer.state_dict().items(), version=syncer.last_version))
        client = RolloutClient(pool.urls, max_retries=2, request_timeout_s=60, supervisor=pool)
        old_pid = engine.process.pid
        killer = kill_after(engine, 0.3)
        completions = client.generate(PROMPTS, LONG, n=4)
        killer.join()
        syncer.destroy_group()

        assert engine.restarts == 1 and engine.process.pid != old_pid
        assert len(completions) == 4 * len(PROMPTS) and all(len(c.output_ids) == 240 for c in completions)
        assert all(c.weight_version == "1" for c in completions)
        # the restarted engine holds the synced weights, not the ones on disk
        for got, probe in zip(engine_probe_logprobs(engine.url), PROBES):
            torch.testing.assert_close(got, sequence_logprobs(trainer, probe[:1], probe[1:]), atol=1e-5, rtol=0)
        for completion in completions:
            prompt = PROMPTS[completion.prompt_index]
            torch.testing.assert_close(torch.tensor(completion.output_logprobs),
                                       sequence_logprobs(trainer, prompt, completion.output_ids), atol=1e-5, rtol=0)


def test_killed_engine_without_supervision_raises_an_error_naming_the_server(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    with launch_embedded_engine(model_dir, startup_timeout_s=120) as engine:
        client = RolloutClient([engine.url], max_retries=2, request_timeout_s=30, retry_backoff_s=0.1)
        killer = kill_after(engine, 0.3)
        start = time.monotonic()
        with pytest.raises(RolloutServerError, match=f"failed after 3 attempts.*{engine.url}"):
            client.generate(PROMPTS, LONG, n=4)
        killer.join()
        assert time.monotonic() - start < 30  # bounded: retries with backoff, no hang
        with pytest.raises(RolloutServerError, match="cannot be restarted from here"):
            ServerPool([ServerHandle(engine.url)]).ensure_alive(engine.url)

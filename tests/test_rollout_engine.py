"""The embedded engine speaks SGLang's /generate layout and samples what the model says it samples."""

import threading
import time

import pytest
import torch

from megatron_dppo.rollout.client import (
    RolloutClient,
    RolloutServerError,
    SamplingParams,
    control_request,
)
from megatron_dppo.rollout.launcher import launch_embedded_engine
from megatron_dppo.servers.embedded.sampling import sample_next_tokens

API_KEY = "test-key"


def save_tiny_model(directory, seed: int = 0, tie_word_embeddings: bool = True) -> str:
    """A 2-layer Qwen2 (hidden 64, vocab 96) saved as an HF model directory; no downloads."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie_word_embeddings, eos_token_id=None)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return str(directory)


def sequence_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The trainer's recomputation: log p(output_t | prompt, output_<t) in one forward pass."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # [T, V]
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logprobs[positions, torch.tensor(output)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("engine_model"))
    # deterministic, as the trainer starts it: only then does a request's sampling_seed act (SGLang's rule)
    with launch_embedded_engine(model_dir, api_key=API_KEY, startup_timeout_s=120,
                                enable_deterministic_inference=True) as handle:
        yield handle, model_dir


@pytest.fixture(scope="module")
def hf_model(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine[1], dtype=torch.float32).eval()


def test_generate_logprobs_at_temperature_one_equal_trainer_recomputation(engine, hf_model):
    handle, _ = engine
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]  # different lengths: left padding must not leak
    completions = RolloutClient([handle.url], api_key=API_KEY).generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=12), n=2)
    assert [(c.prompt_index, c.sample_index) for c in completions] == [(p, s) for p in range(3) for s in range(2)]
    for completion in completions:
        assert len(completion.output_ids) == 12 and completion.finish_reason == "length"
        assert completion.weight_version == "default"
        expected = sequence_logprobs(hf_model, prompts[completion.prompt_index], completion.output_ids)
        torch.testing.assert_close(torch.tensor(completion.output_logprobs), expected, atol=1e-5, rtol=0)


def test_seeded_generation_is_reproducible_and_independent_of_the_other_requests_in_the_batch(engine, hf_model):
    handle, _ = engine
    client = RolloutClient([handle.url], api_key=API_KEY)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11)
    first = client.generate(prompts, params, n=3)
    again = client.generate(prompts, params, n=3)
    assert [(c.output_ids, c.output_logprobs) for c in first] == [(c.output_ids, c.output_logprobs) for c in again]
    assert [(c.prompt_index, c.sample_index) for c in first] == [(p, s) for p in range(3) for s in range(3)]
    assert len({tuple(c.output_ids) for c in first[:3]}) > 1, "the samples of one prompt must differ"
    # prompt 0 alone (a batch of 3 sequences instead of 9) has the same seeds, hence the same samples
    alone = client.generate(prompts[:1], params, n=3)
    assert [c.output_ids for c in alone] == [c.output_ids for c in first[:3]]
    for completion in first:
        expected = sequence_logprobs(hf_model, prompts[completion.prompt_index], completion.output_ids)
        torch.testing.assert_close(torch.tensor(completion.output_logprobs), expected, atol=1e-5, rtol=0)


def test_without_deterministic_inference_the_sampling_seed_is_ignored_as_sglang_does(engine):
    from tests.test_weight_sync import served_engine

    prompts, params = [[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=10, seed=11)
    with served_engine(engine[1]) as (_, url):  # started without --enable-deterministic-inference
        first, again = (RolloutClient([url]).generate(prompts, params, n=2) for _ in range(2))
    assert [c.output_ids for c in first] != [c.output_ids for c in again]


def test_greedy_generation_equals_hf_argmax_and_batched_layout_matches_sglang(engine, hf_model):
    handle, _ = engine
    body = control_request(handle.url, "/generate", {
        "input_ids": [[3, 4, 5], [6, 7]], "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "n": 2},
        "return_logprob": True, "logprob_start_len": 0}, api_key=API_KEY)
    assert isinstance(body, list) and len(body) == 4  # SGLang order: both prompts for sample 0, then sample 1
    prompts = [[3, 4, 5], [6, 7], [3, 4, 5], [6, 7]]
    for prompt, output in zip(prompts, body):
        ids = list(prompt)
        for _ in range(5):
            with torch.no_grad():
                ids.append(int(hf_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert output["output_ids"] == ids[len(prompt):]
        meta = output["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert [entry[1] for entry in meta["output_token_logprobs"]] == output["output_ids"]
        assert meta["input_token_logprobs"][0] == [None, prompt[0], None]  # first prompt token has no logprob
        prompt_logprobs = sequence_logprobs(hf_model, prompt[:1], prompt[1:])
        got = torch.tensor([entry[0] for entry in meta["input_token_logprobs"][1:]])
        torch.testing.assert_close(got, prompt_logprobs, atol=1e-5, rtol=0)


def test_stop_token_ends_generation_with_sglang_finish_reason(engine):
    handle, _ = engine
    first = control_request(handle.url, "/generate", {"input_ids": [8, 9], "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 6}}, api_key=API_KEY)["output_ids"]
    stop = first[2]
    body = control_request(handle.url, "/generate", {"input_ids": [8, 9], "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 6, "stop_token_ids": [stop]}}, api_key=API_KEY)
    cut = first.index(stop)
    assert body["output_ids"] == first[:cut + 1]  # the matched stop token is part of the output, as in SGLang
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_api_key_is_required_except_for_health(engine):
    handle, _ = engine
    control_request(handle.url, "/health_generate", None, "GET")
    with pytest.raises(RolloutServerError, match="HTTP 401"):
        control_request(handle.url, "/model_info", None, "GET")
    with pytest.raises(RolloutServerError, match="failed after 1 attempts"):
        RolloutClient([handle.url], max_retries=0).generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_bad_request_is_answered_with_a_clear_400(engine):
    handle, _ = engine
    with pytest.raises(RolloutServerError, match=r"HTTP 400.*input_ids must be a list of integers in \[0, 96\)"):
        control_request(handle.url, "/generate", {"input_ids": [500]}, api_key=API_KEY)
    with pytest.raises(RolloutServerError, match="HTTP 400.*not supported"):
        control_request(handle.url, "/generate", {"input_ids": [1], "sampling_params": {"min_p": 0.1}},
                        api_key=API_KEY)


def run_in_thread(fn):
    result = {}

    def target():
        try:
            result["value"] = fn()
        except Exception as error:
            result["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


def test_pause_abort_ends_running_requests_and_retract_resumes_them_after_continue(engine):
    handle, _ = engine
    long_request = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 240, "ignore_eos": True},
                    "return_logprob": True}

    def wait_until_running():  # /flush_cache is refused exactly while a batch runs
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                control_request(handle.url, "/flush_cache", None, "GET", api_key=API_KEY)
            except RolloutServerError:
                return
            time.sleep(0.005)
        raise AssertionError("the long request never started running")

    thread, result = run_in_thread(lambda: control_request(handle.url, "/generate", long_request, api_key=API_KEY))
    wait_until_running()
    control_request(handle.url, "/pause_generation", {"mode": "abort"}, api_key=API_KEY)
    thread.join(timeout=30)
    assert result["value"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["value"]["output_ids"]) < 240
    control_request(handle.url, "/continue_generation", {}, api_key=API_KEY)

    thread, result = run_in_thread(lambda: control_request(handle.url, "/generate", long_request, api_key=API_KEY))
    wait_until_running()
    control_request(handle.url, "/pause_generation", {"mode": "retract"}, api_key=API_KEY)
    control_request(handle.url, "/flush_cache", None, "GET", api_key=API_KEY)  # allowed while paused
    thread.join(timeout=0.5)
    assert thread.is_alive(), "a retracted request must wait for /continue_generation"
    control_request(handle.url, "/continue_generation", {}, api_key=API_KEY)
    thread.join(timeout=60)
    output = result["value"]
    assert output["meta_info"]["finish_reason"] == {"type": "length", "length": 240}
    assert len(output["output_ids"]) == len(output["meta_info"]["output_token_logprobs"]) == 240


def test_sampler_top_k_one_is_greedy_and_top_p_keeps_the_smallest_sufficient_prefix():
    uniforms = torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    ones = torch.ones(4000)
    tokens, logprobs = sample_next_tokens(logits, ones, ones, torch.ones(4000, dtype=torch.long), uniforms)
    assert (tokens == 0).all()
    torch.testing.assert_close(logprobs, torch.full((4000,), torch.log(torch.tensor(0.5)).item()))
    tokens, _ = sample_next_tokens(logits, ones, torch.full((4000,), 0.7), torch.full((4000,), -1), uniforms)
    counts = torch.bincount(tokens, minlength=4).float() / 4000
    assert counts[2:].sum() == 0  # 0.5 + 0.3 already reach 0.7
    assert abs(counts[0] - 0.5 / 0.8) < 0.03  # 4000 draws: the standard error is 0.008
    tokens, _ = sample_next_tokens(logits, ones, ones, torch.full((4000,), -1), uniforms)
    counts = torch.bincount(tokens, minlength=4).float() / 4000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)  # unfiltered law
    tokens, logprobs = sample_next_tokens(logits, torch.zeros(4000), ones, torch.full((4000,), -1), uniforms)
    assert (tokens == 0).all()


def test_workers_split_a_large_batch_and_sample_what_one_worker_samples(tmp_path):
    """Two workers decode the two halves of a batch; every sample equals the one-worker sample of the same seed
    (same tokens; log-probs within 1e-5: a half batch is a smaller matmul, which may round differently)."""
    from megatron_dppo.servers.embedded.engine import EmbeddedEngine
    from megatron_dppo.servers.embedded.request_parser import Sequence, SequenceParams
    from megatron_dppo.servers.embedded.scheduler import MIN_ROWS_PER_WORKER

    model_dir = save_tiny_model(tmp_path / "model")
    one = EmbeddedEngine(model_dir, deterministic_inference=True)
    two = EmbeddedEngine(model_dir, deterministic_inference=True, workers=2)
    parts = []
    generator = two.scheduler.batch_generator
    decode_part = generator.generate
    generator.generate = lambda part, interrupt: (parts.append(len(part)), decode_part(part, interrupt))

    def samples(engine):
        batch = [Sequence(rid=str(i), prompt_ids=[1 + i % 5, 2, 3], params=SequenceParams(max_new_tokens=12),
                          return_logprob=True, logprob_start_len=-1, seed=1000 + i)
                 for i in range(2 * MIN_ROWS_PER_WORKER + 1)]
        engine.scheduler.decode(batch)
        return batch

    alone, split = samples(one), samples(two)
    assert parts == [MIN_ROWS_PER_WORKER, MIN_ROWS_PER_WORKER + 1]
    assert [seq.output_ids for seq in split] == [seq.output_ids for seq in alone]
    assert len({tuple(seq.output_ids) for seq in alone}) > 1  # seeds differ, samples differ
    torch.testing.assert_close(torch.tensor([seq.output_logprobs for seq in split]),
                               torch.tensor([seq.output_logprobs for seq in alone]), atol=1e-5, rtol=0)

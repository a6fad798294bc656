"""The embedded engine's /generate is at least as strict as SGLang 0.5.23's: every request SGLang would refuse, and
those that would make the engine hold more than its KV budget, are answered 400 with the reason before anything is
queued; under a concurrent mix of valid and malformed requests, every malformed one gets a 4xx, every valid one
completes, and the engine serves afterwards.

Which SGLang rule each refusal mirrors (sglang 0.5.23, read from the installed wheel):
- `SamplingParams.verify` (srt/sampling/sampling_params.py): temperature a non-negative finite number; top_p in
  (0, 1]; top_k -1 or >= 1; max_new_tokens >= 0; sampling_seed an integer in [-2**63, 2**63 - 1];
- `TokenizerManager._validate_one_request` (srt/managers/tokenizer_manager.py): a prompt shorter than the context
  length, and prompt + max_new_tokens within it ("Requested token count exceeds the model's maximum context
  length"); input ids inside the vocabulary (`_validate_input_ids_in_vocab`);
- `GenerateReqInput._handle_parallel_sampling` (srt/managers/io_struct.py): every sampling_params entry has the same
  n;
- the scheduler's KV-memory refusal ("Request prompt exceeds the KV memory budget", srt/managers/scheduler.py):
  here for the whole request, against --max-total-tokens.
Beyond SGLang: n >= 1 and n <= --max-n (SGLang has no cap), and values of the wrong JSON type (a number in a string,
a bool for an integer, NaN or infinity anywhere) are refused rather than coerced.
"""

import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_dppo.rollout.launcher import launch_embedded_engine
from megatron_dppo.servers.embedded.engine import EmbeddedEngine
from megatron_dppo.servers.embedded.request_parser import RequestError
from tests.test_rollout_engine import save_tiny_model

KV_BUDGET, MAX_N = 4096, 8  # the engines here: --max-total-tokens 4096 --max-n 8 (vocab 96, context 256)
GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "n": 2, "ignore_eos": True}}

MALFORMED = [  # (body, what the 400 says)
    ({"input_ids": [1], "sampling_params": {"temperature": "nan"}}, "temperature must be a finite number"),
    ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}}, "temperature must be a finite number"),
    ({"input_ids": [1], "sampling_params": {"temperature": float("inf")}}, "temperature must be a finite number"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "need temperature >= 0"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "0 < top_p <= 1"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "0 < top_p <= 1"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k -1 or >= 1"),
    ({"input_ids": [1], "sampling_params": {"top_k": 2.5}}, "top_k must be a JSON integer"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens >= 0"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens must be a JSON integer"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "n >= 1"),
    ({"input_ids": [1], "sampling_params": {"n": 100000}}, "n=100000 samples per prompt exceeds this engine's --max-n"),
    ({"input_ids": [1], "sampling_params": {"n": True}}, "n must be a JSON integer"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": 2**63}}, "sampling_seed must be in [-2**63"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": "7"}}, "sampling_seed must be a JSON integer"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [-1]}}, "stop_token_ids must be a list of integers"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos must be a JSON bool"),
    ({"input_ids": [1], "sampling_params": {"min_p": 0.1}}, "['min_p'] are not supported"),
    ({"input_ids": [1], "sampling_params": [1]}, "sampling_params must be a JSON object"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "every sampling_params entry must have"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "1 sampling_params for 2 prompts"),
    ({"input_ids": [500]}, "input_ids must be a list of integers in [0, 96)"),
    ({"input_ids": [True, 2]}, "input_ids must be a list of integers in [0, 96)"),
    ({"input_ids": "1 2 3"}, "input_ids must be a list of integers"),
    ({"input_ids": [[1], "x"]}, "input_ids must be a list of integers"),
    ({"input_ids": [[1], []]}, "at least one token per prompt"),
    ({"text": "hello"}, "needs `input_ids`"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob must be a JSON bool"),
    ({"input_ids": [1, 2], "logprob_start_len": 2}, "logprob_start_len=2 >= prompt length 2"),
    ({"input_ids": [1, 2], "stream": True}, "stream=true is not supported"),
    ({"input_ids": [1] * 200, "sampling_params": {"max_new_tokens": 57}}, "exceed the model's context length of 256"),
    ({"input_ids": [1] * 256, "sampling_params": {"max_new_tokens": 0}}, "exceed the model's context length of 256"),
    ({"input_ids": [[1] * 100] * 8, "sampling_params": {"max_new_tokens": 100, "n": 4}},
     "needs 6400 KV-cache token slots"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("requests_model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    return EmbeddedEngine(model_dir, max_total_tokens=KV_BUDGET, max_n=MAX_N)


@pytest.mark.parametrize("body, message", MALFORMED, ids=[message[:40] for _, message in MALFORMED])
def test_a_request_sglang_would_refuse_or_over_the_kv_budget_is_refused_with_its_reason(engine, body, message):
    with pytest.raises(RequestError) as refused:
        engine.request_parser.parse(json.loads(json.dumps(body)))  # as the route receives it (NaN survives as NaN)
    assert message in str(refused.value)


def test_requests_at_the_limits_are_accepted_in_sglang_order(engine):
    at_budget = {"input_ids": [[1] * 28] * 4, "sampling_params": {"max_new_tokens": 100, "n": MAX_N}}
    sequences, single = engine.request_parser.parse(at_budget)  # 4 prompts x 8 samples x (28 + 100) = 4096 slots
    assert len(sequences) == 32 and not single
    assert engine.request_parser.parse({"input_ids": [1] * 255, "sampling_params": {"max_new_tokens": 1}})[1]
    sequences, _ = engine.request_parser.parse({"input_ids": [[1], [2]], "sampling_params": {
        "n": 2, "temperature": 0, "top_k": 1 << 30, "sampling_seed": -2**63, "stop_token_ids": [5]}})
    assert [seq.prompt_ids for seq in sequences] == [[1], [2], [1], [2]]
    assert sequences[0].params.top_k == -1 and sequences[0].params.stop_token_ids == {5}


def post(url: str, body) -> tuple[int, object]:
    """POST `body` as JSON (NaN written as NaN, as Python's encoder does); returns (status, parsed answer)."""
    request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def test_concurrent_valid_and_malformed_requests_each_get_their_answer_and_the_engine_serves_after(model_dir):
    """A fixed mix on loopback, 16 at a time: each malformed request (every case above, twice) gets 400 with its
    reason, each of the 64 valid ones its 2 x 4 tokens, then the engine still generates."""
    mix = [(body, message) for body, message in MALFORMED * 2] + [(GOOD, None)] * 64
    random.Random(0).shuffle(mix)
    with launch_embedded_engine(model_dir, startup_timeout_s=120, max_total_tokens=KV_BUDGET,
                                max_n=MAX_N) as handle, ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda item: post(handle.url, item[0]), mix, timeout=300))
        for (body, message), (status, answer) in zip(mix, answers):
            if message is None:
                assert status == 200, answer
                assert [len(output["output_ids"]) for output in answer] == [4, 4]
            else:
                assert status == 400 and message in answer["error"]["message"], (body, status, answer)
        status, answer = post(handle.url, GOOD)
        assert status == 200 and len(answer) == 2
        assert handle.alive()

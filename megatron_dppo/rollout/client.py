"""Async HTTP client for rollout servers: SGLang's /generate (SGLang itself, the embedded engine) or, through a
different request/response layout (`api=`, see rollout/vllm.py), vLLM's /v1/completions.

prompts ──► one request per prompt (input_ids, n samples, per-token log-probs), laid out by the server API
        ──► spread over servers (least requests in flight) under a concurrency limit
        ──► completions yielded as each request finishes

Invariants:
- every wait is bounded: each request has `request_timeout_s`, each failure is retried at most `max_retries`
  times, then `RolloutServerError` names the server URL and the cause; an answer that is not JSON or not the
  layout the API parses (a truncated or garbled body) is a failure like an HTTP error, and is retried;
- a failed request is retried on the next server; with a `supervisor` (launcher.ServerPool) the dead server is
  restarted and re-synced before the retry;
- payload fields are exactly those of SGLang's `GenerateReqInput` / `SamplingParams` (checked against the
  installed wheel by tests/test_rollout_contract.py); vLLM's are checked against a real vLLM server
  (tests/test_vllm_backend.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol


class RolloutServerError(RuntimeError):
    """A rollout server could not be reached or answered with an error."""


@dataclass
class SamplingParams:
    """Maps onto SGLang's `sampling_params` dict."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] | None = None
    # Reproducible sampling: each sample gets its own SGLang `sampling_seed`, derived from this seed, the prompt
    # index and the sample index, and one batched request per server keeps the batch composition fixed.
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be -1 (all tokens) or >= 1")
        if self.max_new_tokens < 0:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 0")

    def to_sglang(self, n: int = 1) -> dict[str, Any]:
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "n": n,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params

    def sample_seed(self, prompt_index: int, sample_index: int, n: int) -> int:
        """The sampling_seed of one sample: distinct per (prompt, sample), stable across runs."""
        return (self.seed * 1_000_003 + prompt_index * n + sample_index) % (2**63 - 1)


@dataclass
class Completion:
    prompt_index: int  # index into the prompts list given to generate
    sample_index: int  # 0..n-1
    output_ids: list[int]  # response token ids (no prompt)
    output_logprobs: list[float]  # one per output id, from the rollout engine
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None


class Supervisor(Protocol):
    """What the client needs from launcher.ServerPool: make a failed server healthy again (bounded)."""

    def ensure_alive(self, url: str) -> None: ...


@dataclass
class SequenceRequest:
    """One sample to generate on its own terms: its input (a prompt, or a prompt and the response so far, which
    generation continues), its sampling seed and how many tokens it may add (partial rollouts)."""

    input_ids: list[int]
    seed: int
    max_new_tokens: int


def seeded_requests(prompts: list[list[int]], first_prompt_index: int, params: SamplingParams,
                    n: int) -> list[SequenceRequest]:
    """Every sample of `prompts` in (prompt, sample) order, each with its own sampling seed (params.sample_seed)."""
    return [SequenceRequest(list(input_ids), params.sample_seed(first_prompt_index + offset, sample_index, n),
                            params.max_new_tokens)
            for offset, input_ids in enumerate(prompts) for sample_index in range(n)]


def batch_payload(requests: list[SequenceRequest], params: SamplingParams) -> dict[str, Any]:
    """One /generate body for `requests` (SGLang's batched GenerateReqInput: lists of input_ids and of
    sampling_params), each entry with its own sampling_seed and max_new_tokens."""
    return {"input_ids": [list(request.input_ids) for request in requests],
            "sampling_params": [{**params.to_sglang(1), "max_new_tokens": request.max_new_tokens,
                                 "sampling_seed": request.seed} for request in requests],
            "return_logprob": True}


def seeded_batch_payload(prompts: list[list[int]], first_prompt_index: int, params: SamplingParams,
                         n: int) -> dict[str, Any]:
    """One /generate body for all samples of `prompts`, each sample its own input with its own sampling_seed, in
    (prompt, sample) order."""
    return batch_payload(seeded_requests(prompts, first_prompt_index, params, n), params)


def parse_generate_response(body: Any, prompt_index: int, n: int, url: str) -> list[Completion]:
    """SGLang answers a dict for one sample and a list of n dicts (sample order) for n > 1."""
    outputs = body if isinstance(body, list) else [body]
    if len(outputs) != n:
        raise RolloutServerError(f"{url}/generate returned {len(outputs)} outputs for n={n}")
    completions = []
    for sample_index, output in enumerate(outputs):
        meta = output["meta_info"]
        triples = meta.get("output_token_logprobs") or []  # [[logprob, token_id, text-or-None], ...]
        output_ids = list(output["output_ids"])
        if [token for _, token, _ in triples] != output_ids:
            raise RolloutServerError(f"{url}/generate: output_token_logprobs do not match output_ids")
        finish = meta.get("finish_reason") or {}
        completions.append(Completion(
            prompt_index=prompt_index,
            sample_index=sample_index,
            output_ids=output_ids,
            output_logprobs=[float(logprob) for logprob, _, _ in triples],
            finish_reason=finish.get("type", "abort") if isinstance(finish, dict) else str(finish),
            weight_version=meta.get("weight_version"),
        ))
    return completions


class GenerateAPI(Protocol):
    """A server's request/response layout for generation: the one switch between rollout backends."""

    path: str  # the route one request goes to
    # True: reproducible sampling needs a fixed batch (SGLang's sampling_seed), so seeded generation goes through
    # generate_seeded's one batched request per server; False: each request carries its own seed
    seeded_batches: bool

    def request(self, input_ids: list[int], params: SamplingParams, n: int, prompt_index: int,
                seed: int | None = None) -> dict[str, Any]:
        """`seed`, when given, is the draw seed of a sample continued from its prefix, in place of
        params.sample_seed(prompt_index, 0, n); each backend turns it into what its server needs (SGLang: the seed,
        hashed with positions server-side; vLLM: `continuation_seed` of the seed and the prefix)."""

    def parse(self, body: Any, prompt_index: int, n: int, url: str) -> list[Completion]: ...


class SGLangGenerateAPI:
    """SGLang's /generate (also served by the embedded engine); the default."""

    path = "/generate"
    seeded_batches = True

    def request(self, input_ids: list[int], params: SamplingParams, n: int, prompt_index: int,
                seed: int | None = None) -> dict[str, Any]:
        requests = seeded_requests([input_ids], prompt_index, params, n)
        if seed is not None:
            for sample_index, request in enumerate(requests):
                request.seed = seed + sample_index
        return batch_payload(requests, params)

    def parse(self, body: Any, prompt_index: int, n: int, url: str) -> list[Completion]:
        return parse_generate_response(body, prompt_index, n, url)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def control_request(url: str, path: str, payload: dict | None = None, method: str = "POST",
                    timeout_s: float = 60.0, api_key: str | None = None) -> Any:
    """Blocking JSON call to a control endpoint (pause, flush, weight update); raises RolloutServerError."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **auth_headers(api_key)})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:2000]
        raise RolloutServerError(f"{method} {url}{path} failed with HTTP {error.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as error:
        raise RolloutServerError(f"{method} {url}{path} failed: {error}; is the server running?") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def read_answer(parse: Callable[[Any, str], Any], body: Any, url: str) -> Any:
    """`parse(body, url)`, a body of another layout (a field missing, a wrong type) raising RolloutServerError."""
    try:
        return parse(body, url)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
        raise RolloutServerError(f"{url} answered a malformed body ({type(error).__name__}: {error}): "
                                 f"{str(body)[:200]}") from None


class RolloutClient:
    """Generate n samples per prompt on rollout servers speaking `api` (default SGLang's /generate); see the module
    docstring."""

    def __init__(self, urls: list[str], max_concurrency: int = 32, request_timeout_s: float = 300.0,
                 max_retries: int = 3, api_key: str | None = None, supervisor: Supervisor | None = None,
                 retry_backoff_s: float = 0.5, api: GenerateAPI | None = None):
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL (e.g. http://127.0.0.1:30000)")
        if max_concurrency < 1 or max_retries < 0 or request_timeout_s <= 0:
            raise ValueError(f"RolloutClient: max_concurrency={max_concurrency} must be >= 1, max_retries="
                             f"{max_retries} >= 0 and request_timeout_s={request_timeout_s} > 0")
        self.urls = [url.rstrip("/") for url in urls]
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.api_key = api_key
        self.supervisor = supervisor
        self.retry_backoff_s = retry_backoff_s
        self.api = api or SGLangGenerateAPI()
        self._in_flight = dict.fromkeys(self.urls, 0)

    def _pick_server(self, avoid: set[str]) -> str:
        candidates = [url for url in self.urls if url not in avoid] or self.urls
        return min(candidates, key=lambda url: self._in_flight[url])

    async def _post_generate(self, session, url: str, payload: dict) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with session.post(f"{url}{self.api.path}", json=payload, timeout=timeout,
                                headers=auth_headers(self.api_key)) as response:
            text = await response.text()
            if response.status != 200:
                raise RolloutServerError(f"{url}{self.api.path} failed with HTTP {response.status}: {text[:2000]}")
        try:
            return json.loads(text)
        except ValueError as error:
            raise RolloutServerError(f"{url}{self.api.path} answered a body that is not JSON ({error}): "
                                     f"{text[:200]!r}") from None

    async def _post_with_retries(self, session, payload: dict, what: str, parse: Callable[[Any, str], Any],
                                 first_url: str | None = None):
        """POST the API's route with bounded retries, on another server where there is one (after the supervisor, if
        any, has restarted the failed one). Returns `parse(body, url)`; an answer `parse` cannot read is retried."""
        import aiohttp

        failed: set[str] = set()
        errors = []
        for attempt in range(self.max_retries + 1):
            url = first_url if attempt == 0 and first_url else self._pick_server(failed)
            self._in_flight[url] += 1
            try:
                return read_answer(parse, await self._post_generate(session, url, payload), url)
            except (TimeoutError, aiohttp.ClientError, RolloutServerError) as error:
                errors.append(f"{url}: {type(error).__name__}: {error}")
                failed.add(url)
            finally:
                self._in_flight[url] -= 1
            if attempt == self.max_retries:
                break
            if self.supervisor is not None:
                # Restart (and re-sync) a dead server before retrying; bounded inside the pool.
                await asyncio.to_thread(self.supervisor.ensure_alive, url)
                failed.discard(url)
            await asyncio.sleep(self.retry_backoff_s * 2**attempt)
        raise RolloutServerError(
            f"generate for {what} failed after {len(errors)} attempts; last errors: " + " | ".join(errors[-3:]))

    async def _generate_one(self, session, semaphore, prompt_index: int, input_ids: list[int],
                            params: SamplingParams, n: int) -> list[Completion]:
        # A deterministic server (SGLang's --enable-deterministic-inference, as the trainer starts them) gives every
        # sample without a sampling_seed the same seed, so n unseeded samples of a prompt would be n copies: each
        # sample carries its own seed, drawn fresh here when the caller gave none.
        if params.seed is None:
            params = replace(params, seed=random.getrandbits(62))
        async with semaphore:
            return await self._post_with_retries(session, self.api.request(input_ids, params, n, prompt_index),
                                                 f"prompt {prompt_index}",
                                                 lambda body, url: self.api.parse(body, prompt_index, n, url))

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams,
                        n: int = 1) -> AsyncIterator[Completion]:
        """Yield completions as their requests finish (order not guaranteed)."""
        import aiohttp

        if n < 1:
            raise ValueError(f"n={n} samples per prompt must be >= 1")
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {index} is empty; every prompt needs at least one token id")
        semaphore = asyncio.Semaphore(self.max_concurrency)
        connector = aiohttp.TCPConnector(limit=self.max_concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            tasks = [asyncio.ensure_future(self._generate_one(session, semaphore, index, prompt, params, n))
                     for index, prompt in enumerate(prompts)]
            try:
                for finished in asyncio.as_completed(tasks):
                    for completion in await finished:
                        yield completion
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        """Blocking; sorted by (prompt_index, sample_index). With `params.seed` set, reproducible: every sample is
        seeded by `params.sample_seed`, through `generate_seeded` where the API needs a fixed batch for that."""
        if params.seed is not None and self.api.seeded_batches:
            return self.generate_seeded(prompts, params, n)

        async def collect():
            return [completion async for completion in self.agenerate(prompts, params, n)]

        completions = asyncio.run(collect())
        return sorted(completions, key=lambda c: (c.prompt_index, c.sample_index))

    def generate_seeded(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        """Reproducible generation: contiguous chunks of prompts, one batched request per server, every sample
        seeded by `params.sample_seed`. The same prompts, seed and weights give the same tokens and log-probs."""
        if not self.api.seeded_batches:
            raise ValueError(f"generate_seeded is for APIs whose seeds depend on the batch; {type(self.api).__name__} "
                             "seeds each request: call generate() with params.seed set")
        if n < 1:
            raise ValueError(f"n={n} samples per prompt must be >= 1")
        completions = self.generate_requests(seeded_requests(prompts, 0, params, n), params)
        for index, completion in enumerate(completions):
            completion.prompt_index, completion.sample_index = index // n, index % n
        return completions

    def generate_requests(self, requests: list[SequenceRequest], params: SamplingParams) -> list[Completion]:
        """One sample per request, each with its own input, seed and token budget (params gives the rest); blocking,
        in request order (Completion.prompt_index is the request's index). An API that seeds by batch (SGLang's)
        gets contiguous chunks, one batched request per server, so the same requests give the same samples; the
        others (vLLM's) get one request per sample."""
        for index, request in enumerate(requests):
            if not request.input_ids or request.max_new_tokens < 0:
                raise ValueError(f"request {index} needs at least one input token and max_new_tokens >= 0")

        async def one(session, index: int, request: SequenceRequest, semaphore) -> list[Completion]:
            async with semaphore:
                payload = self.api.request(request.input_ids, replace(params, max_new_tokens=request.max_new_tokens),
                                           1, index, seed=request.seed)
                return await self._post_with_retries(session, payload, f"request {index}",
                                                     lambda body, url: self.api.parse(body, index, 1, url))

        async def batch(session, url_index: int, start: int, part: list[SequenceRequest]) -> list[Completion]:
            def parse(body, url: str) -> list[Completion]:
                outputs = body if isinstance(body, list) else [body]
                if len(outputs) != len(part):
                    raise RolloutServerError(f"{url}/generate returned {len(outputs)} outputs for {len(part)} "
                                             "requests")
                return [completion for offset, output in enumerate(outputs)
                        for completion in parse_generate_response(output, start + offset, 1, url)]

            return await self._post_with_retries(session, batch_payload(part, params),
                                                 f"requests {start}..{start + len(part) - 1}", parse,
                                                 first_url=self.urls[url_index])

        async def collect():
            import aiohttp

            async with aiohttp.ClientSession() as session:
                if self.api.seeded_batches:
                    size = -(-len(requests) // len(self.urls)) if requests else 1
                    parts = [batch(session, number, start, requests[start:start + size])
                             for number, start in enumerate(range(0, len(requests), size))]
                else:
                    semaphore = asyncio.Semaphore(self.max_concurrency)
                    parts = [one(session, index, request, semaphore) for index, request in enumerate(requests)]
                results = await asyncio.gather(*parts)
            return [completion for result in results for completion in result]

        return asyncio.run(collect())

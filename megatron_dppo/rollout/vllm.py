"""vLLM as a second rollout backend behind the RolloutClient interface. NOT VERIFIED HERE (vLLM cannot be
installed on the CPU CI machine); written against vLLM's documented OpenAI-compatible server and its
collective-RPC worker-extension path.

generation:  POST /v1/completions {prompt: [token ids], n, max_tokens, logprobs: 0, return_tokens_as_token_ids}
weight sync: server started with `--worker-extension-cls megatron_dppo.rollout.vllm.WeightUpdateExtension`
             and VLLM_SERVER_DEV_MODE=1; POST /collective_rpc {method, args} runs the extension's methods in
             every worker; the tensors follow as broadcasts from group rank 0, as in weight_sync.py.

Log-probs: vLLM's default `logprobs_mode` is "raw_logprobs" (the model's distribution before temperature),
unlike SGLang's temperature-scaled default; the two agree at temperature 1.0.
"""

from __future__ import annotations

import asyncio

from megatron_dppo.rollout.client import (
    Completion,
    RolloutClient,
    RolloutServerError,
    SamplingParams,
    auth_headers,
    control_request,
)
from megatron_dppo.rollout.weight_sync import (
    Bucket,
    WeightSyncer,
    broadcast_from_trainer,
    init_weight_update_group,
    tensor_nbytes,
    unpack_bucket,
)


def completions_payload(model: str, input_ids: list[int], params: SamplingParams, n: int) -> dict:
    payload = {"model": model, "prompt": list(input_ids), "n": n, "max_tokens": params.max_new_tokens,
               "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
               "logprobs": 0, "return_tokens_as_token_ids": True}
    if params.stop_token_ids:
        payload["stop_token_ids"] = list(params.stop_token_ids)
    return payload


def parse_completions_response(body: dict, prompt_index: int, url: str) -> list[Completion]:
    completions = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []  # "token_id:123" with return_tokens_as_token_ids
        if any(not token.startswith("token_id:") for token in tokens):
            raise RolloutServerError(f"{url}/v1/completions did not return token ids; is vLLM too old?")
        completions.append(Completion(
            prompt_index=prompt_index, sample_index=choice["index"],
            output_ids=[int(token.removeprefix("token_id:")) for token in tokens],
            output_logprobs=[float(value) for value in logprobs.get("token_logprobs") or []],
            finish_reason=choice.get("finish_reason") or "abort", weight_version=None,
        ))
    return completions


class VLLMRolloutClient(RolloutClient):
    """Same interface as RolloutClient; requests go to vLLM's /v1/completions."""

    def __init__(self, urls: list[str], model: str, **kwargs):
        super().__init__(urls, **kwargs)
        self.model = model

    async def _generate_one(self, session, semaphore, prompt_index, input_ids, params, n):
        import aiohttp

        payload = completions_payload(self.model, input_ids, params, n)
        errors = []
        async with semaphore:
            for attempt in range(self.max_retries + 1):
                url = self._pick_server(set())
                try:
                    async with session.post(f"{url}/v1/completions", json=payload, headers=auth_headers(
                            self.api_key), timeout=aiohttp.ClientTimeout(total=self.request_timeout_s)) as response:
                        if response.status != 200:
                            raise RolloutServerError(f"{url}/v1/completions: HTTP {response.status}: "
                                                     f"{(await response.text())[:2000]}")
                        return parse_completions_response(await response.json(), prompt_index, url)
                except (TimeoutError, aiohttp.ClientError, RolloutServerError) as error:
                    errors.append(f"{url}: {type(error).__name__}: {error}")
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
        raise RolloutServerError(f"vLLM generate for prompt {prompt_index} failed: " + " | ".join(errors[-3:]))


class VLLMWeightSyncer(WeightSyncer):
    """WeightSyncer whose control calls go through vLLM's /collective_rpc to WeightUpdateExtension."""

    def _rpc(self, url: str, method: str, *args) -> object:
        result = control_request(url, "/collective_rpc", {"method": method, "args": list(args)},
                                 timeout_s=self.timeout_s, api_key=self.api_key)
        if isinstance(result, str) and "Not Found" in result:
            raise RolloutServerError(f"{url} has no /collective_rpc; start vLLM with VLLM_SERVER_DEV_MODE=1 and "
                                     "--worker-extension-cls megatron_dppo.rollout.vllm.WeightUpdateExtension")
        return result

    def init_group(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from megatron_dppo.rollout.launcher import free_port

        port = self.master_port or free_port()
        world_size = 1 + sum(self.engine_ranks)
        offsets = [1 + sum(self.engine_ranks[:i]) for i in range(len(self.urls))]
        with ThreadPoolExecutor(len(self.urls)) as pool:
            futures = [pool.submit(self._rpc, url, "join_weight_update_group", self.master_address, port, offset,
                                   world_size, self.group_name, self.backend)
                       for url, offset in zip(self.urls, offsets)]
            self.group = init_weight_update_group(self.backend, self.master_address, port, 0, world_size,
                                                  self.group_name, self.timeout_s)
            for future in futures:
                future.result()

    def _send_bucket(self, bucket: Bucket, version: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.urls)) as pool:
            futures = [pool.submit(self._rpc, url, "receive_bucket", bucket.names, bucket.dtypes, bucket.shapes)
                       for url in self.urls]
            broadcast_from_trainer(self.group, bucket.flat)
            for future in futures:
                future.result()

    def sync(self, named_tensors, version):
        """vLLM has no pause/flush/version endpoints in its stable API: send the buckets, then reset the cache."""
        import time

        from megatron_dppo.rollout.weight_sync import SyncStats, prefetch_buckets

        if self.group is None:
            self.init_group()
        start = time.perf_counter()
        total = buckets = tensors = 0
        for bucket in prefetch_buckets(named_tensors, self.bucket_bytes, self.timeout_s):
            self._send_bucket(bucket, str(version))
            total, buckets, tensors = total + bucket.nbytes, buckets + 1, tensors + len(bucket.names)
        for url in self.urls:
            control_request(url, "/reset_prefix_cache", {}, timeout_s=self.timeout_s, api_key=self.api_key)
        self.last_version = str(version)
        return SyncStats(time.perf_counter() - start, total, buckets, tensors, str(version))


class WeightUpdateExtension:
    """Mixed into vLLM's GPU worker by --worker-extension-cls; methods are called through collective_rpc."""

    def join_weight_update_group(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        rank = rank_offset + self.rank  # self.rank: this worker's rank inside the vLLM instance (vLLM worker)
        self._weight_update_group = init_weight_update_group(backend, master_address, master_port, rank,
                                                             world_size, group_name)

    def receive_bucket(self, names, dtypes, shapes):
        import torch

        nbytes = sum(tensor_nbytes(d, s) for d, s in zip(dtypes, shapes))
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._weight_update_group.broadcast(flat, 0).wait()
        self.model_runner.model.load_weights(weights=unpack_bucket(flat, names, dtypes, shapes))

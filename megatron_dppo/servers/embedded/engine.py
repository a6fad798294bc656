"""Embedded rollout server for CPU (or one GPU, --device cuda): SGLang's HTTP endpoints served from an HF transformers
model.

requests ──► RequestParser.parse (request_parser.py) ──► BatchScheduler (scheduler.py): queue ──► batch loop (until
             a quiet millisecond, at most `batch_window_s`) ──► split over the decode workers ──► each:
             BatchGenerator.generate: prefill, then one position per step from its KV cache (decoder.py), every row
             sampled at once (sampling.py) ──► response (request_parser.py)
weights  ──► /init_weights_update_group (once) ──► per sync: /begin_weight_update ──► /update_weights_from_distributed
             per bucket (receive, load by HF name: WeightUpdates, weights.py) ──► /end_weight_update

EmbeddedEngine owns the model and its parts, each built here with what it needs and nothing more: the request
parser (the model's vocabulary and context, the KV budget, --max-n), the batch generator (decoder, prefix cache,
stop ids, seed) inside the scheduler (queue, batch loop, decode workers, pause and continue, the model lock), and
the weight updates (session, groups, bucket buffers, version, loading); routes.py serves them over HTTP.
prefix_cache.py keeps the K/V of chunks that stopped at their token budget, so a request continuing one prefills
only what follows it.

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
- generation and weight loading never overlap (one lock), and every weight load (and /flush_cache) clears the
  prefix cache, so cached K/V never serves weights other than those that computed it; pause(abort) ends running
  sequences with finish_reason "abort", pause(retract) puts them back in the queue with their tokens, resumed on
  continue;
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

Run: python -m megatron_dppo.servers.embedded --model-dir DIR [--host 127.0.0.1] [--port P] [--api-key K]
     [--workers W] [--threads T] [--max-total-tokens KV_BUDGET] [--max-n N] [--disable-radix-cache] [--device cuda]
     [--weight-noise S [--weight-noise-seed N]]
"""


from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from megatron_dppo.servers.embedded.decoder import KVCacheDecoder
from megatron_dppo.servers.embedded.prefix_cache import PrefixCache
from megatron_dppo.servers.embedded.request_parser import DEFAULT_MAX_N, RequestParser, response
from megatron_dppo.servers.embedded.routes import build_app
from megatron_dppo.servers.embedded.scheduler import (
    MAX_BATCH_SIZE,
    MIN_ROWS_PER_WORKER,
    BatchGenerator,
    BatchScheduler,
)
from megatron_dppo.servers.embedded.weights import WeightNoise, WeightUpdates

DEFAULT_KV_CACHE_BYTES = 2**30  # the KV budget's default size: see --max-total-tokens


class EmbeddedEngine:
    """One embedded rollout server: the model, and the parts that parse, schedule, generate and load weights."""

    def __init__(self, model_dir: str, dtype: str = "float32", max_batch_size: int = MAX_BATCH_SIZE,
                 batch_window_s: float = 0.005, seed: int = 0, model_name: str | None = None,
                 deterministic_inference: bool = False, workers: int = 1, max_total_tokens: int | None = None,
                 max_n: int = DEFAULT_MAX_N, prefix_cache: bool = True, weight_noise: float = 0.0,
                 weight_noise_seed: int = 0, device: str = "cpu"):
        """deterministic_inference: SGLang's --enable-deterministic-inference, without which sampling_seed is
        ignored (see the module docstring). workers: a batch of at least MIN_ROWS_PER_WORKER sequences per worker is
        split into that many contiguous parts, decoded concurrently by as many threads. max_total_tokens: the KV
        budget, the cache slots one batch may take (rows x (longest context + largest token budget)) and one
        request may ask for; default: what DEFAULT_KV_CACHE_BYTES hold. max_n: samples per prompt in one request.
        weight_noise: the engine samples from its weights plus seeded Gaussian noise of this size relative to each
        parameter's RMS, at start and after every weight load (WeightNoise, weights.py); 0: off.
        device: where the model runs and decodes ("cpu", or "cuda" for this process's GPU); weights still arrive
        over gloo in host memory and are copied in."""
        if min(workers, max_batch_size, max_n, 1 if max_total_tokens is None else max_total_tokens) < 1:
            raise ValueError(f"--workers {workers}, --max-batch-size {max_batch_size}, --max-n {max_n} and "
                             f"--max-total-tokens {max_total_tokens} must be >= 1")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(model_dir, "config.json").is_file():
            raise FileNotFoundError(f"--model-dir {model_dir} has no config.json; give a saved HF model directory")
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
            raise ValueError(f"--dtype {dtype!r} is not a torch floating dtype (float32, bfloat16, float16)")
        self.model_dir = model_dir
        self.model_name = model_name or model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
        self.decoder = KVCacheDecoder(self.model)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError):
            self.tokenizer = None  # input_ids in, output_ids out; text stays empty
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.model.config.eos_token_id
        eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        max_total_tokens = max_total_tokens or DEFAULT_KV_CACHE_BYTES // self.decoder.kv_bytes_per_token()
        # cleared by every weight load and /flush_cache; holds nothing under --disable-radix-cache
        self.prefix_cache = PrefixCache(max_total_tokens if prefix_cache else 0)
        self.request_parser = RequestParser(self.model.config.vocab_size, max_positions, max_total_tokens, max_n,
                                            deterministic_inference)
        self.scheduler = BatchScheduler(
            BatchGenerator(self.decoder, self.prefix_cache, eos_token_ids, max_positions, seed),
            max_positions, max_batch_size, max_total_tokens, workers, batch_window_s)
        noise = WeightNoise(weight_noise, weight_noise_seed) if weight_noise else None
        self.weights = WeightUpdates(self.model, self.prefix_cache, noise)
        if noise is not None:
            noise.apply(self.model, [name for name, _ in self.model.named_parameters(remove_duplicate=False)])

    async def generate(self, body: dict):
        """Answer a /generate body: one response, or a list of them (several prompts or n > 1), in SGLang's order."""
        sequences, single = self.request_parser.parse(body)
        await self.scheduler.run(sequences)
        responses = [response(seq, self.weights.weight_version, self.tokenizer) for seq in sequences]
        return responses[0] if single else responses

    def model_info(self) -> dict:
        return {
            "model_path": self.model_dir, "served_model_name": self.model_name,
            "tokenizer_path": self.model_dir if self.tokenizer is not None else None,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weights.weight_version,
            "load_format": self.weights.load_format, "reasoning_parser": None, "tool_call_parser": None,
            "model_type": self.model.config.model_type, "architectures": self.model.config.architectures,
        }


def main(argv: list[str] | None = None) -> None:
    from megatron_dppo.flags import COUNT, NON_NEGATIVE, SEED, Domain, FlagParser, require_domains
    from megatron_dppo.hub import HubError, resolve_model

    parser = FlagParser(prog="megatron_dppo.servers.embedded", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", "--model-path", required=True,
                        help="saved HF model directory (config.json + weights) or, as SGLang takes it, a Hub name "
                             "(read from the Hugging Face cache, downloaded there first); --model-path as SGLang "
                             "names it")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=Domain("a TCP port in [1, 65535]", int, 1, 65535), default=30000)
    parser.add_argument("--api-key", default=os.environ.get("MEGATRON_DPPO_ENGINE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route except /health*")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-batch-size", type=COUNT, default=MAX_BATCH_SIZE,
                        help="sequences decoded together at most")
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
    parser.add_argument("--weight-noise", type=NON_NEGATIVE, default=0.0,
                        help="sample from a perturbed copy of the weights: every parameter loaded gets seeded Gaussian "
                             "noise of this size times its RMS (a controlled engine/trainer gap); 0: off")
    parser.add_argument("--weight-noise-seed", type=SEED, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model decodes: the host, or the GPU of CUDA_VISIBLE_DEVICES' first device "
                             "(a decode step then costs about the same for 1 row as for 64)")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="as SGLang's flag: keep no prefix K/V between requests (a continued chunk is prefilled "
                             "again)")
    require_domains(parser)
    args = parser.parse_args(argv)
    try:  # a Hub name stands for its snapshot, as in every tool (megatron_dppo.hub)
        args.model_dir = str(resolve_model(args.model_dir, "--model-dir"))
    except HubError as error:
        parser.error(str(error))

    from aiohttp import web

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
    engine = EmbeddedEngine(args.model_dir, dtype=args.dtype, max_batch_size=args.max_batch_size, seed=args.seed,
                            deterministic_inference=args.enable_deterministic_inference, workers=args.workers,
                            max_total_tokens=args.max_total_tokens, max_n=args.max_n,
                            prefix_cache=not args.disable_radix_cache, weight_noise=args.weight_noise,
                            weight_noise_seed=args.weight_noise_seed, device=args.device)
    start = time.perf_counter()
    print(f"embedded engine: model {args.model_dir} loaded, serving http://{args.host}:{args.port}", flush=True)
    web.run_app(build_app(engine, args.api_key), host=args.host, port=args.port, print=None,
                handle_signals=True, shutdown_timeout=1.0)
    print(f"embedded engine stopped after {time.perf_counter() - start:.1f} s", flush=True)

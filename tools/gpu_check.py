"""The GPU path's prepared check (run by tools/gpu_check.sh): one line per part, a few minutes on any CUDA machine
with the project's Python dependencies on its path (megatron-core and math-verify may come as wheels).

    part            needs                  what
    environment     -                      torch, CUDA, the GPUs, megatron-core; whether Transformer Engine and SGLang
                                           import
    rl_run          a GPU                  a random tiny Qwen3 ─► tools/convert_hf_to_megatron.py --dtype bf16 ─►
                                           examples/pretrain_dppo.py on one GPU: --bf16 --use-distributed-optimizer,
                                           the TE layer spec where TE imports (else local), the embedded engine. A
                                           launch saves before any optimizer step (--train-iters 0); from that
                                           checkpoint an uninterrupted run trains to step 5, and another stops at 3
                                           and is resumed by a new launch to 5. Per step: the synced weight version
                                           is the step, the gradient norm is finite and positive (the entropy bonus
                                           gives a gradient where a random model earns no reward), trainer and engine
                                           log-probs agree within RL_LOGPROB_GAP. The resumed step-5 checkpoint,
                                           loaded into the actor, restores what the uninterrupted one restores
                                           (weights, fp32 main parameters, Adam's moments; step counts exactly,
                                           torch Adam's per parameter and TE's or Apex's FusedAdam's per group)
                                           within RESUME_STATE_TOL: a resume that dropped the optimizer's state or
                                           lost a step count fails. On a GPU the uninterrupted run and the stopped
                                           one with its resume launch side by side
    fused_logprobs  a GPU                  actor/logprobs.py (fused output layer + log-softmax) against the
                                           full-vocabulary path at Qwen3-4B's output layer (V 151936, H 2560, bf16):
                                           the log-probs, and the gradients of the hidden states and the weight
                                           (the custom autograd function's backward), at a few token counts and
                                           chunk sizes, and at rollout temperature 0.6; time (best of 3) and peak
                                           memory
    actor_step      a GPU                  the actor's bf16 training step at the Qwen3-0.6B shape, about 30k tokens in
                                           packed micro-batches of at most 8192: tokens/s, model FLOP/s and their
                                           share of the GPU's dense bf16 peak, and the allocator's peak against the
                                           memory plan without its reserve (launch/memory_plan.py): a peak above it
                                           fails, and so does a plan more than PLAN_OVERESTIMATE_FACTOR above it
    decode_cost     a GPU                  the embedded engine's decoder on the GPU: one decode step and output
                                           layer for 1 row and for 64, medians of interleaved rounds after a
                                           warm-up; 64 rows may cost at most DECODE_COST_BOUND times 1 row (2x on a
                                           GPU; 20x on the CPU, where one row at a time costs about 64x); the whole
                                           iteration, with the logits' copy to the host, beside it
    step_cost       a GPU                  bench/step_cost.py --headline-only --engine-device cuda: GRPO's steps per
                                           second with synchronous and with partial rollouts, the engine decoding
                                           on the GPU; partial_rollout_step_speedup must exceed
                                           PARTIAL_SPEEDUP_BOUND (1.1 on a GPU; 0.5 on the CPU)
    nccl_sync       two GPUs, SGLang       examples/pretrain_dppo.py --rollout-backend sglang, not colocated: the
                                           trainer on GPU 0, an SGLang server on GPU 1, the weights synced over NCCL
                                           after each of 3 steps; versions and log-prob gaps as rl_run
    tests_gpu       TE, SGLang             pytest tests/gpu (the TE actor with a real SGLang server on one GPU)

Each part prints one line: `gpu_check <name>: ok ...`, `gpu_check <name>: FAIL ...`, or `gpu_check <name>: SKIPPED,
needs ...` naming what this machine lacks; a failing part does not stop the others. A part runs whenever its needs
are met: it can only end ok or FAIL (an exception is a FAIL), never skip itself. The exit status counts the parts
that failed, and the skipped ones whose need is named by `--require` (the Docker image has TE and SGLang:
`--require te,sglang` there); the last line sums them up. Launch timeouts are the tests' own (tests/gpu and, for the
training launches, tests/test_mixed_precision_resume.py's; step_cost's, STEP_COST_TIMEOUT_S, its own), and a launch
that times out is killed with every process it started.

`--rehearse-on-cpu` runs the parts that need only a GPU on the CPU at tiny sizes (tests/test_gpu_check.py does, so
that the script cannot rot between GPU sessions); its figures mean nothing, its bounds are the CPU's own (each
line says which), and the parts that need two GPUs, TE or SGLang are skipped there. `--plant-regression NAME`,
taken with `--rehearse-on-cpu` only, breaks what a check measures (PLANTABLE) to show that the check fails; the
other checks' bounds are shown to fail on broken input through their functions (decode_cost_problems,
partial_speedup_problems, memory_plan_problems, state_differences).
"""

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.gpu.limits import LAUNCH_TIMEOUT_S as SMOKE_LAUNCH_TIMEOUT_S  # noqa: E402
from tests.gpu.limits import TEST_TIMEOUT_S  # noqa: E402
from tests.launch import kill_group, kill_marked  # noqa: E402

RL_LOGPROB_GAP = 0.05  # mean |trainer - engine| log-prob per token; bf16 trainer, fp32 engine (tests/gpu explains)
FUSED_LOGPROB_TOL = 0.05  # largest |fused - full| log-prob: two bf16 GEMM orders, logits of order 10 (2^-8 relative)
# Largest |fused - full| gradient of h and of W over the largest element of the full path's: one bf16 rounding of
# the logits' gradient apart (tests/test_logprobs.py: 1e-2 for bf16 inputs; observed 4e-3 for dh on the CPU)
FUSED_GRAD_TOL = 1e-2
TEMPERATURE = 0.6  # fused_logprobs also compares the paths at this rollout temperature (Qwen3's recommended one)
# Largest |resumed - uninterrupted| of a restored tensor over its largest element (step counts and the loss scaler
# exactly). On the CPU the two are bitwise equal; a GPU's kernels may sum in another order from run to run, so the
# runs may drift apart by rounding, never by this much: a resume that dropped Adam's moments differs by about 100%
# (the gradient norms of this run fall 50x over its 5 steps, so the first steps' moments dominate)
RESUME_STATE_TOL = 0.05
LAUNCH_TIMEOUT_S = 300  # a training launch, as tests/test_mixed_precision_resume.py allows one
TESTS_GPU_TIMEOUT_S = TEST_TIMEOUT_S + 120  # pytest tests/gpu: the test's own limit, and pytest's start
DECODE_ROWS = (1, 64)
# (untimed warm-up rounds, timed rounds) of decode_cost by device: the rehearsal's fewer keep a planted one-row-at-a-
# time decoder (64 one-row steps a round) within seconds on an idle CPU
DECODE_ROUNDS = {"cuda": (3, 16), "cpu": (1, 5)}
# Largest (64-row decode step) / (1-row decode step), each the step and the output layer on the device, medians,
# by device. A GPU's at the Qwen3-0.6B shape is a fixed number of kernel launches and one read of the weights,
# whatever the rows: about 1.0-1.3x expected, and a decode that runs its rows one at a time costs about 64x. The
# copy of the logits to the host (39 MB in fp32 for 64 rows, several ms where pages fault slowly) is reported
# beside it, not bounded: it grows with the rows by design, as the engine samples on the host. The CPU's step grows
# with the rows (about 6x for the tiny rehearsal shape on 2 busy cores, 2026-11-27), while one row at a time costs
# about 64x there too (40x and more measured): the rehearsal's own bound lies between
DECODE_COST_BOUND = {"cuda": 2.0, "cpu": 20.0}
# partial_rollout_step_speedup (steps per second with partial rollouts over synchronous ones) must exceed this, by
# device. On a GPU a step's fixed part is mostly decode iterations, which partial rollouts halve (128 to 64 a step
# on the worked task): 10% more steps per second is the least that shows it above run-to-run noise (repeated modes
# of bench/step_cost.py differ by up to 5%). The CPU engine's iterations cost what their rows cost, so partial
# rollouts buy nothing there (0.96x, docs/trainer.md); the rehearsal's short runs only bound the damage: a partial
# step that costs twice a synchronous one fails
PARTIAL_SPEEDUP_BOUND = {"cuda": 1.10, "cpu": 0.5}
# The memory plan's estimate without its reserve may exceed the allocator's peak of the step it plans by at most
# this factor (it was within 2% at actor_step's shape, docs/actor.md): a plan 25% too big refuses layouts that fit
PLAN_OVERESTIMATE_FACTOR = 1.25
STEP_COST_BUDGET_S = 30  # RL seconds of each of the two GPU runs (the check's whole run stays near 6 minutes)
# bench/step_cost.py's whole run (the warm start, then the two runs with their starts and evaluations): on a GPU about
# 3 minutes are expected, and a hang must leave most of a GPU session's time; the rehearsal's 2 busy cores take longer
STEP_COST_TIMEOUT_S = {"cuda": 420, "cpu": 2 * LAUNCH_TIMEOUT_S + 120}
# dense bf16 peak FLOP/s by GPU name (datasheets; no sparsity)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def say(name: str, ok: bool, message: str) -> bool:
    print(f"gpu_check {name}: {'ok' if ok else 'FAIL'} {message}", flush=True)
    return ok


def run(command: list, what: str, timeout_s: float = LAUNCH_TIMEOUT_S, env: dict | None = None) -> str:
    """Run `command` in its own process group, killed at `timeout_s` with every process it started (torchrun starts
    its workers in sessions of their own: they carry a marker in their environment); its output, or an error with
    its tail."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    marker = f"GPU_CHECK_LAUNCH={uuid.uuid4().hex}"
    process = subprocess.Popen([str(part) for part in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=REPO, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": path, **(env or {}), **dict([marker.split("=")])})
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(process)
        output, _ = process.communicate()
        raise RuntimeError(f"{what} timed out after {timeout_s:g} s: ...{output[-1500:]}") from None
    finally:
        kill_group(process)
        kill_marked(marker)
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


# What a part needs beyond the project's Python dependencies, by the name --require takes, and how a line says it
NEEDS = {"gpu": "a CUDA GPU", "two_gpus": "a second GPU", "te": "Transformer Engine", "sglang": "SGLang"}


def machine_has(rehearse_on_cpu: bool) -> dict[str, bool]:
    """Which needs this machine meets. A rehearsal runs the one-GPU parts on the CPU and meets nothing else."""
    import torch

    gpus = 0 if rehearse_on_cpu else torch.cuda.device_count()
    return {"gpu": rehearse_on_cpu or gpus >= 1, "two_gpus": gpus >= 2,
            "te": gpus >= 1 and has("transformer_engine"), "sglang": gpus >= 1 and has("sglang")}


def check_environment(options) -> bool:
    import megatron.core
    import torch

    devices = ", ".join(torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else "no GPU (rehearsal on the CPU)"
    return say("environment", True, f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA "
               f"{torch.version.cuda}), {devices}, megatron-core {megatron.core.__version__}, Transformer Engine "
               f"{'imports' if has('transformer_engine') else 'absent'}, SGLang "
               f"{'imports' if has('sglang') else 'absent'}; layer spec: {transformer_impl()}")


def tiny_qwen3(root: Path) -> Path:
    """A random tiny Qwen3 with the synthetic task's character tokenizer (head_dim 64: what TE's kernels take)."""
    from megatron_dppo.data.tokenizer import CharTokenizer

    return CharTokenizer.for_synthetic_task().save_random_model(
        root / "hf", "qwen3", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=512,
        head_dim=64, max_position_embeddings=256)


def step_problems(metrics: list[dict]) -> list[str]:
    """What is wrong with a run's steps: the synced version, the update, trainer vs engine log-probs."""
    problems = []
    for step in metrics:
        if step["weight_version"] != step["step"]:
            problems.append(f"step {step['step']} synced version {step['weight_version']}")
        if not (math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0):
            problems.append(f"step {step['step']} grad norm {step['grad_norm']}")
        if step["logprob_gap_train_vs_rollout"] > RL_LOGPROB_GAP:
            problems.append(f"step {step['step']} log-prob gap {step['logprob_gap_train_vs_rollout']:.4f}")
    return problems


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def state_differences(expected: dict, found: dict, tolerance: float) -> tuple[list[str], float]:
    """(the tensors of two restored states (Actor.restorable_state) that differ beyond `tolerance` of the expected
    tensor's largest magnitude, or are missing; step counts, torch Adam's per parameter (`<group>.param<j>.step`) and
    FusedAdam's per group (`<group>.step`), and loss-scaler values must be exact), and the largest relative
    difference seen."""
    problems, largest = sorted(f"{name} missing" for name in set(expected) ^ set(found)), 0.0
    for name in sorted(set(expected) & set(found)):
        want, got = expected[name].double(), found[name].double()
        if want.shape != got.shape:
            problems.append(f"{name} shape {tuple(got.shape)} != {tuple(want.shape)}")
            continue
        exact = name.endswith(".step") or ".grad_scaler." in name
        scale = want.abs().max().item() if want.numel() else 0.0
        difference = (want - got).abs().max().item() if want.numel() else 0.0
        relative = difference / scale if scale else difference
        largest = max(largest, relative)
        if (difference > 0) if exact else relative > tolerance:
            problems.append(f"{name} differs by {relative:.2g} of its largest element" if not exact else
                            f"{name} {got.flatten()[:1].tolist()} != {want.flatten()[:1].tolist()}")
    if not any(".exp_avg" in name and expected[name].abs().max() > 0 for name in expected):
        problems.append("no Adam moment is non-zero: the runs took no optimizer step")
    if not any(name.endswith(".step") and expected[name].max() > 0 for name in expected):
        problems.append("no Adam step count above 0 is restored (per parameter or per group)")
    return problems, largest


def restored_state(checkpoint: Path, options) -> dict:
    """What `checkpoint` restores into a one-GPU actor with the distributed optimizer (rl_run's layout)."""
    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.checkpoint import read_hf_config
    from megatron_dppo.convert.mapping import model_shape

    actor = Actor(model_shape(read_hf_config(checkpoint)), 1, 1, "bf16", OptimConfig(use_distributed_optimizer=True),
                  transformer_impl=transformer_impl())
    actor.load_sharded(checkpoint, with_optimizer=True)
    return {name: tensor.cpu() for name, tensor in actor.restorable_state().items()}


def check_rl_run(options) -> bool:
    from megatron_dppo.platform.network import free_port

    root = Path(tempfile.mkdtemp(prefix="gpu_check_rl_"))
    start = time.perf_counter()
    model_dir = tiny_qwen3(root)
    run([sys.executable, REPO / "tools" / "convert_hf_to_megatron.py", "--hf-dir", model_dir, "--out",
         root / "converted", "--tp", 1, "--pp", 1, "--dtype", "bf16"], "the converter")
    common = ["--hf-checkpoint", model_dir, "--bf16", "--use-distributed-optimizer", "--transformer-impl",
              transformer_impl(), "--algorithm", "dppo", "--lr", "1e-4", "--entropy-coef", "0.01", "--rollout-backend",
              "embedded", "--rollout-batch-size", 8, "--n-samples-per-prompt", 4, "--rollout-max-response-len", 8,
              "--data-train-size", 64, "--eval-size", 8]

    def launch(save: str, load: Path, steps: int) -> None:  # each launch saves at its end
        run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", 1, "--master-addr", "127.0.0.1",
             "--master-port", free_port(), REPO / "examples" / "pretrain_dppo.py", *common, "--load", load,
             "--train-iters", steps, "--save", root / save, "--log-dir", root / f"log_{save}"],
            f"the run to step {steps} ({save})")

    launch("never_stepped", root / "converted", 0)
    # on a GPU machine the uninterrupted run goes beside the stopped one and its resume (two tiny runs share the GPU,
    # the machine has the cores): one launch less long; a rehearsal's 2 cores run them one after the other, as each
    # launch has LAUNCH_TIMEOUT_S
    with ThreadPoolExecutor(2 if options.device.type == "cuda" else 1) as pool:
        chains = [pool.submit(launch, "straight", root / "never_stepped", 5),
                  pool.submit(lambda: (launch("stopped", root / "never_stepped", 3),
                                       launch("stopped", root / "stopped", 5)))]
        for chain in chains:
            chain.result()
    straight, resumed = read_metrics(root / "log_straight"), read_metrics(root / "log_stopped")
    problems = []
    if [step["step"] for step in straight] != [1, 2, 3, 4, 5] or [step["step"] for step in resumed] != [1, 2, 3, 4, 5]:
        problems.append(f"steps {[step['step'] for step in straight]} and {[step['step'] for step in resumed]}")
    problems += step_problems(straight) + step_problems(resumed)
    differences, largest = state_differences(restored_state(root / "straight" / "iter_0000005", options),
                                             restored_state(root / "stopped" / "iter_0000005", options),
                                             RESUME_STATE_TOL)
    problems += [f"resumed vs uninterrupted: {difference}" for difference in differences[:4]]
    gaps = [f"{step['logprob_gap_train_vs_rollout']:.4f}" for step in resumed]
    norms = [f"{step['grad_norm']:.3g}" for step in resumed]
    return say("rl_run", not problems, "; ".join(problems) if problems else
               f"bf16 {transformer_impl()} spec, distributed optimizer: saved before any optimizer step, then from "
               f"there steps 1-3 saved at 3 and a second launch resumed to 5; weight versions 1-5 synced; grad norms "
               f"{norms}; trainer vs engine log-prob gap per token {gaps} (<= {RL_LOGPROB_GAP}); the resumed step-5 "
               f"checkpoint restores the uninterrupted run's weights, main parameters, Adam moments and step counts "
               f"(largest difference {largest:.2g} of a tensor's largest element, <= {RESUME_STATE_TOL}); "
               f"{time.perf_counter() - start:.0f} s with four launches")


def timed_backward(function, hidden, weight, targets, device, repeats: int = 3) -> tuple[float, float, object, tuple]:
    """(best seconds, peak bytes above the inputs, log-probs, (grad of hidden, grad of weight)) of forward +
    backward of sum(logp) + 0.01 sum(H)."""
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
    return best, peak, logprobs.detach(), (hidden.grad, weight.grad)


def relative_difference(found, expected) -> float:
    return ((found.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def check_fused_logprobs(options) -> bool:
    import torch

    from megatron_dppo.actor.logprobs import CHUNK_ELEMENTS, output_layer_logprobs, unfused_logprobs

    device = options.device
    tokens_list, vocab, hidden_size = ((256,), 1000, 64) if options.rehearse_on_cpu else ((8192, 32768), 151936, 2560)
    default_chunk = CHUNK_ELEMENTS // vocab
    gib, parts, worst, worst_grad, moved = 2**30, [], 0.0, 0.0, 0.0
    for tokens in tokens_list:
        generator = torch.Generator(device=device).manual_seed(0)
        hidden = (torch.randn(tokens, hidden_size, device=device, generator=generator) * 0.5).to(
            torch.bfloat16).requires_grad_()
        weight = (torch.randn(vocab, hidden_size, device=device, generator=generator) * 0.02).to(
            torch.bfloat16).requires_grad_()
        targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
        seconds, peak, reference, (full_dh, full_dw) = timed_backward(unfused_logprobs, hidden, weight, targets, device)
        row = [f"T={tokens}: full {seconds * 1e3:.0f} ms {peak / gib:.2f} GiB"]
        for chunk in sorted({default_chunk, 4 * default_chunk, 16 * default_chunk}):
            fused = lambda h, w, t, chunk=chunk: output_layer_logprobs(h, w, t, vocab, chunk_size=chunk)  # noqa: E731
            seconds, peak, logprobs, (dh, dw) = timed_backward(fused, hidden, weight, targets, device)
            worst = max(worst, (logprobs - reference).abs().max().item())
            worst_grad = max(worst_grad, relative_difference(dh, full_dh), relative_difference(dw, full_dw))
            row.append(f"chunk {chunk}{' (default)' if chunk == default_chunk else ''} {seconds * 1e3:.0f} ms "
                       f"{peak / gib:.2f} GiB")
        # at a rollout temperature (the logits divided by it, forward and backward), the default chunk
        _, _, tempered, (full_dh, full_dw) = timed_backward(
            lambda h, w, t: unfused_logprobs(h, w, t, temperature=TEMPERATURE), hidden, weight, targets, device, 1)
        _, _, logprobs, (dh, dw) = timed_backward(
            lambda h, w, t: output_layer_logprobs(h, w, t, vocab, temperature=TEMPERATURE), hidden, weight, targets,
            device, 1)
        worst = max(worst, (logprobs - tempered).abs().max().item())
        worst_grad = max(worst_grad, relative_difference(dh, full_dh), relative_difference(dw, full_dw))
        moved = max(moved, (tempered - reference).abs().max().item())
        parts.append(", ".join(row))
        del hidden, weight, targets, full_dh, full_dw, dh, dw
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return say("fused_logprobs", worst <= FUSED_LOGPROB_TOL and worst_grad <= FUSED_GRAD_TOL and moved > worst,
               f"V={vocab} H={hidden_size} bf16, fwd+bwd best of 3; " + "; ".join(parts) +
               f"; largest |fused - full| log-prob {worst:.2e} (<= {FUSED_LOGPROB_TOL}), gradient of h and W "
               f"{worst_grad:.2e} of the largest element (<= {FUSED_GRAD_TOL}), at temperatures 1 and {TEMPERATURE} "
               f"(which moves the log-probs by up to {moved:.2e})")


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


def qwen3_shape(options) -> tuple:
    """(HF config, tokens a step, shortest, longest sequence, micro-batch budget): Qwen3-0.6B's, or a tiny one."""
    from megatron_dppo.convert.tiny import tiny_hf_config

    if options.rehearse_on_cpu:
        return tiny_hf_config("qwen3", vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              ffn_hidden_size=128, head_dim=16, tie_word_embeddings=True), 600, 32, 256, 512
    return tiny_hf_config("qwen3", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                          ffn_hidden_size=3072, head_dim=128, tie_word_embeddings=True,
                          max_position_embeddings=40960), 30000, 256, 4096, 8192


def memory_plan_problems(peak: float, plan) -> list[str]:
    """What is wrong with the memory plan (a launch/memory_plan.py StageMemory) against the allocator's peak bytes of
    the step it plans. Its estimate without the reserve (the CUDA context and the allocator's fragmentation, which
    max_memory_allocated does not count) must bound the peak, or the plan admits layouts that run out of memory; and
    must not exceed it by more than PLAN_OVERESTIMATE_FACTOR, or the plan refuses layouts that fit."""
    from megatron_dppo.launch.memory_plan import GIB

    if peak > plan.estimate:
        return [f"allocator peak {peak / GIB:.2f} GiB above the memory plan's {plan.estimate / GIB:.2f} GiB without "
                f"its reserve (the plan underestimates by {100 * (peak / plan.estimate - 1):.1f}%)"]
    if plan.estimate > PLAN_OVERESTIMATE_FACTOR * peak:
        return [f"the memory plan's {plan.estimate / GIB:.2f} GiB without its reserve is {plan.estimate / peak:.2f}x "
                f"the allocator peak {peak / GIB:.2f} GiB (at most {PLAN_OVERESTIMATE_FACTOR:g}x)"]
    return []


def check_actor_step(options) -> bool:
    import torch

    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.step import next_token_targets
    from megatron_dppo.convert.mapping import model_shape
    from megatron_dppo.launch.memory_plan import GIB, TrainerLayout, plan_memory

    config, total, shortest, longest, budget = qwen3_shape(options)
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
    (plan,) = plan_memory(TrainerLayout(shape, dtype="bf16", tokens=max(batch.tokens.shape[1] for batch in batches),
                                        transformer_impl=transformer_impl()))
    problems = [] if grad_norm is not None and math.isfinite(grad_norm) else [f"grad norm {grad_norm}"]
    if options.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        problems += memory_plan_problems(peak, plan)
        memory = (f", allocator peak {peak / GIB:.2f} GiB against the plan's {plan.estimate / GIB:.2f} GiB without its "
                  f"reserve (plan {plan.estimate / peak:.3f}x the peak, within [1, {PLAN_OVERESTIMATE_FACTOR:g}]; "
                  f"reserved peak {torch.cuda.max_memory_reserved() / GIB:.2f} GiB, plan total with reserve "
                  f"{plan.total / GIB:.2f} GiB)")
    else:
        memory = ", memory not compared (the allocator's peak is CUDA's)"
    return say("actor_step", not problems, "; ".join(problems) + ("; " if problems else "") +
               f"{'Qwen3-0.6B' if not options.rehearse_on_cpu else 'tiny'} shape "
               f"({parameters / 1e6:.0f}M parameters), bf16, {transformer_impl()} spec, {tokens} tokens in "
               f"{len(batches)} packed micro-batches ({len(lengths)} sequences of {shortest}-{longest}): "
               f"{seconds * 1e3:.0f} ms a step (median of 3), {tokens / seconds:,.0f} tokens/s, "
               f"{flops / seconds / 1e12:.0f} TFLOP/s{share}{memory}; grad norm {grad_norm}")


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step_seconds(decoder, device, one_row_at_a_time: bool) -> dict[str, dict[int, list[float]]]:
    """Seconds of one engine decode iteration (every row advances one token) per count in DECODE_ROWS, in
    DECODE_ROUNDS[device] rounds (the first untimed): "device", the step and the output layer where the model is,
    synchronized; "iteration", that and the fp32 logits' copy to the host, where the engine samples. The counts
    alternate within each round, so that a busy spell on the host slows both alike. `one_row_at_a_time` (a planted
    regression, rehearsals only) decodes the rows as separate one-row batches, one after the other."""
    import torch

    states = {}
    for rows in DECODE_ROWS:
        contexts = [[1 + row % 7] * 64 for row in range(rows)]
        batches = [[context] for context in contexts] if one_row_at_a_time else [contexts]
        states[rows] = [decoder.prefill(batch)[0] for batch in batches]
    seconds = {part: {rows: [] for rows in DECODE_ROWS} for part in ("device", "iteration")}
    warmup, repeats = DECODE_ROUNDS[device.type]
    for round_index in range(warmup + repeats):
        for rows in DECODE_ROWS:
            synchronize(device)
            start = time.perf_counter()
            logits = [decoder.device_logits(decoder.step(state, torch.ones(state.batch_size, dtype=torch.long)))
                      for state in states[rows]]
            synchronize(device)
            stepped = time.perf_counter()
            for part in logits:
                part.cpu()
            if round_index >= warmup:
                seconds["device"][rows].append(stepped - start)
                seconds["iteration"][rows].append(time.perf_counter() - start)
    return seconds


def decode_cost_problems(seconds: dict[int, list[float]], bound: float) -> tuple[list[str], float]:
    """(what is wrong, the ratio): the median decode step of the most rows over that of one row must stay at or
    under `bound`."""
    few, many = DECODE_ROWS[0], DECODE_ROWS[-1]
    ratio = statistics.median(seconds[many]) / statistics.median(seconds[few])
    if math.isfinite(ratio) and ratio <= bound:
        return [], ratio
    return [f"a decode step for {many} rows costs {ratio:.2f}x the step for {few} row (bound {bound:g}x)"], ratio


def check_decode_cost(options) -> bool:
    """The embedded engine's decoder on the device: a decode step for 64 rows against one for 1 row."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dppo.servers.embedded.decoder import KVCacheDecoder

    config, *_ = qwen3_shape(options)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(options.device).eval()
    with torch.no_grad():
        seconds = decode_step_seconds(KVCacheDecoder(model), options.device, "decode_per_row" in options.planted)
    bound = DECODE_COST_BOUND[options.device.type]
    problems, ratio = decode_cost_problems(seconds["device"], bound)
    few, many = (statistics.median(seconds["device"][rows]) for rows in (DECODE_ROWS[0], DECODE_ROWS[-1]))
    whole = {rows: statistics.median(seconds["iteration"][rows]) for rows in DECODE_ROWS}
    why = ("the GPU bound: its cost is kernel launches and weight reads, the same for 1 row as for 64"
           if options.device.type == "cuda" else
           "the CPU rehearsal's bound: the CPU's cost grows with the rows, but one row at a time costs about 64x")
    return say("decode_cost", not problems, "; ".join(problems) + ("; " if problems else "") +
               f"{'Qwen3-0.6B' if not options.rehearse_on_cpu else 'tiny'} shape, bf16, on {options.device}"
               f"{', PLANTED one row at a time' if 'decode_per_row' in options.planted else ''}: one decode step "
               f"and output layer (median of {len(seconds['device'][DECODE_ROWS[0]])}, interleaved) "
               f"{few * 1e3:.2f} ms for {DECODE_ROWS[0]} row, {many * 1e3:.2f} ms for {DECODE_ROWS[-1]} rows: "
               f"{ratio:.2f}x (<= {bound:g}x, {why}); with the fp32 logits' copy to the host, where the engine "
               f"samples (not bounded: it grows with the rows), {whole[DECODE_ROWS[0]] * 1e3:.2f} and "
               f"{whole[DECODE_ROWS[-1]] * 1e3:.2f} ms ({whole[DECODE_ROWS[-1]] / whole[DECODE_ROWS[0]]:.2f}x)")


def partial_speedup_problems(output: str, bound: float) -> tuple[list[str], float]:
    """(what is wrong, the speedup) of bench/step_cost.py --headline-only's output: its partial_rollout_step_speedup
    line must be there and its value above `bound`."""
    named = dict(line.split(": ", 1) for line in output.splitlines() if line.startswith("partial_rollout_"))
    if "partial_rollout_step_speedup" not in named:
        return ["bench/step_cost.py printed no partial_rollout_step_speedup line"], math.nan
    speedup = float(named["partial_rollout_step_speedup"])
    if math.isfinite(speedup) and speedup > bound:
        return [], speedup
    return [f"partial rollouts give {speedup:.3f}x the synchronous steps per second (must exceed {bound:g}x)"], \
        speedup


def check_step_cost(options) -> bool:
    """bench/step_cost.py's headline pair with the engine decoding on the device."""
    out = Path(tempfile.mkdtemp(prefix="gpu_check_step_cost_"))
    # the layer spec as rl_run's: the trainer's GPU default is Transformer Engine's, which a bare machine lacks
    trainer_flags = f"--transformer-impl {transformer_impl()}"
    rehearsal = ["--modes-budget-s", "8", "--skip-steps", "1", "--trainer-flags",
                 f"{trainer_flags} --warm-start-steps 20 --rollout-batch-size 4"] if options.rehearse_on_cpu else \
        ["--modes-budget-s", str(STEP_COST_BUDGET_S), "--skip-steps", "3", "--trainer-flags", trainer_flags]
    output = run([sys.executable, REPO / "bench" / "step_cost.py", "--headline-only", "--out-dir", out,
                  "--processes", 1, "--engine-device", options.device.type, *rehearsal],
                 "bench/step_cost.py --headline-only",
                 timeout_s=STEP_COST_TIMEOUT_S[options.device.type])
    bound = PARTIAL_SPEEDUP_BOUND[options.device.type]
    problems, speedup = partial_speedup_problems(output, bound)
    table = " / ".join(line.strip() for line in output.splitlines() if line.startswith("| synchronous") or
                       line.startswith("| partial"))
    why = ("the GPU bound: partial rollouts halve the decode iterations a step waits for, and a GPU's iteration "
           "costs the same however few rows it carries" if options.device.type == "cuda" else
           "the CPU rehearsal's bound: the CPU engine's iterations cost what their rows cost, so partial rollouts "
           "buy nothing there (0.96x measured), but a partial step must not cost twice a synchronous one")
    return say("step_cost", not problems, "; ".join(problems) + ("; " if problems else "") +
               f"GRPO on the worked task, the embedded engine decoding on {options.device.type}: {table}; "
               f"partial_rollout_step_speedup {speedup:.3f} (> {bound:g}, {why})")


def check_nccl_sync(options) -> bool:
    """The trainer on GPU 0 and an SGLang server on GPU 1 (a one-node run's own layout), weights over NCCL."""
    from megatron_dppo.platform.network import free_port

    root = Path(tempfile.mkdtemp(prefix="gpu_check_nccl_"))
    model_dir = tiny_qwen3(root)
    run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", 1, "--master-addr", "127.0.0.1",
         "--master-port", free_port(), REPO / "examples" / "pretrain_dppo.py", "--hf-checkpoint", model_dir, "--bf16",
         "--transformer-impl", transformer_impl(), "--train-iters", 3, "--algorithm", "dppo", "--lr", "1e-4",
         "--entropy-coef", "0.01", "--rollout-batch-size", 8, "--n-samples-per-prompt", 4,
         "--rollout-max-response-len", 8, "--data-train-size", 64, "--eval-size", 8, "--log-dir", root / "log",
         "--rollout-backend", "sglang", "--sglang-skip-tokenizer-init", "--sglang-dtype", "bfloat16",
         "--sglang-mem-fraction-static", "0.3", "--sglang-context-length", "256"],
        "the run with an SGLang server on GPU 1", timeout_s=SMOKE_LAUNCH_TIMEOUT_S, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    metrics = read_metrics(root / "log")
    problems = step_problems(metrics)
    if [step["step"] for step in metrics] != [1, 2, 3]:
        problems.append(f"steps {[step['step'] for step in metrics]}")
    syncs = [f"{step['seconds_sync']:.2f} s" for step in metrics]
    return say("nccl_sync", not problems, "; ".join(problems) if problems else
               f"trainer on GPU 0, SGLang on GPU 1, weights over NCCL after each of 3 steps ({', '.join(syncs)}); "
               f"versions 1-3 synced; log-prob gaps "
               f"{[round(step['logprob_gap_train_vs_rollout'], 4) for step in metrics]} (<= {RL_LOGPROB_GAP})")


def check_tests_gpu(options) -> bool:
    output = run([sys.executable, "-m", "pytest", "-q", "-x", "tests/gpu"], "pytest tests/gpu",
                 timeout_s=TESTS_GPU_TIMEOUT_S)
    summary = output.strip().splitlines()[-1]
    return say("tests_gpu", "passed" in summary and "skipped" not in summary, summary)


PARTS = {  # name: (check, what it needs beyond a CUDA GPU's Python environment)
    "environment": (check_environment, ()),
    "rl_run": (check_rl_run, ("gpu",)),
    "fused_logprobs": (check_fused_logprobs, ("gpu",)),
    "actor_step": (check_actor_step, ("gpu",)),
    "decode_cost": (check_decode_cost, ("gpu",)),
    "step_cost": (check_step_cost, ("gpu",)),
    "nccl_sync": (check_nccl_sync, ("two_gpus", "sglang")),
    "tests_gpu": (check_tests_gpu, ("gpu", "te", "sglang")),
}
# Regressions a rehearsal can plant (--plant-regression), each in the measurement of the check it names
PLANTABLE = {"decode_per_row": "decode_cost's decoder runs the rows one at a time, as separate one-row batches"}
IN_PROCESS = ("rl_run", "actor_step")  # parts that build an actor here, in one process group


def start_process_group(device) -> None:
    """The actor needs torch.distributed and Megatron's parallel state: one rank, here."""
    from megatron_dppo.actor.parallel import init_parallel
    from megatron_dppo.platform.network import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_parallel(1, 1)


def run_parts(names: list[str], options, met: dict[str, bool], required: set[str]) -> dict[str, str]:
    """Run each part whose needs are met (ok or FAIL), skip the others naming what they need; name -> outcome."""
    outcomes = {}
    for name in names:
        check, needs = PARTS[name]
        missing = [need for need in needs if not met[need]]
        if missing:
            print(f"gpu_check {name}: SKIPPED, needs {' and '.join(NEEDS[need] for need in missing)}"
                  f"{' (required)' if required & set(missing) else ''}", flush=True)
            outcomes[name] = "required" if required & set(missing) else "skipped"
            continue
        try:
            outcomes[name] = "ok" if check(options) is True else "FAIL"
        except Exception as error:  # one line per part: the others still run
            where = traceback.extract_tb(error.__traceback__)[-1]
            say(name, False, f"{type(error).__name__}: {error} ({Path(where.filename).name}:{where.lineno})"
                .replace("\n", " | "))
            outcomes[name] = "FAIL"
    return outcomes


def main(argv: list[str] | None = None) -> int:
    from megatron_dppo.flags import ToolHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    parser.add_argument("--checks", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--require", default="",
                        help=f"needs that must be met (comma-separated, of {', '.join(NEEDS)}): a part skipped for "
                             "one of them fails")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="run the one-GPU parts on the CPU at tiny sizes (the script's own test; figures mean "
                             "nothing)")
    parser.add_argument("--plant-regression", action="append", default=[], choices=sorted(PLANTABLE),
                        help="with --rehearse-on-cpu only: break what the named check measures, to show that it "
                             "fails (tests/test_gpu_check.py); " + "; ".join(f"{name}: {what}" for name, what in
                                                                           PLANTABLE.items()))
    options = parser.parse_args(argv)
    if options.plant_regression and not options.rehearse_on_cpu:
        parser.error("--plant-regression breaks a rehearsal on purpose: it is taken with --rehearse-on-cpu only")
    options.planted = set(options.plant_regression)
    import torch

    if not torch.cuda.is_available() and not options.rehearse_on_cpu:
        print("gpu_check: no CUDA GPU is visible to this python (torch.cuda.is_available() is False): run it on a "
              "machine with one", file=sys.stderr)
        return 1
    names, required = options.checks.split(","), set(filter(None, options.require.split(",")))
    unknown = sorted(set(names) - set(PARTS)) + sorted(required - set(NEEDS))
    if unknown:
        parser.error(f"{', '.join(unknown)}: not a part or a need; parts: {', '.join(PARTS)}; needs: "
                     f"{', '.join(NEEDS)}")
    options.device = torch.device("cpu") if options.rehearse_on_cpu else torch.device("cuda", 0)
    if options.rehearse_on_cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    met = machine_has(options.rehearse_on_cpu)
    if any(name in IN_PROCESS and all(met[need] for need in PARTS[name][1]) for name in names):
        start_process_group(options.device)
    outcomes = run_parts(names, options, met, required)
    counts = {outcome: [name for name, got in outcomes.items() if got == outcome]
              for outcome in ("ok", "FAIL", "skipped", "required")}
    status = len(counts["FAIL"]) + len(counts["required"])
    required_note = f" ({len(counts['required'])} of them --require'd)" if counts["required"] else ""
    print(f"gpu_check: {len(counts['ok'])} ok, {len(counts['FAIL'])} FAIL {counts['FAIL']}, "
          f"{len(counts['skipped']) + len(counts['required'])} SKIPPED {counts['skipped'] + counts['required']}"
          f"{required_note}; exit status {status}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

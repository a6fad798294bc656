"""Time to accuracy in the paper's regime: GRPO, DAPO's dynamic sampling, DPPO (its defaults, its unbiased
alternatives, the paper's deterministic variant, the uncorrected shortcut), CPPO and D3S from one warm start.

    0. (--tune-grpo, first) GRPO's own learning rate and batch, one changed at a time from RL_FLAGS: every method
       then shares GRPO's best, so that no method wins against a mistuned rival
    1. warm start: one supervised warm start of the embedded tiny model (cached), timed twice (built, then cached)
       to measure its supervised steps per second
    2. RL: every method x seed starts from that checkpoint (--load) with the same flags and time budget, on a pool
       of 256 problems that every prompt revisits about 13 times (the paper: 15 epochs); --rl-seed varies the RL
       randomness (training pool, its order, sampling, pruning draws), never the start
    3. control: a longer supervised warm start that spends the RL budget on more supervised steps instead, on the
       same warm-start data
    4. analysis ─► tables, figures (tools/plot_metrics.py), the generated part of docs/results.md:
       time, tokens and FLOPs to GRPO's final accuracy with a bootstrap interval; the prompt level at work (epochs,
       pruned share, zero-variance share, how well history predicted); where the time goes; the step-cost fit;
       fewer steps x shorter steps; the Qwen3-4B projection
    5. optional (--math-budget-s): the same methods' costs on MATH train prompts (tiny random model)

Runs are resumable: a run whose directory holds summary.json (and was started with the same command) is read, not
re-run, so the full table is finished over several sittings; --methods/--seeds/--budget-s restrict a run.
Definitions (also on the results page):
- final accuracy: mean of the last 3 held-out evaluations (the trainer's --eval-interval ones and the final one)
- the headline: each method's seed-mean curve (accuracy averaged over seeds, evaluation by evaluation); the target
  is GRPO's final accuracy on its own seed-mean curve; time to target is where a seed-mean curve's trailing mean of
  3 evaluations crosses it, interpolated between evaluations; speed-up = GRPO's time / the method's, with a 95%
  bootstrap interval over seeds (compare_mean_curves); beside it the per-seed speed-ups
- FLOPs: forward 2·P per token plus attention 4·L·d·(context / 2), backward twice the forward; training counts
  forward+backward over every trained token (plus one forward when an old-log-prob pass runs), rollout counts a
  forward over every generated token (decode; prompt prefill not counted); P counts the tied embedding once.

Examples:
    python bench/time_to_accuracy.py --tune-grpo --seeds 1 2 --write-page docs/results.md   # GRPO's own settings
    python bench/time_to_accuracy.py --write-page docs/results.md              # the full benchmark and the page
    python bench/time_to_accuracy.py --quick                                   # smoke check, < 10 min
    python bench/time_to_accuracy.py --methods grpo dppo --seeds 1 2 --budget-s 120
Last line: dppo_speedup_vs_grpo: X [low, high] (DPPO's defaults; the seed-mean speed-up and its 95% interval).
"""

import argparse
import gzip
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import prompt_prediction  # noqa: E402
from megatron_dppo.metrics import Run, load_run, smoothed  # noqa: E402
from tools.plot_metrics import plot_runs  # noqa: E402

METHODS = {
    "grpo": ["--algorithm", "grpo"],
    # what many users run: rounds of prompts until the batch holds B groups with varied rewards, trained as the batch
    "dapo-dynamic-sampling": ["--algorithm", "grpo", "--dapo-dynamic-sampling"],
    # DPPO's defaults (docs/algorithms.md): the predictive prompt level, refill, 1/p weights, the completion level
    "dppo": ["--algorithm", "dppo"],
    "dppo-deterministic": ["--algorithm", "dppo", "--dppo-mode", "deterministic"],  # the paper's Algorithm 1
    # the same prompt level without the 1/p correction: the shortcut history-skipping methods (GRESO) take
    "dppo-uncorrected": ["--algorithm", "dppo", "--no-dppo-importance-weights"],
    "cppo": ["--algorithm", "cppo", "--cppo-refill"],  # with its paper's refill: batch / (1 - P) prompts drawn
    "d3s": ["--algorithm", "d3s"],
}
# Run by default with --variant-seeds (fewer than the methods' seeds): DPPO's unbiased alternatives to its defaults,
# so that the page shows which is best, and rollouts that do not wait for the longest response (partial rollouts,
# one step off-policy), with GRPO and DPPO
VARIANTS = {
    "dppo-no-refill": ["--algorithm", "dppo", "--no-dppo-refill"],
    "dppo-no-completion-level": ["--algorithm", "dppo", "--dppo-completion-prune-rate", "0"],
    "grpo-partial": ["--algorithm", "grpo", "--partial-rollout"],
    "dppo-partial": ["--algorithm", "dppo", "--partial-rollout"],
    "grpo-async": ["--algorithm", "grpo", "--async"],
    "dppo-async": ["--algorithm", "dppo", "--async"],
}
ABLATIONS = {"dppo-p-min-0.1": ["--algorithm", "dppo", "--dppo-prompt-p-min", "0.1"]}  # not run unless --methods
ALL_METHODS = {**METHODS, **VARIANTS, **ABLATIONS}
HEADLINE_METHOD = "dppo"
CONTROL = "sft-control"
# Every method runs with these flags, so the page records them (the embedded defaults may change under us).
# The paper's regime: a pool of 256 training problems comes back every 32 GRPO steps (batch 8), so within the
# budget every prompt is visited about 13 times and DPPO's prompt level has a history to act on, as over the 15
# epochs of the paper's run (research notes: every method that wins before rollout revisits its prompts 10-60 times).
# --dapo-filter (drop zero-variance groups, exact) is the embedded default, kept for every method: GRPO is the
# strong baseline that already skips them. The MATH runs go without it: there each pruner meets them itself.
# --lr and --rollout-batch-size are GRPO's own best (--tune-grpo, docs/results.md): the grid was run from a batch of
# 16, whose neighbours scored within 0.005 of each other (lr 2e-4 lower), and the batch of 8 scored best.
RL_FLAGS = ["--lr", "1e-4", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
            "--rollout-temperature", "1.0", "--max-tokens-per-gpu", "4096",
            "--loss-agg-mode", "token-mean", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--kl-coef", "0",
            "--ppo-epochs", "1", "--data-train-size", "256", "--dapo-filter"]
MATH_FLAGS = ["--prompt-data", "math", "--reward-type", "math", "--lr", "1e-4", "--rollout-batch-size", "8",
              "--n-samples-per-prompt", "8", "--rollout-max-response-len", "32", "--rollout-temperature", "1.0",
              "--max-tokens-per-gpu", "8192", "--eval-size", "16", "--skip-bad-rows"]
MATH_MODEL = dict(architecture="qwen2", hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=4,
                  ffn_hidden_size=512, tie_word_embeddings=True, max_position_embeddings=4096)
# The response limit and warm start of every run, by task: the embedded defaults of the time this benchmark was set
# up, written out, so that a later change of the embedded default does not silently start its runs over (a run is
# read back only if its command is unchanged)
TASK_SETTINGS = {
    "worked": dict(rollout_max_response_len=176, warm_start_steps=450, warm_start_lr=3e-3, warm_start_batch_size=64,
                   warm_start_problems=500, warm_start_cells=None),
    "answer": dict(rollout_max_response_len=8, warm_start_steps=900, warm_start_lr=3e-3, warm_start_batch_size=128,
                   warm_start_problems=0, warm_start_cells=None),
}
# GRPO's own tuning (--tune-grpo): each setting changed alone from RL_FLAGS, every method then shares the best
GRPO_GRID = {"--lr": ["5e-5", "1e-4", "2e-4"], "--rollout-batch-size": ["8", "16", "32"]}
FINAL_WINDOW = 3  # evaluations averaged for "final accuracy" and for reaching the target
PHASES = ("seconds_rollout", "seconds_reward", "seconds_logprobs", "seconds_update", "seconds_sync")


def pool_size() -> int:
    """The training pool of every run (RL_FLAGS' --data-train-size)."""
    return int(RL_FLAGS[RL_FLAGS.index("--data-train-size") + 1])


def task_flags(task: str) -> list[str]:
    """The synthetic task and its response limit, for every run of the bench."""
    return ["--synthetic-task", task, "--rollout-max-response-len",
            str(TASK_SETTINGS[task]["rollout_max_response_len"])]


def warm_start_flags(task: str) -> list[str]:
    """The warm-start settings of `task`, written out: the warm start and the supervised control both use them, so
    the control trains on exactly the warm start's data (the same pool, cells and seed)."""
    defaults = TASK_SETTINGS[task]
    cells = defaults["warm_start_cells"]
    return ["--warm-start-lr", str(defaults["warm_start_lr"]), "--warm-start-batch-size",
            str(defaults["warm_start_batch_size"]), "--warm-start-problems", str(defaults["warm_start_problems"]),
            *(["--warm-start-cells", *cells] if cells else [])]


@dataclass
class Settings:
    out_dir: Path
    methods: list[str]
    seeds: list[int]
    variant_seeds: list[int]
    budget_s: float
    task: str
    warm_start_steps: int
    eval_interval: int
    eval_size: int
    control: bool
    math_budget_s: float
    processes: int
    quick: bool
    page: Path | None
    figures_dir: Path
    tune_grpo: bool = False
    analyse_only: bool = False  # --analyse-only: the page from the finished runs, none started
    records_dir: Path | None = None  # RECORDS_DIR at the full benchmark's settings; None: --no-records, --quick, ...


@dataclass
class ModelSize:
    parameters: int
    layers: int
    hidden: int


# ------------------------------------------------------------------------------------------------ running
def command_for(flags: list[str], log_dir: Path, processes: int) -> list[str]:
    # --standalone: a free rendezvous port, so runs of other people on the machine do not collide with ours
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            str(REPO / "examples" / "pretrain_dppo.py"), *flags, "--log-dir", str(log_dir)]


def launch(flags: list[str], log_dir: Path, processes: int) -> float:
    """One training run through the real entry point; returns its wall seconds. Output goes to log_dir/stdout.log."""
    shutil.rmtree(log_dir, ignore_errors=True)  # a run cut short cannot be resumed by budget: start it again
    log_dir.mkdir(parents=True)
    command = command_for(flags, log_dir, processes)
    (log_dir / "command.txt").write_text(" ".join(command[1:]) + "\n")
    start = time.perf_counter()
    with open(log_dir / "stdout.log", "w") as log:
        result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"training run failed (exit {result.returncode}); its output is in {log_dir / 'stdout.log'}"
                           f" and its command in {log_dir / 'command.txt'}")
    return seconds


def finished(run_dir: Path, flags: list[str] | None = None, processes: int = 0) -> bool:
    """The run completed (summary.json) and, when flags are given, with exactly this command (else it re-runs)."""
    if not (run_dir / "summary.json").is_file():
        return False
    if flags is None:
        return True
    recorded = (run_dir / "command.txt").read_text().strip() if (run_dir / "command.txt").is_file() else ""
    return recorded == " ".join(command_for(flags, run_dir, processes)[1:])


PAUSE_FILE = "pause"  # runs/<bench>/pause: hold before the next run (a run in progress is never disturbed)
PAUSE_POLL_S = 5.0


def hold_while_paused(run_dir: Path) -> None:
    """Wait while a file named PAUSE_FILE is in any folder above `run_dir` up to runs/: a long benchmark is held
    between runs, so that the machine can do other work without disturbing a timed run."""
    folders = [folder for folder in run_dir.parents if (folder / PAUSE_FILE).is_file()]
    if folders:
        print(f"holding before {run_dir}: remove {folders[0] / PAUSE_FILE} to go on", flush=True)
    while any((folder / PAUSE_FILE).is_file() for folder in run_dir.parents):
        time.sleep(PAUSE_POLL_S)


def launch_unless_finished(flags: list[str], run_dir: Path, processes: int) -> Path:
    """Run unless finished; a failed run is tried once more (its first log kept as failed_attempt.log), because the
    trainer's --time-budget-s stop is decided by each rank on its own clock and can desynchronise the ranks' last
    collective (a known trainer issue, reported); a second failure is raised."""
    if finished(run_dir, flags, processes):
        return run_dir
    hold_while_paused(run_dir)
    try:
        launch(flags, run_dir, processes)
    except RuntimeError as error:
        failed_log = (run_dir / "stdout.log").read_text()
        print(f"retrying once: {error}", flush=True)
        launch(flags, run_dir, processes)
        (run_dir / "failed_attempt.log").write_text(failed_log)
    return run_dir


def prepare_warm_start(settings: Settings, measure_rate: bool = True) -> tuple[Path, float | None]:
    """The shared warm-start checkpoint and the measured supervised steps per second of building it (None without
    measure_rate: bench/peer_grpo.py needs the checkpoint only)."""
    root, cache = settings.out_dir / "warm_start", settings.out_dir / "cache" / "warm"
    flags = ["--seed", str(settings.seeds[0]), "--cache-dir", str(cache), "--warm-start-steps",
             str(settings.warm_start_steps), *warm_start_flags(settings.task), "--train-iters", "0", "--eval-size",
             str(settings.eval_size), *RL_FLAGS, *task_flags(settings.task)]
    # Both runs time themselves the same way (the trainer's summary "seconds"); the difference is the supervised part.
    timing = {"steps": settings.warm_start_steps}
    for name in ("build", "cached") if measure_rate else ("build",):
        run_dir = launch_unless_finished(flags, root / name, settings.processes)
        timing[f"seconds_{name}"] = json.loads((run_dir / "summary.json").read_text())["seconds"]
    found = sorted(cache.glob("embedded_*/warm_start"))
    if len(found) != 1:
        raise RuntimeError(f"expected one warm start under {cache}, found {len(found)} (a changed warm-start "
                           f"setting or cache key): delete {cache} and {root} and run again")
    if not measure_rate:
        return found[0], None
    seconds = timing["seconds_build"] - timing["seconds_cached"]
    if seconds <= 0:
        raise RuntimeError(f"the warm start built faster than it loaded from cache ({timing}): the machine was too "
                           f"noisy to time it, or the build found a cache; delete {root} and {cache} and run again")
    return found[0], timing["steps"] / seconds


def seeds_of(settings: Settings, method: str) -> list[int]:
    """The RL seeds a method runs with: every seed for METHODS and ABLATIONS, --variant-seeds among them for
    VARIANTS."""
    return [seed for seed in settings.seeds if method not in VARIANTS or seed in settings.variant_seeds]


def rl_flags(settings: Settings, method: str, seed: int, warm_start: Path) -> list[str]:
    """The trainer flags of one RL run (bench/peer_grpo.py gives the TRL peer these very settings)."""
    # --load pins the start to the shared warm start and --seed stays the warm start's, so every run shares one
    # embedded init (the rollout engine's starting file, overwritten by the first weight sync); --rl-seed varies the
    # RL randomness only.
    return [*RL_FLAGS, *task_flags(settings.task), *ALL_METHODS[method], "--seed", str(settings.seeds[0]),
            "--rl-seed", str(seed), "--load", str(warm_start),
            "--cache-dir", str(settings.out_dir / "cache" / "init"), "--warm-start-steps", "0",
            "--time-budget-s", str(settings.budget_s), "--eval-interval", str(settings.eval_interval),
            "--eval-size", str(settings.eval_size)]


def run_rl(settings: Settings, method: str, seed: int, warm_start: Path) -> Path:
    return launch_recorded(settings, rl_flags(settings, method, seed, warm_start),
                           settings.out_dir / "runs" / method / f"seed_{seed}")


# ------------------------------------------------------------------------------------------------ records
# Finished RL runs and the control are also kept, compressed, in the repository (RECORDS_DIR), so that the full table
# is finished over several sittings on fresh machines: a run recorded there with the same command (paths of the repo
# and of --out-dir aside) and from the same warm start (its held-out accuracy at the start, 1024 greedy answers) is
# restored into --out-dir instead of run again. The warm start itself is rebuilt (deterministic on the CPU build).
RECORDS_DIR = REPO / "bench" / "records" / "time_to_accuracy"
RECORD_FILES = ("summary.json", "metrics.jsonl", prompt_prediction.OUTCOMES_FILE)  # stored gzipped, + command.txt


def portable_command(command: str, out_dir: Path) -> str:
    """A run's command line (command.txt) with this checkout's and this --out-dir's paths named by placeholders."""
    return command.strip().replace(str(REPO), "$REPO").replace(str(out_dir), "$OUT")


def warm_start_accuracy(settings: Settings) -> float:
    return json.loads((settings.out_dir / "warm_start" / "build" / "summary.json").read_text())[
        "heldout_accuracy_before"]


def save_record(settings: Settings, run_dir: Path, record_dir: Path) -> None:
    """Copy a finished run's command (portable) and files (gzipped, without timestamps) to record_dir."""
    record_dir.mkdir(parents=True, exist_ok=True)
    (record_dir / "command.txt").write_text(
        portable_command((run_dir / "command.txt").read_text(), settings.out_dir) + "\n")
    for name in RECORD_FILES:
        if (run_dir / name).is_file():
            with open(record_dir / f"{name}.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
                out.write((run_dir / name).read_bytes())


def restore_record(settings: Settings, record_dir: Path, run_dir: Path, flags: list[str],
                   from_warm_start: bool = True) -> bool:
    """Restore record_dir into run_dir if it holds this very run: same command and, for a run that starts from the
    warm start (from_warm_start: RL runs; the control is a warm start of its own), the same warm start."""
    if not (record_dir / "command.txt").is_file() or not (record_dir / "summary.json.gz").is_file():
        return False
    command = " ".join(command_for(flags, run_dir, settings.processes)[1:])
    if portable_command(command, settings.out_dir) != (record_dir / "command.txt").read_text().strip():
        print(f"not restoring {record_dir}: it was run with another command (see its command.txt)", flush=True)
        return False
    recorded = json.loads(gzip.decompress((record_dir / "summary.json.gz").read_bytes()))["heldout_accuracy_before"]
    expected = warm_start_accuracy(settings)
    if from_warm_start and abs(recorded - expected) > 1e-9:
        raise RuntimeError(
            f"{record_dir} starts from another warm start (held-out accuracy {recorded} against this one's "
            f"{expected}): a changed warm-start setting, torch build or machine. Delete {RECORDS_DIR} to run every "
            "method again from this warm start, or pass --no-records")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text(command + "\n")
    for name in RECORD_FILES:
        if (record_dir / f"{name}.gz").is_file():
            (run_dir / name).write_bytes(gzip.decompress((record_dir / f"{name}.gz").read_bytes()))
    print(f"restored {run_dir} from {record_dir}", flush=True)
    return True


def launch_recorded(settings: Settings, flags: list[str], run_dir: Path, from_warm_start: bool = True) -> Path:
    """launch_unless_finished, reading the run back from settings.records_dir when it was recorded there, and
    recording it there when it finishes; with --analyse-only, the reading back only (the run may stay unfinished)."""
    record_dir = settings.records_dir / run_dir.relative_to(settings.out_dir) if settings.records_dir else None
    if record_dir and not finished(run_dir, flags, settings.processes):
        restore_record(settings, record_dir, run_dir, flags, from_warm_start)
    if settings.analyse_only:
        return run_dir
    launch_unless_finished(flags, run_dir, settings.processes)
    if record_dir and not (record_dir / "summary.json.gz").is_file():
        save_record(settings, run_dir, record_dir)
    return run_dir


def flag_value(flags: list[str], name: str) -> str:
    """The last value given to `name` in a flag list (argparse keeps the last)."""
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def grpo_settings() -> list[tuple[str, list[str]]]:
    """(label, extra flags) of the GRPO tuning runs: RL_FLAGS' own setting, then one setting changed at a time."""
    settings = [("RL_FLAGS", [])]
    for flag, values in GRPO_GRID.items():
        settings += [(f"{flag} {value}", [flag, value]) for value in values if value != flag_value(RL_FLAGS, flag)]
    return settings


def tune_grpo(settings: Settings, warm_start: Path) -> str:
    """GRPO at each of grpo_settings() over the seeds, scored by the mean held-out accuracy over the RL budget (the
    area under its seed-mean accuracy-vs-time curve / the budget: higher is faster to any accuracy); a table."""
    rows = []
    for label, extra in grpo_settings():
        runs = []
        for seed in settings.seeds:
            run_dir = settings.out_dir / "tuning" / label.replace(" ", "_").lstrip("-") / f"seed_{seed}"
            launch_unless_finished([*rl_flags(settings, "grpo", seed, warm_start), *extra], run_dir,
                                   settings.processes)
            runs.append(with_costs(load_run(run_dir, label), None, False))
        curve = mean_curve([accuracy_points(run, "seconds_steps") for run in runs])
        area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(curve, curve[1:]))
        rows.append([label, f"{area / max(curve[-1][0], 1e-9):.3f}", f"{final_accuracy(curve):.3f}",
                     f"{statistics.fmean(len(run.records) for run in runs):.0f}"])
    best = max(rows, key=lambda row: float(row[1]))
    return (markdown(["GRPO setting", "mean held-out accuracy over the budget", "final accuracy", "steps"], rows)
            + f"\n\nBest: {best[0]} ({len(settings.seeds)} seeds, {settings.budget_s:.0f} s each).")


def run_control(settings: Settings, steps_per_second: float) -> tuple[Path, int]:
    """More supervised steps in place of RL: the warm start lengthened by the RL budget's worth of steps, on the same
    warm-start data (same flags and seed, so the same problems in the same order, then more epochs of them)."""
    extra_steps = round(settings.budget_s * steps_per_second)
    run_dir = launch_recorded(
        settings,
        ["--seed", str(settings.seeds[0]), "--cache-dir", str(settings.out_dir / "cache" / "control"),
         "--warm-start-steps", str(settings.warm_start_steps + extra_steps), *warm_start_flags(settings.task),
         "--train-iters", "0", "--eval-size", str(settings.eval_size), *RL_FLAGS, *task_flags(settings.task)],
        settings.out_dir / "runs" / CONTROL / f"seed_{settings.seeds[0]}", from_warm_start=False)
    return run_dir, extra_steps


def prepare_math_model(out_dir: Path) -> Path:
    """A tiny random Qwen2-style model whose tokenizer is the character tokenizer for text."""
    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config
    from megatron_dppo.data.tokenizer import CharTokenizer

    model_dir = out_dir / "math_model"
    if not (model_dir / "config.json").is_file():
        tokenizer = CharTokenizer.for_text()
        config = tiny_hf_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                **MATH_MODEL)
        save_random_hf_model(config, model_dir, seed=0)
        tokenizer.save_pretrained(model_dir)
    return model_dir


def run_math(settings: Settings, method: str, seed: int, model_dir: Path) -> Path:
    return launch_unless_finished(
        [*MATH_FLAGS, *ALL_METHODS[method], "--hf-checkpoint", str(model_dir), "--seed", str(seed),
         "--time-budget-s", str(settings.math_budget_s)], settings.out_dir / "math" / method / f"seed_{seed}",
        settings.processes)


# ------------------------------------------------------------------------------------------------ analysis
def model_size(model_dir: Path) -> ModelSize:
    """Parameter count (tied embedding once), layers and hidden size of an HF model directory."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    parameters = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                parameters += math.prod(tensors.get_slice(name).get_shape())
    if parameters == 0:
        raise RuntimeError(f"no safetensors weights in {model_dir}: the model directory is incomplete")
    return ModelSize(parameters, config["num_hidden_layers"], config["hidden_size"])


def step_flops(record: dict, size: ModelSize, old_logprob_pass: bool) -> tuple[float, float]:
    """(training, rollout) FLOPs of one step from its logged token counts (formula in the module docstring)."""
    trained = float(record.get("tokens_trained", 0))
    generated = float(record.get("tokens_generated", 0))
    # kept_fraction counts kept samples over drawn prompts x G; rollouts are the prompt level's survivors x G
    rollouts = generated / max(record.get("response_length_mean", 0.0), 1e-9)
    kept_sequences = record.get("kept_fraction", 0.0) / max(record.get("kept_fraction_prompts", 1.0), 1e-9) * rollouts
    context = trained / kept_sequences if kept_sequences > 0 else 0.0
    forward_per_token = 2 * size.parameters + 4 * size.layers * size.hidden * context / 2
    passes = 3 + (1 if old_logprob_pass else 0)  # forward + backward (2x forward) [+ old-log-prob forward]
    rollout_context = record.get("response_length_mean", 0.0) / 2
    return (trained * forward_per_token * passes,
            generated * (2 * size.parameters + 4 * size.layers * size.hidden * rollout_context))


def with_costs(run: Run, size: ModelSize | None, old_logprob_pass: bool) -> Run:
    """The run with cumulative cost columns added to every record: seconds_steps (RL wall time without
    evaluations), tokens_generated_total, tokens_trained_total, flops_total (training + rollout; 0 without a
    model size)."""
    totals = {"seconds_steps": 0.0, "tokens_generated_total": 0.0, "tokens_trained_total": 0.0, "flops_total": 0.0}
    records = []
    for record in run.records:
        train, rollout = step_flops(record, size, old_logprob_pass) if size is not None else (0.0, 0.0)
        totals["seconds_steps"] += float(record.get("seconds_step", 0.0))
        totals["tokens_generated_total"] += float(record.get("tokens_generated", 0))
        totals["tokens_trained_total"] += float(record.get("tokens_trained", 0))
        totals["flops_total"] += train + rollout
        records.append({**record, **totals})
    return Run(run.label, records, run.summary)


def accuracy_points(run: Run, x_key: str) -> list[tuple[float, float]]:
    """(x, held-out accuracy): the warm start at 0, every logged evaluation, the final evaluation at the end."""
    xs, accuracies = run.series("heldout_accuracy", x_key)
    if not xs:
        raise ValueError(f"run {run.label!r} has no held-out accuracy: it needs summary.json or --eval-interval")
    return list(zip(xs, accuracies))


def final_accuracy(points: list[tuple[float, float]], window: int = FINAL_WINDOW) -> float:
    return statistics.fmean(accuracy for _, accuracy in points[-window:])


def time_to_reach(points: list[tuple[float, float]], target: float, window: int = FINAL_WINDOW) -> float | None:
    """First x at which the trailing mean of `window` evaluations reaches `target`; None if it never does."""
    for index, (x, _) in enumerate(points):
        recent = [accuracy for _, accuracy in points[max(0, index - window + 1):index + 1]]
        if statistics.fmean(recent) >= target - 1e-12:
            return x
    return None


def mean_curve(points_by_seed: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Evaluation by evaluation: the mean RL time and the mean held-out accuracy over seeds (a method's seeds
    evaluate at the same steps; cut to the seed with the fewest evaluations)."""
    count = min(len(points) for points in points_by_seed)
    return [(statistics.fmean(points[i][0] for points in points_by_seed),
             statistics.fmean(points[i][1] for points in points_by_seed)) for i in range(count)]


def crossing_time(points: list[tuple[float, float]], target: float, window: int = FINAL_WINDOW) -> float | None:
    """When the trailing mean of `window` evaluations first reaches `target`, linearly interpolated between the two
    evaluations it lies between (a resolution finer than the evaluation interval); None if it never does."""
    trailing = list(zip([x for x, _ in points], smoothed([y for _, y in points], window)))
    for index, (x, y) in enumerate(trailing):
        if y >= target - 1e-12:
            if index == 0:
                return x
            (x0, y0) = trailing[index - 1]
            return x0 + (x - x0) * (target - y0) / (y - y0)
    return None


def compare_mean_curves(curves: dict[str, dict[int, list]], baseline: str = "grpo", resamples: int = 2000,
                        seed: int = 0) -> dict[str, dict]:
    """The headline comparison, on each method's seed-mean curve: the target is the baseline's final accuracy
    (of its seed-mean curve); time to target is where a seed-mean curve's trailing mean crosses it
    (crossing_time); speed-up = baseline time / method time. The 95% interval resamples each method's seeds
    and the baseline's (with replacement, independently, target recomputed) `resamples` times. A baseline that
    never crosses counts its whole run; a method resample that never crosses counts its whole run too (an upper
    bound of its speed-up), and "crossed" says how often that did not happen."""
    if baseline not in curves or not curves[baseline]:
        raise ValueError(f"no {baseline} runs to compare against: include {baseline} in --methods")

    def times(base_points: list, method_points: list) -> tuple[float, float | None, float]:
        base_curve, method_curve = mean_curve(base_points), mean_curve(method_points)
        target = final_accuracy(base_curve)
        base_time = crossing_time(base_curve, target) or base_curve[-1][0]
        return base_time, crossing_time(method_curve, target), method_curve[-1][0]

    rng = random.Random(seed)
    base_points = list(curves[baseline].values())
    target = final_accuracy(mean_curve(base_points))
    results = {}
    for method, by_seed in curves.items():
        points = list(by_seed.values())
        base_time, method_time, _ = times(base_points, points)
        ratios, crossed = [], 0
        for _ in range(resamples):
            base_sample = [rng.choice(base_points) for _ in base_points]
            method_sample = [rng.choice(points) for _ in points]
            sample_base, sample_time, sample_end = times(base_sample, method_sample)
            crossed += sample_time is not None
            ratios.append(sample_base / max(sample_time if sample_time is not None else sample_end, 1e-9))
        ratios.sort()
        finals = [final_accuracy(p) for p in points]
        results[method] = {
            "target": target, "baseline_seconds": base_time, "seconds": method_time,
            "speedup": base_time / method_time if method_time else None,
            "interval": (ratios[int(0.025 * resamples)], ratios[min(int(0.975 * resamples), resamples - 1)]),
            "crossed": crossed / resamples, "final_mean": statistics.fmean(finals),
            "final_se": statistics.stdev(finals) / math.sqrt(len(finals)) if len(finals) > 1 else 0.0,
        }
    return results


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def compare_to_baseline(curves: dict[str, dict[int, list]], baseline: str = "grpo") -> dict[str, dict]:
    """Per method: final accuracy (mean, std over seeds), time to the baseline's final accuracy per seed, and the
    speed-up per seed (baseline time over method time) where both seeds exist. "baseline_times" holds the
    baseline's time per seed that every speed-up divides (its whole run where it never reaches the target)."""
    if baseline not in curves or not curves[baseline]:
        raise ValueError(f"no {baseline} runs to compare against: include {baseline} in --methods")
    target = statistics.fmean(final_accuracy(points) for points in curves[baseline].values())
    baseline_times = {}
    for seed, points in curves[baseline].items():
        reached = time_to_reach(points, target)
        baseline_times[seed] = reached if reached is not None else points[-1][0]
    results = {}
    for method, by_seed in curves.items():
        finals = [final_accuracy(points) for points in by_seed.values()]
        times = {seed: time_to_reach(points, target) for seed, points in by_seed.items()}
        speedups = [baseline_times[seed] / times[seed] for seed in sorted(times)
                    if times[seed] and seed in baseline_times]
        results[method] = {
            "target": target, "seeds": len(by_seed),
            "final_mean": statistics.fmean(finals), "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "times": times, "reached": sum(t is not None for t in times.values()),
            "speedup": median_spread(speedups) if speedups else None, "baseline_times": baseline_times,
        }
    return results


def value_at(run: Run, key: str, x_key: str, x: float | None) -> float | None:
    """The cumulative `key` at the first record whose `x_key` reaches x (x = 0: nothing spent yet)."""
    if x is None:
        return None
    if x <= 0:
        return 0.0
    for record in run.records:
        if record[x_key] >= x - 1e-12:
            return float(record[key])
    return float(run.records[-1][key])


def seed_mean_runs(groups: dict[str, dict[int, Run]]) -> list[Run]:
    """One curve per method for the figure: held-out accuracy averaged over seeds evaluation by evaluation (a
    method's seeds evaluate at the same steps; cut to the seed with the fewest), at the seeds' mean RL time, then
    the trailing mean of FINAL_WINDOW evaluations that the time to target uses."""
    curves = []
    for method, by_seed in groups.items():
        points = mean_curve([accuracy_points(run, "seconds_steps") for run in by_seed.values()])
        ys = smoothed([y for _, y in points], FINAL_WINDOW)
        curves.append(Run(method, [{"seconds_steps": x, "heldout_accuracy": y} for (x, _), y in zip(points, ys)]))
    return curves


def phase_breakdown(runs: list[Run]) -> dict[str, float]:
    """Mean seconds per step of each phase over every step of the runs, the rest as 'other', and rates."""
    records = [r for run in runs for r in run.records]
    if not records:
        raise ValueError("no step records to break down")
    mean = {phase: statistics.fmean(float(r.get(phase, 0.0)) for r in records) for phase in PHASES}
    step = statistics.fmean(float(r.get("seconds_step", 0.0)) for r in records)
    mean["other"] = step - sum(mean.values())
    mean["seconds_step"] = step
    for key in ("kept_fraction", "packing_density", "reward_mean", "tokens_generated", "tokens_trained"):
        mean[key] = statistics.fmean(float(r.get(key, 0.0)) for r in records)
    return mean


def steps_at(run: Run, seconds: float) -> float:
    """Steps taken by the first record whose RL time reaches `seconds` (0 at 0 s)."""
    return value_at(run, "step", "seconds_steps", seconds)


def speedup_decomposition(runs: dict[str, dict[int, Run]], results: dict[str, dict],
                          baseline: str = "grpo") -> dict[str, dict]:
    """Per method, the speed-up (compare_mean_curves) split into fewer steps x shorter steps at the seed-mean times
    to target: step_ratio = the baseline's mean steps to its time / the method's mean steps to its time,
    step_time_ratio = baseline s/step / method s/step over those spans; their product is the speed-up."""
    out = {}
    base_time = results[baseline]["baseline_seconds"]
    base_steps = statistics.fmean(steps_at(run, base_time) for run in runs[baseline].values())
    for method, by_seed in runs.items():
        reached = results[method]["seconds"]
        if not reached:
            out[method] = {"steps": None, "step_ratio": None, "step_time_ratio": None}
            continue
        steps = statistics.fmean(steps_at(run, reached) for run in by_seed.values())
        out[method] = {"steps": steps, "step_ratio": base_steps / steps,
                       "step_time_ratio": (base_time / base_steps) / (reached / steps)}
    return out


def fit_step_cost(runs: list[Run]) -> dict[str, float]:
    """Least squares over every step: seconds_step ≈ fixed + per_iteration · decode_iterations + per_generated ·
    tokens_generated + per_trained · tokens_trained (decode_iterations: the engine's decode loop iterations, as many
    as the step's longest response, or the chunks' under partial rollouts; left out for runs that do not log it).
    Returns the coefficients (seconds, seconds per iteration or token) and the fit's R²."""
    import torch

    records = [r for run in runs for r in run.records]
    iterations = all("decode_iterations" in r for r in records)
    terms = ("decode_iterations",) * iterations + ("tokens_generated", "tokens_trained")
    if len(records) < 1 + len(terms):
        raise ValueError(f"{len(records)} step records cannot fit a {1 + len(terms)}-term cost model: run longer or "
                         "more runs")
    design = torch.tensor([[1.0] + [float(r.get(term, 0)) for term in terms] for r in records], dtype=torch.float64)
    target = torch.tensor([float(r.get("seconds_step", 0.0)) for r in records], dtype=torch.float64)
    coefficients = torch.linalg.lstsq(design, target.unsqueeze(1)).solution.squeeze(1)
    residual = target - design @ coefficients
    total = ((target - target.mean()) ** 2).sum()
    r_squared = float(1 - (residual ** 2).sum() / total) if total > 0 else 0.0
    fixed, *values = coefficients.tolist()
    per_term = dict(zip(terms, values))
    return {"fixed": fixed, "per_iteration": per_term.get("decode_iterations", 0.0),
            "per_generated": per_term["tokens_generated"], "per_trained": per_term["tokens_trained"],
            "r_squared": r_squared}


def token_dependent_seconds(cost: dict, phases: dict) -> float:
    """The part of a mean step (phase_breakdown) that scales with tokens, by the fit."""
    return cost["per_generated"] * phases["tokens_generated"] + cost["per_trained"] * phases["tokens_trained"]


# ------------------------------------------------------------------------------------------------ report
def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def fmt_speedup(speedup) -> str:
    if speedup is None:
        return "not reached"
    median, low, high = speedup
    return f"{median:.2f}x [{low:.2f}, {high:.2f}]"


def fmt_count(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def fmt_interval(result: dict) -> str:
    if result["speedup"] is None:
        return "not reached"
    low, high = result["interval"]
    crossed = "" if result["crossed"] >= 0.999 else f", {100 * result['crossed']:.0f}% of resamples reach"
    return f"**{result['speedup']:.2f}x** [{low:.2f}, {high:.2f}{crossed}]"


def accuracy_table(runs: dict[str, dict[int, Run]]) -> tuple[str, dict]:
    curves = {method: {seed: accuracy_points(run, "seconds_steps") for seed, run in by_seed.items()}
              for method, by_seed in runs.items()}
    results = compare_mean_curves(curves)
    per_seed = compare_to_baseline(curves)
    baseline_costs = {}
    rows = []
    for method, result in results.items():
        costs = {}
        for key in ("tokens_generated_total", "tokens_trained_total", "flops_total"):
            values = [value_at(run, key, "seconds_steps", result["seconds"]) for run in runs[method].values()]
            costs[key] = statistics.fmean(values) if result["seconds"] and None not in values else None
        if method == "grpo":
            baseline_costs = costs
        seed_result = per_seed[method]
        rows.append([method, f"{result['final_mean']:.3f} ± {result['final_se']:.3f}",
                     f"{result['seconds']:.0f}" if result["seconds"] else "-", fmt_interval(result),
                     f"{fmt_speedup(seed_result['speedup'])} ({seed_result['reached']}/{seed_result['seeds']})",
                     *[fmt_count(costs[k]) for k in costs], costs])
    for row in rows:
        costs = row.pop()
        ratios = [costs[k] / baseline_costs[k] if costs[k] and baseline_costs.get(k) else None for k in costs]
        row.append(" / ".join("-" if r is None else f"{r:.2f}" for r in ratios))
    header = ["method", "final accuracy (mean ± SE)", "s to target (seed-mean curve)",
              "speed-up vs GRPO [95% bootstrap interval]", "per seed: median [min, max] (seeds reaching)",
              "tokens generated to target", "tokens trained to target", "FLOPs to target",
              "cost vs GRPO (gen / trained / FLOPs)"]
    return markdown(header, rows), results


def phase_table(groups: dict[str, list[Run]]) -> str:
    rows = []
    for method, runs in groups.items():
        phases = phase_breakdown(runs)
        step = phases["seconds_step"]
        shares = [f"{1000 * phases[p]:.0f} ({100 * phases[p] / step:.0f}%)" for p in (*PHASES, "other")]
        rows.append([method, f"{1000 * step:.0f}", *shares, f"{phases['kept_fraction']:.2f}",
                     f"{phases['packing_density']:.2f}", f"{phases['reward_mean']:.3f}",
                     fmt_count(phases["tokens_generated"]), fmt_count(phases["tokens_trained"])])
    header = ["method", "ms/step", "rollout", "reward", "old logprobs", "update", "sync", "other", "kept fraction",
              "packing density", "mean reward", "tokens gen/step", "tokens trained/step"]
    return markdown(header, rows)


def decomposition_table(runs: dict[str, dict[int, Run]], results: dict[str, dict]) -> str:
    """Speed-up = fewer steps x shorter steps, and a token cost model of the step fitted on every run's steps."""
    parts = speedup_decomposition(runs, results)
    cost = fit_step_cost([run for by_seed in runs.values() for run in by_seed.values()])
    token_cost = {}
    for method, by_seed in runs.items():
        phases = phase_breakdown(list(by_seed.values()))
        token_cost[method] = (phases["seconds_step"], token_dependent_seconds(cost, phases))
    base_step, base_tokens = token_cost["grpo"]
    rows = []
    for method, part in parts.items():
        step, tokens = token_cost[method]
        rows.append([method, f"{part['steps']:.0f}" if part["steps"] is not None else "-",
                     f"{part['step_ratio']:.2f}x" if part["step_ratio"] else "-",
                     f"{part['step_time_ratio']:.2f}x" if part["step_time_ratio"] else "-",
                     f"{1000 * (step - tokens):.0f} / {1000 * tokens:.0f}", f"{base_tokens / tokens:.2f}x"
                     if tokens > 0 else "-"])
    header = ["method", "steps to target (seed mean)", "fewer steps: GRPO steps / steps",
              "shorter steps: GRPO s/step / s/step", "fixed / token-dependent ms per step (fit)",
              "GRPO token-dependent time / method's"]
    fit = (f"Fit over every step of every run (R² {cost['r_squared']:.2f}): step ≈ {1000 * cost['fixed']:.0f} ms "
           f"+ {1000 * cost['per_iteration']:.2f} ms per decode iteration + {1e6 * cost['per_generated']:.0f} µs per "
           f"generated token + {1e6 * cost['per_trained']:.0f} µs per trained token. Of GRPO's mean step "
           f"({1000 * base_step:.0f} ms) the part that does not scale with tokens (fixed and decode iterations) is "
           f"{100 * (base_step - base_tokens) / base_step:.0f}%.")
    return markdown(header, rows) + "\n\n" + fit


# Qwen3-4B on MATH on 8 H100s: the share of a GRPO step that is generation (the rest: log-probs and update), as peers
# report for long math responses; an assumption, not a measurement of ours
PROJECTION_GENERATION_SHARE = 0.65


def projection(runs: dict[str, dict[int, Run]], results: dict[str, dict], method: str = HEADLINE_METHOD) -> str:
    """The measured ratios carried to a token-bound step (no fixed cost): speed-up = fewer steps / (generation share
    x generated-token ratio + update share x trained-token ratio), per step, up to the time to target."""
    parts = speedup_decomposition(runs, results)
    if method not in runs or parts[method]["step_ratio"] is None:
        return f"No projection: {method} did not reach GRPO's final accuracy."
    per_step = {}
    for name in ("grpo", method):
        seconds = results[name]["seconds"] if name != "grpo" else results[name]["baseline_seconds"]
        steps = statistics.fmean(steps_at(run, seconds) for run in runs[name].values())
        per_step[name] = [statistics.fmean(value_at(run, key, "seconds_steps", seconds) for run in
                                           runs[name].values()) / steps
                          for key in ("tokens_generated_total", "tokens_trained_total")]
    generated = per_step[method][0] / per_step["grpo"][0]
    trained = per_step[method][1] / per_step["grpo"][1]
    share = PROJECTION_GENERATION_SHARE
    step_cost = share * generated + (1 - share) * trained
    return (f"Assumptions: (1) the step is token-bound: generation scales with generated tokens and the update with "
            f"trained tokens (at 4,096-token responses and batches of 32 x 8 a fixed cost like ours is small); "
            f"(2) a GRPO step is {100 * share:.0f}% generation and {100 * (1 - share):.0f}% log-probs and update; "
            f"(3) {method}'s measured ratios carry over: {generated:.2f}x GRPO's generated tokens and {trained:.2f}x "
            f"its trained tokens per step, and {parts[method]['step_ratio']:.2f}x fewer steps to GRPO's final "
            f"accuracy. Then a {method} step costs {share:.2f} x {generated:.2f} + {1 - share:.2f} x {trained:.2f} "
            f"= {step_cost:.2f} of GRPO's, and the time to target {1 / parts[method]['step_ratio']:.2f} x "
            f"{step_cost:.2f}: **about {parts[method]['step_ratio'] / step_cost:.2f}x** (the paper: 2.37x).")


def math_table(groups: dict[str, list[Run]], size: ModelSize) -> str:
    rows = []
    base = None
    for method, runs in groups.items():
        phases = phase_breakdown(runs)
        steps = statistics.fmean(len(run.records) for run in runs)
        flops = statistics.fmean(run.records[-1]["flops_total"] / max(len(run.records), 1) for run in runs)
        base = base or (phases["tokens_generated"], phases["tokens_trained"], flops, phases["seconds_step"])
        rows.append([method, f"{steps:.0f}", f"{phases['reward_mean']:.3f}", f"{1000 * phases['seconds_step']:.0f}",
                     f"{phases['kept_fraction']:.2f}", fmt_count(phases["tokens_generated"]),
                     fmt_count(phases["tokens_trained"]), fmt_count(flops),
                     f"{phases['seconds_step'] / base[3]:.2f} / {phases['tokens_trained'] / max(base[1], 1):.2f} / "
                     f"{flops / max(base[2], 1):.2f}"])
    header = ["method", "steps", "mean reward", "ms/step", "kept fraction", "tokens gen/step", "tokens trained/step",
              "FLOPs/step", "vs GRPO (s / trained / FLOPs per step)"]
    return markdown(header, rows) + f"\n\nModel: {size.parameters} parameters, {size.layers} layers, d={size.hidden}."


def first_epoch_end(run: Run, pool: int) -> int:
    """The step at which the run's draws have covered the pool once (after it, every prompt has a history)."""
    drawn = 0.0
    for record in run.records:
        drawn += float(record.get("prompts_drawn", 0.0))
        if drawn >= pool:
            return int(record["step"])
    return int(run.records[-1]["step"]) if run.records else 0


def prompt_level_table(root: Path, runs: dict[str, dict[int, Run]], pool: int) -> str:
    """Per method, summed over its seeds: epochs over the pool (drawn and rolled out), the share of drawn prompts
    the prompt level pruned after the first epoch, the share of rolled-out groups that were zero-variance, and how
    well the history predicted zero-variance groups after the first epoch (bench/prompt_prediction.py; each
    rolled-out group weighted by 1 / its keep probability)."""
    rows = []
    for method, by_seed in runs.items():
        drawn = rolled = pruned_late = drawn_late = zero = 0.0
        late_outcomes = []
        for seed, run in by_seed.items():
            boundary = first_epoch_end(run, pool)
            for record in run.records:
                drawn += float(record.get("prompts_drawn", 0.0))
                rolled += float(record.get("groups_rolled_out", 0.0))
                zero += float(record.get("zero_variance_groups_rolled_out", 0.0))
                if record["step"] > boundary:
                    drawn_late += float(record.get("prompts_drawn", 0.0))
                    pruned_late += float(record.get("prompts_pruned", 0.0))
            late_outcomes += [outcome for outcome in prompt_prediction.read_outcomes(root / method / f"seed_{seed}")
                              if outcome["step"] > boundary]
        quality = prompt_prediction.recorded_quality(late_outcomes)
        count = len(by_seed)
        rows.append([method, f"{drawn / count / pool:.1f}", f"{rolled / count / pool:.1f}",
                     f"{pruned_late / drawn_late:.2f}" if drawn_late else "-",
                     f"{zero / rolled:.2f}" if rolled else "-",
                     f"{quality.precision:.2f}", f"{quality.recall:.2f}",
                     f"{quality.brier:.3f} ({quality.base_brier:.3f})"])
    header = ["method", "epochs drawn", "epochs rolled out", "drawn prompts pruned after the first epoch",
              "rolled-out groups zero-variance", "prediction precision", "prediction recall",
              "Brier (base rate's)"]
    return markdown(header, rows)


def load_groups(root: Path, seeds_by_method: dict[str, list[int]], size: ModelSize) -> dict[str, dict[int, Run]]:
    groups = {}
    for method, seeds in seeds_by_method.items():
        by_seed = {}
        for seed in seeds:
            run_dir = root / method / f"seed_{seed}"
            if finished(run_dir):
                old_pass = method == "d3s"  # the trainer's only old-log-prob pass with one on-policy epoch
                by_seed[seed] = with_costs(load_run(run_dir, method), size, old_pass)
        if by_seed:
            groups[method] = by_seed
    return groups


def write_page(page: Path, block: str, generated: str) -> None:
    """Replace the page's generated block named `block` (between its markers), keeping the text around it."""
    begin, end = f"<!-- BEGIN GENERATED {block} by bench/time_to_accuracy.py -->", f"<!-- END GENERATED {block} -->"
    text = page.read_text() if page.is_file() else "# Results\n"
    if begin not in text:
        text = f"{text.rstrip()}\n\n{begin}\n{end}\n"
    if end not in text:
        raise ValueError(f"{page} has {begin!r} but not {end!r}: restore the end marker after the generated block")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    page.write_text(f"{head}{begin}\n{generated}\n{end}{tail}")


def page_block(task: str, quick: bool) -> str:
    """The name of a run's generated block on the page (and of its figures folder): quick / full, per task."""
    return ("quick" if quick else "full") + ("" if task == "worked" else f"-{task}")


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke check: 1 seed, 25 s budget, 200-step warm start, 128 evaluation problems")
    parser.add_argument("--methods", nargs="+", choices=list(ALL_METHODS), default=[*METHODS, *VARIANTS])
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="RL seeds (default 1 2 3 4 5; quick: 1)")
    parser.add_argument("--variant-seeds", nargs="+", type=int, default=[1, 2, 3],
                        help="the seeds (among --seeds) the VARIANTS run with (default 1 2 3)")
    parser.add_argument("--budget-s", type=float, default=None, help="RL wall time per run (default 150; quick 25)")
    parser.add_argument("--synthetic-task", choices=list(TASK_SETTINGS), default="worked",
                        help="worked (the embedded default) or the older answer-only task")
    parser.add_argument("--warm-start-steps", type=int, default=None,
                        help="default: the task's embedded default; quick 200")
    parser.add_argument("--eval-interval", type=int, default=None,
                        help="steps between evaluations (default 40: about 40 s of RL at a batch of 8; quick 25)")
    parser.add_argument("--eval-size", type=int, default=None, help="held-out problems (default 1024; quick 128)")
    parser.add_argument("--no-control", action="store_true", help="skip the supervised control")
    parser.add_argument("--math-budget-s", type=float, default=None,
                        help="RL seconds per MATH run (default 0: skipped); 60 gives the cost table on MATH prompts")
    parser.add_argument("--processes", type=int, default=2, help="torchrun --nproc-per-node")
    parser.add_argument("--out-dir", default=None, help="runs and caches (default runs/time_to_accuracy[_quick])")
    parser.add_argument("--write-page", default=None, help="rewrite the generated block of this markdown page")
    parser.add_argument("--figures-dir", default=None, help="default: <page dir>/figures, else <out-dir>/figures")
    parser.add_argument("--tune-grpo", action="store_true",
                        help="instead of the methods: GRPO over GRPO_GRID (one setting changed at a time from "
                             "RL_FLAGS), scored by its mean held-out accuracy over the budget; writes the grpo-tuning "
                             "block")
    parser.add_argument("--no-records", action="store_true",
                        help=f"neither restore nor record runs in {RECORDS_DIR.relative_to(REPO)} (the full "
                             "benchmark's finished runs, kept in the repository so that later sittings resume them)")
    parser.add_argument("--analyse-only", action="store_true",
                        help="start no run: the tables and the page from the runs already finished (and those the "
                             "records hold), each method with the seeds it has")
    args = parser.parse_args(argv)
    quick = args.quick

    def pick(value, full, smoke):
        return value if value is not None else (smoke if quick else full)

    task = args.synthetic_task
    suffix = ("" if task == "worked" else f"_{task}") + ("_quick" if quick else "")
    out_dir = Path(args.out_dir or f"runs/time_to_accuracy{suffix}")
    page = Path(args.write_page) if args.write_page else None
    settings = Settings(
        out_dir=out_dir, methods=["grpo", *[m for m in args.methods if m != "grpo"]],
        seeds=pick(args.seeds, [1, 2, 3, 4, 5], [1]), variant_seeds=args.variant_seeds,
        budget_s=pick(args.budget_s, 150.0, 25.0), task=task,
        warm_start_steps=pick(args.warm_start_steps, TASK_SETTINGS[task]["warm_start_steps"], 200),
        eval_interval=pick(args.eval_interval, 40, 25),
        eval_size=pick(args.eval_size, 1024, 128), control=not args.no_control,
        math_budget_s=pick(args.math_budget_s, 0.0, 0.0), processes=args.processes, quick=quick, page=page,
        figures_dir=Path(args.figures_dir) if args.figures_dir else (
            (page.parent if page else out_dir) / "figures" / page_block(task, quick)), tune_grpo=args.tune_grpo,
        analyse_only=args.analyse_only,
        # the records hold the full benchmark's runs only: its default settings and --methods/--seeds among them
        records_dir=None if args.no_records or quick or task != "worked" or any(
            value is not None for value in (args.budget_s, args.warm_start_steps, args.eval_interval, args.eval_size))
        else RECORDS_DIR)
    for name, value in (("--budget-s", settings.budget_s), ("--warm-start-steps", settings.warm_start_steps),
                        ("--eval-interval", settings.eval_interval), ("--eval-size", settings.eval_size)):
        if value <= 0:
            parser.error(f"{name} {value} must be > 0")
    if settings.math_budget_s < 0:
        parser.error(f"--math-budget-s {settings.math_budget_s} must be >= 0 (0 skips the MATH table)")
    return settings


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    started = time.perf_counter()
    warm_start, sft_steps_per_second = prepare_warm_start(settings)
    if settings.tune_grpo:
        report = tune_grpo(settings, warm_start)
        print(report)
        if settings.page:
            write_page(settings.page, "grpo-tuning", report)
        return
    for seed in settings.seeds:  # seed by seed, so that a change in the machine's load falls on every method alike
        for method in (method for method in settings.methods if seed in seeds_of(settings, method)):
            if finished(run_rl(settings, method, seed, warm_start)):
                print(f"finished {method} seed {seed} ({time.perf_counter() - started:.0f} s so far)", flush=True)
    size = model_size(next((settings.out_dir / "cache" / "init").glob("embedded_*/init")))
    groups = load_groups(settings.out_dir / "runs", {method: seeds_of(settings, method)
                                                     for method in settings.methods}, size)
    table, results = accuracy_table(groups)
    flat = {method: list(by_seed.values()) for method, by_seed in groups.items()}
    sections = [
        f"Settings: the {settings.task} synthetic task, {len(settings.seeds)} seed(s) {settings.seeds} (the "
        f"variants {', '.join(m for m in settings.methods if m in VARIANTS) or 'none'}: seeds "
        f"{settings.variant_seeds}), RL budget "
        f"{settings.budget_s:.0f} s per run, warm start {settings.warm_start_steps} supervised steps "
        f"(`{' '.join(warm_start_flags(settings.task))}`), {settings.eval_size} held-out problems every "
        f"{settings.eval_interval} steps, {settings.processes} processes. Model: {size.parameters} parameters.\n"
        f"Finished runs (seeds): " + "; ".join(f"{m} {sorted(by_seed)}" for m, by_seed in groups.items()) + ".\n"
        f"Common RL flags: `{' '.join(RL_FLAGS + task_flags(settings.task))}`; per method: "
        + "; ".join(f"{m}: `{' '.join(ALL_METHODS[m])}`" for m in settings.methods) + ".",
        f"### Time to GRPO's final accuracy ({results['grpo']['target']:.3f}) on the {settings.task} synthetic "
        f"task\n\n{table}",
        f"### The prompt level at work (all seeds; epochs over the {pool_size()}-problem pool)\n\n"
        f"{prompt_level_table(settings.out_dir / 'runs', groups, pool_size())}",
        f"### Where the time goes (mean per step, ms and share of the step)\n\n{phase_table(flat)}",
        f"### Fewer steps or shorter steps\n\n{decomposition_table(groups, results)}",
        f"### Projection for Qwen3-4B on MATH, 8 H100s (on paper, not measured)\n\n{projection(groups, results)}",
    ]
    control_dir, extra_steps = run_control(settings, sft_steps_per_second) if settings.control else (None, 0)
    if control_dir and finished(control_dir):  # --analyse-only: when it has run (here or in the records)
        control = json.loads((control_dir / "summary.json").read_text())
        rl_finals = {m: r["final_mean"] for m, r in results.items()}
        sections.append(
            f"### Supervised control (seed {settings.seeds[0]})\n\n"
            f"The warm start measured {sft_steps_per_second:.2f} supervised steps/s, so the RL budget of "
            f"{settings.budget_s:.0f} s buys {extra_steps} more supervised steps on the same warm-start data: a warm "
            f"start of {settings.warm_start_steps + extra_steps} steps reaches held-out accuracy "
            f"**{control['heldout_accuracy_before']:.3f}**, against "
            + ", ".join(f"{m} {a:.3f}" for m, a in rl_finals.items()) + " (final accuracy of RL, mean over seeds).")
    figures = plot_runs([run for runs in flat.values() for run in runs], settings.figures_dir,
                        ("heldout_accuracy", "reward_mean"), ("seconds_steps",), smooth=10,
                        title=f"{settings.task} synthetic task: all methods, all seeds")
    figures += plot_runs(seed_mean_runs(groups), settings.figures_dir / "seed_mean", ("heldout_accuracy",),
                         ("seconds_steps",), title=f"{settings.task} synthetic task: mean over seeds, trailing mean of "
                                                   f"{FINAL_WINDOW} evaluations")
    link_root = settings.page.parent if settings.page else settings.out_dir
    sections.append("\n".join(f"![{path.parent.name}/{path.stem}]({os.path.relpath(path, link_root)})"
                               for path in figures))
    if settings.math_budget_s > 0:
        model_dir = prepare_math_model(settings.out_dir)
        math_size = model_size(model_dir)
        for method in settings.methods:
            run_math(settings, method, settings.seeds[0], model_dir)
        math_groups = load_groups(settings.out_dir / "math", dict.fromkeys(settings.methods, settings.seeds[:1]),
                                  math_size)
        sections.append(f"### MATH train prompts, tiny random model, {settings.math_budget_s:.0f} s per method "
                        f"(seed {settings.seeds[0]})\n\n"
                        f"{math_table({m: list(r.values()) for m, r in math_groups.items()}, math_size)}")
    headline = results.get(HEADLINE_METHOD, {})
    last_line = (f"dppo_speedup_vs_grpo: {headline['speedup']:.2f} [{headline['interval'][0]:.2f}, "
                 f"{headline['interval'][1]:.2f}]" if headline.get("speedup") else "dppo_speedup_vs_grpo: nan")
    sections.append(f"Bench wall time (runs not already finished + analysis): {time.perf_counter() - started:.0f} s. "
                    f"Last line: `{last_line}`")
    report = "\n\n".join(sections)
    print(report)
    if settings.page:
        write_page(settings.page, page_block(settings.task, settings.quick), report)
    print(last_line)


if __name__ == "__main__":
    main()

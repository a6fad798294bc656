"""The time-to-accuracy bench's methods, settings and runs (bench/time_to_accuracy.py runs them, then reports).

    settings (parse_args) ─► warm start (prepare_warm_start: built, then cached, to time its supervised steps)
                         ─► RL runs (run_rl: every method x seed from that checkpoint, same flags and budget)
                         ─► supervised control (run_control) ─► MATH cost runs (run_math_methods, optional)
    --tune-grpo: GRPO's grid (run_grpo_tuning) instead of the methods

Every method runs every seed, and seed s of every method shares GRPO's seed s (PAIRING_FLAGS: the pool, its order,
the held-out set, the start), so that the report compares them seed by seed.
RL runs and the control go through launch_recorded: the full benchmark's finished runs are also kept, compressed,
in RECORDS_DIR, one folder per command, and a later sitting on any machine restores a run recorded with the same
command from the same warm start instead of running it again. bench/peer_grpo.py runs our GRPO side through these
very functions.
"""

import argparse
import gzip
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from bench.training_run import MACHINE_FILE, REPO, command_for, finished, launch_unless_finished
from megatron_dppo.metrics import OUTCOMES_FILE

# The two baselines, each at its own settings (every method's speed-up is read against both): GRPO as the DPPO paper
# ran it, training every group (--no-dapo-filter after RL_FLAGS' --dapo-filter: argparse keeps the last), and GRPO
# with DAPO's zero-variance filter, the stronger baseline of RL_FLAGS, which already skips much of what DPPO prunes.
BASELINES = {
    "grpo-paper": ["--algorithm", "grpo", "--no-dapo-filter"],
    "grpo": ["--algorithm", "grpo"],
    # what many users run (and what GRESO measured its 2.0x against): rounds of prompts until the batch holds B groups
    # with varied rewards, trained as the batch
    "dapo-dynamic-sampling": ["--algorithm", "grpo", "--dapo-dynamic-sampling"],
}
# DPPO's two forms, run with every seed like the baselines: the headline's
HEADLINE_METHODS = {
    # DPPO's defaults (docs/algorithms.md): the predictive prompt level, refill, 1/p weights, the completion level
    "dppo": ["--algorithm", "dppo"],
    "dppo-no-refill": ["--algorithm", "dppo", "--no-dppo-refill"],  # the paper's form: the batch shrinks as it prunes
}
# Run by default with the first Settings.secondary_seeds seeds only (seed s of each shares GRPO's seed s)
SECONDARY_METHODS = {
    "dppo-deterministic": ["--algorithm", "dppo", "--dppo-mode", "deterministic"],  # the paper's Algorithm 1
    "cppo": ["--algorithm", "cppo", "--cppo-refill"],  # with its paper's refill: batch / (1 - P) prompts drawn
    "d3s": ["--algorithm", "d3s"],
    # rollouts that do not wait for the longest response (cohorts carried over one step)
    "grpo-partial": ["--algorithm", "grpo", "--partial-rollout"],
}
METHODS = {**BASELINES, **HEADLINE_METHODS, **SECONDARY_METHODS}
# Available with --methods (the same seeds and settings), not run by default
VARIANTS = {
    # the same prompt level without the 1/p correction: the shortcut history-skipping methods (GRESO) take
    "dppo-uncorrected": ["--algorithm", "dppo", "--no-dppo-importance-weights"],
    "dppo-no-completion-level": ["--algorithm", "dppo", "--dppo-completion-prune-rate", "0"],
    "dppo-partial": ["--algorithm", "dppo", "--partial-rollout"],
    "grpo-async": ["--algorithm", "grpo", "--async"],
    "dppo-async": ["--algorithm", "dppo", "--async"],
    "dppo-p-min-0.1": ["--algorithm", "dppo", "--dppo-prompt-p-min", "0.1"],
}
ALL_METHODS = {**METHODS, **VARIANTS}
HEADLINE_METHOD = "dppo"
HEADLINE_BASELINE = "grpo-paper"  # the paper's comparison: the step decomposition and the projection read against it
CONTROL = "sft-control"
# The flags that decide what a seed's run trains and is scored on (megatron_dppo/launch/run.py build_task,
# pipeline/tasks.py synthetic_task): the training pool's content (the stream of --rl-seed, --data-train-size
# problems of --synthetic-task's or --data-synthetic-cells' cells), its order (PromptSampler seeded by --rl-seed),
# the held-out set (its fixed seed, --eval-size problems of the same cells) and the start (--seed: the embedded init;
# --load: the warm start). rl_flags gives every method's seed-s run GRPO's seed-s values of all of them, so that
# methods are compared seed by seed (the paired bootstrap, bench/accuracy_curves.py).
PAIRING_FLAGS = ("--prompt-data", "--synthetic-task", "--data-synthetic-cells", "--data-train-size", "--eval-size",
                 "--seed", "--rl-seed", "--load")
# The warm start of every run (and the model it starts from, and the supervised control's): the embedded default's
# own --seed, so that every run starts where README command 1's RL starts (held-out accuracy about 0.23); --rl-seed
# varies the RL randomness only
WARM_START_SEED = 1234
# Every method runs with these flags, so the page records them (the embedded defaults may change under us).
# The regime where RL learns: the embedded default's (README command 1) pool of 2048 problems and learning rate, in
# which RL gains 14-18 points in 240 s, with GRPO's best batch of 32 prompts x 8 (GRPO rolls each prompt out about
# 3 times in the budget; DPPO's refill draws each about 8 times, so the prompt level has a history to act on).
# --dapo-filter (drop zero-variance groups, exact) is the embedded default, kept for every method but grpo-paper.
# The MATH runs go without it: there each pruner meets them itself.
# --lr and --rollout-batch-size: GRPO's own best in this regime (--tune-grpo's grid from lr 1e-4 and batch 16: lr
# 5e-5 / 1e-4 / 2e-4, batch 8 / 16 / 32, one changed at a time; docs/results.md's grpo-tuning block: batch 32 scored
# best, 0.341 mean held-out accuracy over the budget against 0.321 at 16). 32 is the grid's edge; 64 is not tried.
RL_FLAGS = ["--lr", "1e-4", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
            "--rollout-temperature", "1.0", "--max-tokens-per-gpu", "4096",
            "--loss-agg-mode", "token-mean", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--kl-coef", "0",
            "--ppo-epochs", "1", "--data-train-size", "2048", "--dapo-filter"]
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
    secondary_seeds: int = 3  # SECONDARY_METHODS run with the first this many seeds
    max_seeds: int = 0  # seeds are added after `seeds` until the headline decides or there are this many
    tune_grpo: bool = False
    analyse_only: bool = False  # --analyse-only: the page from the finished runs, none started
    records_dir: Path | None = None  # RECORDS_DIR, read back from; None: --no-records, --quick, another task
    save_records: bool = False  # record finished runs in records_dir: at the full benchmark's default settings only


def page_block(task: str, quick: bool) -> str:
    """The name of a run's generated block on the page (and of its figures folder): quick / full, per task."""
    return ("quick" if quick else "full") + ("" if task == "worked" else f"-{task}")


def run_order(settings: Settings, seed: int, secondary: bool = False) -> list[str]:
    """The methods of settings.methods run with `seed`, in a random order of their own (seeded by the seed): the
    methods compared are interleaved, so that a slow stretch of the shared machine falls on no method more than
    another. secondary=False: the baselines and DPPO's two forms (the headline's, with every seed); True: the other
    methods, with the first settings.secondary_seeds seeds only."""
    if secondary:
        methods = [m for m in settings.methods
                   if m in SECONDARY_METHODS and seed in settings.seeds[:settings.secondary_seeds]]
    else:
        methods = [m for m in settings.methods if m not in SECONDARY_METHODS]
    return random.Random(seed).sample(methods, len(methods))


# ------------------------------------------------------------------------------------------------ runs
def prepare_warm_start(settings: Settings, measure_rate: bool = True) -> tuple[Path, float | None]:
    """The shared warm-start checkpoint and the measured supervised steps per second of building it (None without
    measure_rate: bench/peer_grpo.py needs the checkpoint only)."""
    root, cache = settings.out_dir / "warm_start", settings.out_dir / "cache" / "warm"
    flags = ["--seed", str(WARM_START_SEED), "--cache-dir", str(cache), "--warm-start-steps",
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


def rl_flags(settings: Settings, method: str, seed: int, warm_start: Path) -> list[str]:
    """The trainer flags of one RL run (bench/peer_grpo.py gives the TRL peer these very settings)."""
    method_flags = ALL_METHODS[method]
    if set(method_flags) & set(PAIRING_FLAGS):
        raise ValueError(f"{method}'s flags {method_flags} set {set(method_flags) & set(PAIRING_FLAGS)}: its seed-s "
                         "run would no longer share GRPO's seed-s pool, order, held-out set or start (PAIRING_FLAGS)")
    # --load pins the start to the shared warm start and --seed stays the warm start's, so every run shares one
    # embedded init (the rollout engine's starting file, overwritten by the first weight sync); --rl-seed, the same
    # for every method's seed s, decides the pool, its order, and the sampling and pruning draws.
    return [*RL_FLAGS, *task_flags(settings.task), *method_flags, "--seed", str(WARM_START_SEED),
            "--rl-seed", str(seed), "--load", str(warm_start),
            "--cache-dir", str(settings.out_dir / "cache" / "init"), "--warm-start-steps", "0",
            "--time-budget-s", str(settings.budget_s), "--eval-interval", str(settings.eval_interval),
            "--eval-size", str(settings.eval_size)]


def run_rl(settings: Settings, method: str, seed: int, warm_start: Path) -> Path:
    return launch_recorded(settings, rl_flags(settings, method, seed, warm_start),
                           settings.out_dir / "runs" / method / f"seed_{seed}")


def run_control(settings: Settings, steps_per_second: float) -> tuple[Path, int]:
    """More supervised steps in place of RL: the warm start lengthened by the RL budget's worth of steps, on the same
    warm-start data (same flags and seed, so the same problems in the same order, then more epochs of them)."""
    extra_steps = round(settings.budget_s * steps_per_second)
    run_dir = launch_recorded(
        settings,
        ["--seed", str(WARM_START_SEED), "--cache-dir", str(settings.out_dir / "cache" / "control"),
         "--warm-start-steps", str(settings.warm_start_steps + extra_steps), *warm_start_flags(settings.task),
         "--train-iters", "0", "--eval-size", str(settings.eval_size), *RL_FLAGS, *task_flags(settings.task)],
        settings.out_dir / "runs" / CONTROL / f"seed_{settings.seeds[0]}", from_warm_start=False)
    return run_dir, extra_steps


def flag_value(flags: list[str], name: str) -> str:
    """The last value given to `name` in a flag list (argparse keeps the last)."""
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def grpo_settings() -> list[tuple[str, list[str]]]:
    """(label, extra flags) of the GRPO tuning runs: RL_FLAGS' own setting, then one setting changed at a time."""
    settings = [("RL_FLAGS", [])]
    for flag, values in GRPO_GRID.items():
        settings += [(f"{flag} {value}", [flag, value]) for value in values if value != flag_value(RL_FLAGS, flag)]
    return settings


def run_grpo_tuning(settings: Settings, warm_start: Path) -> dict[str, list[Path]]:
    """GRPO at each of grpo_settings() over the seeds: label -> its run directories, seed by seed."""
    run_dirs = {}
    for label, extra in grpo_settings():
        run_dirs[label] = [launch_recorded(
            settings, [*rl_flags(settings, "grpo", seed, warm_start), *extra],
            settings.out_dir / "tuning" / label.replace(" ", "_").lstrip("-") / f"seed_{seed}")
            for seed in settings.seeds]
    return run_dirs


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


def run_math_methods(settings: Settings) -> Path:
    """Every method on MATH train prompts from a tiny random model, seed settings.seeds[0], --math-budget-s each;
    returns the model's directory."""
    model_dir = prepare_math_model(settings.out_dir)
    seed = settings.seeds[0]
    for method in settings.methods:
        launch_unless_finished(
            [*MATH_FLAGS, *ALL_METHODS[method], "--hf-checkpoint", str(model_dir), "--seed", str(seed),
             "--time-budget-s", str(settings.math_budget_s)], settings.out_dir / "math" / method / f"seed_{seed}",
            settings.processes)
    return model_dir


# ------------------------------------------------------------------------------------------------ records
# Finished RL runs and the control are also kept, compressed, in the repository (RECORDS_DIR), so that the full table
# is finished over several sittings on fresh machines. A record sits under its run's path (runs/<method>/seed_<n>) in
# a folder named by its command (paths of the repo and of --out-dir aside): a run with the same command, from the same
# warm start (its held-out accuracy at the start), is restored into --out-dir instead of run again, and a changed
# setting is a new command, recorded beside the old ones, which stay valid for their own command. The warm start
# itself is rebuilt (deterministic on the CPU build).
RECORDS_DIR = REPO / "bench" / "records" / "time_to_accuracy"
RECORD_FILES = ("summary.json", "metrics.jsonl", OUTCOMES_FILE, MACHINE_FILE)  # stored gzipped, + command.txt


def portable_command(command: str, out_dir: Path) -> str:
    """A run's command line (command.txt) with this checkout's and this --out-dir's paths named by placeholders."""
    return command.strip().replace(str(REPO), "$REPO").replace(str(out_dir), "$OUT")


def record_dir_for(settings: Settings, run_dir: Path, portable: str) -> Path:
    """Where the records keep the run of `run_dir` started with the (portable) command `portable`."""
    return settings.records_dir / run_dir.relative_to(settings.out_dir) / hashlib.sha256(
        portable.encode()).hexdigest()[:12]


def warm_start_accuracy(settings: Settings) -> float:
    return json.loads((settings.out_dir / "warm_start" / "build" / "summary.json").read_text())[
        "heldout_accuracy_before"]


def save_record(run_dir: Path, record_dir: Path, portable: str) -> None:
    """Copy a finished run's command (portable) and files (gzipped, without timestamps) to record_dir."""
    record_dir.mkdir(parents=True, exist_ok=True)
    (record_dir / "command.txt").write_text(portable + "\n")
    for name in RECORD_FILES:
        if (run_dir / name).is_file():
            with open(record_dir / f"{name}.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
                out.write((run_dir / name).read_bytes())


def restore_record(settings: Settings, record_dir: Path, run_dir: Path, command: str,
                   from_warm_start: bool = True) -> bool:
    """Restore record_dir (the record of this very command) into run_dir if it holds a finished run and, for a run
    that starts from the warm start (from_warm_start: RL runs; the control is a warm start of its own), started from
    this warm start."""
    if not (record_dir / "summary.json.gz").is_file():
        return False
    recorded = json.loads(gzip.decompress((record_dir / "summary.json.gz").read_bytes()))["heldout_accuracy_before"]
    expected = warm_start_accuracy(settings)
    if from_warm_start and abs(recorded - expected) > 1e-9:
        raise RuntimeError(
            f"{record_dir} starts from another warm start (held-out accuracy {recorded} against this one's "
            f"{expected}): a changed torch build or machine. Delete {record_dir} to run it again from this warm "
            "start, or pass --no-records")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text(command + "\n")
    for name in RECORD_FILES:
        if (record_dir / f"{name}.gz").is_file():
            (run_dir / name).write_bytes(gzip.decompress((record_dir / f"{name}.gz").read_bytes()))
    print(f"restored {run_dir} from {record_dir}", flush=True)
    return True


def launch_recorded(settings: Settings, flags: list[str], run_dir: Path, from_warm_start: bool = True) -> Path:
    """launch_unless_finished, reading the run back from settings.records_dir when it was recorded there, and
    recording it there when it finishes (settings.save_records); with --analyse-only, the reading back only (the run
    may stay unfinished)."""
    command = " ".join(command_for(flags, run_dir, settings.processes)[1:])
    portable = portable_command(command, settings.out_dir)
    record_dir = record_dir_for(settings, run_dir, portable) if settings.records_dir else None
    if record_dir and not finished(run_dir, flags, settings.processes):
        restore_record(settings, record_dir, run_dir, command, from_warm_start)
    if settings.analyse_only:
        return run_dir
    launch_unless_finished(flags, run_dir, settings.processes)
    if record_dir and settings.save_records and not (record_dir / "summary.json.gz").is_file():
        save_record(run_dir, record_dir, portable)
    return run_dir


# ------------------------------------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None, description: str = "") -> Settings:
    """The settings of a bench/time_to_accuracy.py command line (`description`: its --help text)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke check: 1 seed, 25 s budget, 200-step warm start, 128 evaluation problems")
    parser.add_argument("--methods", nargs="+", choices=list(ALL_METHODS), default=list(METHODS),
                        help="default: METHODS (both baselines, DPPO and its paper's forms, CPPO, D3S, DAPO's dynamic "
                             "sampling, GRPO with partial rollouts); the baselines are always added")
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help="RL seeds (default 1 to 6; quick: 1): the baselines and DPPO's two forms run with every "
                             "one, the other methods with the first --secondary-seeds")
    parser.add_argument("--max-seeds", type=int, default=None,
                        help="after --seeds, add one paired seed at a time until every headline interval (wall or "
                             "cost-model time) is narrower than 0.5, up to this many seeds (default 12; quick: 1)")
    parser.add_argument("--secondary-seeds", type=int, default=3,
                        help=f"how many of the seeds {', '.join(SECONDARY_METHODS)} run with (default 3)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="RL time per run, evaluations excluded (default 75; quick 25)")
    parser.add_argument("--synthetic-task", choices=list(TASK_SETTINGS), default="worked",
                        help="worked (the embedded default) or the older answer-only task")
    parser.add_argument("--warm-start-steps", type=int, default=None,
                        help="default: the task's embedded default; quick 200")
    parser.add_argument("--eval-interval", type=int, default=None,
                        help="steps between evaluations (default 6: about 2 s of GRPO's RL time; quick 6)")
    parser.add_argument("--eval-size", type=int, default=None, help="held-out problems (default 256; quick 128)")
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
                        help=f"neither restore nor record runs in {RECORDS_DIR.relative_to(REPO)} (finished runs, "
                             "kept in the repository so that later sittings resume them: restored for any command "
                             "they were run with, recorded at the full benchmark's default settings)")
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
        out_dir=out_dir, methods=[*BASELINES, *[m for m in args.methods if m not in BASELINES]],
        seeds=pick(args.seeds, [1, 2, 3, 4, 5, 6], [1]), secondary_seeds=args.secondary_seeds,
        max_seeds=pick(args.max_seeds, 12, 1),
        budget_s=pick(args.budget_s, 240.0, 25.0), task=task,
        warm_start_steps=pick(args.warm_start_steps, TASK_SETTINGS[task]["warm_start_steps"], 200),
        eval_interval=pick(args.eval_interval, 10, 6),
        eval_size=pick(args.eval_size, 512, 128), control=not args.no_control,
        math_budget_s=pick(args.math_budget_s, 0.0, 0.0), processes=args.processes, quick=quick, page=page,
        figures_dir=Path(args.figures_dir) if args.figures_dir else (
            (page.parent if page else out_dir) / "figures" / page_block(task, quick)), tune_grpo=args.tune_grpo,
        analyse_only=args.analyse_only,
        records_dir=None if args.no_records or quick or task != "worked" else RECORDS_DIR,
        # new records: the full benchmark's runs only, at its default settings (--methods/--seeds among them)
        save_records=not any(value is not None for value in (args.budget_s, args.warm_start_steps, args.eval_interval,
                                                             args.eval_size)))
    for name, value in (("--budget-s", settings.budget_s), ("--warm-start-steps", settings.warm_start_steps),
                        ("--eval-interval", settings.eval_interval), ("--eval-size", settings.eval_size)):
        if value <= 0:
            parser.error(f"{name} {value} must be > 0")
    if settings.math_budget_s < 0:
        parser.error(f"--math-budget-s {settings.math_budget_s} must be >= 0 (0 skips the MATH table)")
    return settings

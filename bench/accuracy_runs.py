"""The time-to-accuracy bench's methods, settings and runs (bench/time_to_accuracy.py runs them, then reports).

    settings (parse_args) ─► warm start (prepare_warm_start, cached) ─► RL runs (run_rl: every method x seed from that
    checkpoint, same flags and budget) ─► finished runs under <out-dir>/runs/<method>/seed_<n>
    --tune-grpo: GRPO at RL_FLAGS (the grpo method's own runs) against GRPO_GRID's settings (run_grpo_tuning)
    --screen: SCREENING's DPPO variants with the first SCREEN_SEEDS seeds (run_screening)

Invariants:
- seed s of every method shares GRPO's seed s (PAIRING_FLAGS: the pool, its order, the held-out set, the start),
  except RESEEDED methods, whose seed-s run draws --rl-seed s + their offset and nothing else differs: the null
  check, GRPO against GRPO with independent randomness;
- a record (RECORDS_DIR) is kept in a folder named by the hash of the command it was run with, and restored only for
  that command. A method whose command came to mean something else (a changed default) is renamed: RENAMED says under
  which name and with which flags its records were run, so that they are read back for what they ran, never for the
  method that now carries the old name.
bench/peer_grpo.py runs our GRPO side through these very functions.
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

# The three baselines, each at its own settings (every method's speed-up is read against each)
BASELINES = {
    # GRPO as the DPPO paper ran it, training every group (--no-dapo-filter after RL_FLAGS' --dapo-filter: argparse
    # keeps the last)
    "grpo-paper": ["--algorithm", "grpo", "--no-dapo-filter"],
    # GRPO with DAPO's zero-variance filter (exact: those groups have zero advantage), which every other method keeps
    "grpo": ["--algorithm", "grpo"],
    # what many users run (and what GRESO measured its 2.0x against): rounds of prompts until the batch holds B groups
    # with varied rewards, trained as the batch
    "dapo-dynamic-sampling": ["--algorithm", "grpo", "--dapo-dynamic-sampling"],
}
# Run with every seed beside the baselines: DPPO's defaults (the verdict's), and the null check
HEADLINE_METHODS = {
    "dppo": ["--algorithm", "dppo"],
    "grpo-null": ["--algorithm", "grpo"],  # grpo itself, with independent seeds (RESEEDED)
}
# seed-s run of these draws --rl-seed s + offset: another pool, order and sampling, everything else equal
RESEEDED = {"grpo-null": 1000}
# Run with the first Settings.secondary_seeds seeds only (seed s of each shares GRPO's seed s)
SECONDARY_METHODS = {
    "dppo-no-refill": ["--algorithm", "dppo", "--no-dppo-refill"],  # the paper's form: the batch shrinks as it prunes
    "dppo-deterministic": ["--algorithm", "dppo", "--dppo-mode", "deterministic"],  # the paper's Algorithm 1
    "cppo": ["--algorithm", "cppo", "--cppo-refill"],  # with its paper's refill: batch / (1 - P) prompts drawn
    "d3s": ["--algorithm", "d3s"],
    # rollouts that do not wait for the longest response (cohorts carried over one step)
    "grpo-partial": ["--algorithm", "grpo", "--partial-rollout"],
}
# DPPO variants screened against the recorded grpo runs (--screen, SCREEN_SEEDS seeds): name -> trainer flags
# DPPO's defaults of revision 05487f4 (Bernoulli coins at the prompt level, the zero-variance indicator's EMA, the
# completion level at 0.5), reproduced draw for draw by today's flags; see RENAMED
DPPO_05487F4 = ["--algorithm", "dppo", "--dppo-prompt-sampling", "bernoulli", "--dppo-prompt-score", "zero_variance",
                "--dppo-completion-prune-rate", "0.5"]
FIXED_SIZE = ["--algorithm", "dppo", "--dppo-prompt-sampling", "systematic", "--dppo-prompt-score", "success_rate"]
SCREENING: dict[str, list[str]] = {
    "dppo-05487f4": DPPO_05487F4,  # the default before the screening, beside the variants on this warm start
    "dppo-fixed-c0": [*FIXED_SIZE, "--dppo-completion-prune-rate", "0"],  # the fixed-size design, no completion level
    "dppo-fixed-c25": [*FIXED_SIZE, "--dppo-completion-prune-rate", "0.25"],
    "dppo-fixed-c50": [*FIXED_SIZE, "--dppo-completion-prune-rate", "0.5"],  # the completion level at today's rate
    "dppo-fixed-c0-pmin10": [*FIXED_SIZE, "--dppo-completion-prune-rate", "0", "--dppo-prompt-p-min", "0.1"],
    "dppo-probe2-c0": [*FIXED_SIZE, "--dppo-completion-prune-rate", "0", "--dppo-probe-samples", "2"],  # the probe
}
SCREEN_SEEDS = 3


@dataclass(frozen=True)
class Renamed:
    """Records of a method run under another name, with flags whose meaning has since changed."""

    name: str  # the method's name then (its runs' directory, part of their command)
    flags: tuple[str, ...]  # its flags then
    revision: str  # the revision at which those flags meant this method


# DPPO as `--algorithm dppo` ran at 05487f4, before issue 47 changed its defaults: its records are read back by their
# own command. RENAMED_FLAGS gives the explicit flags that reproduce it today, for a further seed; without them it is
# read from its records only.
RENAMED = {"dppo-05487f4": Renamed("dppo", ("--algorithm", "dppo"), "05487f4")}
RENAMED_FLAGS: dict[str, list[str]] = {"dppo-05487f4": DPPO_05487F4}
METHODS = {**BASELINES, **HEADLINE_METHODS, **SECONDARY_METHODS}
ALL_METHODS = {**METHODS, **SCREENING, **{name: RENAMED_FLAGS.get(name) for name in RENAMED}}
HEADLINE_METHOD = "dppo"
HEADLINE_BASELINE = "grpo-paper"  # the paper's comparison: the step decomposition and the projection read against it
NULL_CHECK = ("grpo", "grpo-null")  # (baseline, method) whose true speed-up is 1
# The flags that decide what a seed's run trains and is scored on (megatron_dppo/launch/run.py build_task,
# pipeline/tasks.py synthetic_task): the training pool's content (the stream of --rl-seed, --data-train-size
# problems of --synthetic-task's or --data-synthetic-cells' cells), its order (PromptSampler seeded by --rl-seed),
# the held-out set (its fixed seed, --eval-size problems of the same cells) and the start (--seed: the embedded init;
# --load: the warm start). rl_flags gives every method's seed-s run GRPO's seed-s values of all of them (RESEEDED
# methods: all but --rl-seed), so that methods are compared seed by seed (bench/accuracy_curves.py).
PAIRING_FLAGS = ("--prompt-data", "--synthetic-task", "--data-synthetic-cells", "--data-train-size", "--eval-size",
                 "--seed", "--rl-seed", "--load")
# The warm start of every run: the embedded default's own --seed, so that every run starts where README command 1's
# RL starts (held-out accuracy about 0.23); --rl-seed varies the RL randomness only
WARM_START_SEED = 1234
# Every method runs with these flags, so the page records them (the embedded defaults may change under us).
# The regime where RL learns: the embedded default's (README command 1) pool of 2048 problems and learning rate, in
# which RL gains 14-18 points in 240 s, with GRPO's best batch of 32 prompts x 8 (GRPO rolls each prompt out about
# 3 times in the budget; DPPO's refill draws each about 8 times, so the prompt level has a history to act on).
# --dapo-filter (drop zero-variance groups, exact) is the embedded default, kept for every method but grpo-paper.
# --lr and --rollout-batch-size: GRPO's own best in this regime (the grid at revision 11a2619 from lr 1e-4 and batch
# 16: lr 5e-5 / 1e-4 / 2e-4, batch 8 / 16 / 32, one changed at a time: batch 32 scored best, 0.341 mean held-out
# accuracy over the budget against 0.321 at 16); --tune-grpo compares it with batch 64, past that grid's edge.
RL_FLAGS = ["--lr", "1e-4", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
            "--rollout-temperature", "1.0", "--max-tokens-per-gpu", "4096",
            "--loss-agg-mode", "token-mean", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--kl-coef", "0",
            "--ppo-epochs", "1", "--data-train-size", "2048", "--dapo-filter"]
# The response limit and warm start of every run: the worked task's embedded defaults of the time this benchmark was
# set up, written out, so that a later change of the embedded default does not silently start its runs over (a run
# is read back only if its command is unchanged)
TASK = "worked"
TASK_SETTINGS = dict(rollout_max_response_len=176, warm_start_steps=450, warm_start_lr=3e-3, warm_start_batch_size=64,
                     warm_start_problems=500)
# The RL budget is counted on a clock of work, not of the wall (the trainer's --time-budget-prices): every step's
# logged work at a fixed price list, so that a run does the same work whether or not the shared machine is busy (a
# wall-time budget cut a slow method's runs short on a loaded machine: dynamic sampling's 29 steps against 49 on an
# idle one). The prices are the price list fitted over the first sittings' records (docs/results.md): a step 116 ms,
# a decode iteration 3.28 ms, a generated token 42 µs, a trained token 122 µs. Wall time is still logged and read.
CLOCK_PRICES = ["0.116", "0.00328", "0.000042", "0.000122"]
# GRPO's own tuning at the current settings (--tune-grpo): each setting changed alone from RL_FLAGS
GRPO_GRID = {"--rollout-batch-size": ["64"]}


def pool_size() -> int:
    """The training pool of every run (RL_FLAGS' --data-train-size)."""
    return int(flag_value(RL_FLAGS, "--data-train-size"))


def samples_per_prompt() -> int:
    return int(flag_value(RL_FLAGS, "--n-samples-per-prompt"))


def task_flags() -> list[str]:
    """The synthetic task and its response limit, for every run of the bench."""
    return ["--synthetic-task", TASK, "--rollout-max-response-len", str(TASK_SETTINGS["rollout_max_response_len"])]


def warm_start_flags() -> list[str]:
    """The warm-start settings, written out."""
    return ["--warm-start-lr", str(TASK_SETTINGS["warm_start_lr"]), "--warm-start-batch-size",
            str(TASK_SETTINGS["warm_start_batch_size"]), "--warm-start-problems",
            str(TASK_SETTINGS["warm_start_problems"])]


def flag_value(flags: list[str], name: str) -> str:
    """The last value given to `name` in a flag list (argparse keeps the last)."""
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


@dataclass
class Settings:
    out_dir: Path
    methods: list[str]
    seeds: list[int]
    budget_s: float
    warm_start_steps: int
    eval_interval: int
    eval_size: int
    processes: int
    quick: bool
    page: Path | None
    figures_dir: Path
    secondary_seeds: int = 3  # SECONDARY_METHODS run with the first this many seeds
    looks: tuple[int, ...] = ()  # the verdict's looks: seed counts at which the rule may stop (time_to_accuracy.py)
    tune_grpo: bool = False
    screen: bool = False
    variants: tuple[str, ...] | list[str] = tuple(SCREENING)  # --screen: the variants to run
    analyse_only: bool = False  # --analyse-only: the page from the finished runs, none started
    records_dir: Path | None = None  # RECORDS_DIR, read back from; None: --no-records, --quick
    save_records: bool = False  # record finished runs in records_dir: at the full benchmark's default settings only
    records_warm_start: float | None = None  # --records-warm-start: whose records an analysis without a build reads

    @property
    def warm_start_summary(self) -> Path:
        return self.out_dir / "warm_start" / "build" / "summary.json"

    @property
    def warm_start_built(self) -> bool:
        return self.warm_start_summary.is_file()


def page_block(quick: bool) -> str:
    """The name of the bench's generated block on the page (and of its figures folder)."""
    return "quick" if quick else "full"


def run_order(settings: Settings, seed: int, methods: list[str]) -> list[str]:
    """`methods` in a random order of their own, seeded by the seed (the same when a sitting resumes): the methods
    compared are interleaved, so that a slow stretch of the shared machine falls on no method more than another."""
    return random.Random(seed).sample(methods, len(methods))


def seed_methods(settings: Settings, seed: int) -> list[str]:
    """The methods of settings.methods that run with `seed`: the baselines and HEADLINE_METHODS with every seed,
    SECONDARY_METHODS with the first settings.secondary_seeds."""
    first = settings.seeds[:settings.secondary_seeds]
    return [m for m in settings.methods if m not in SECONDARY_METHODS or seed in first]


# ------------------------------------------------------------------------------------------------ runs
def prepare_warm_start(settings: Settings) -> Path:
    """The shared warm-start checkpoint (built once, then cached); --analyse-only: only where it lies, unbuilt (the
    records say which warm start their runs started from)."""
    path = warm_start_path(settings)
    if settings.analyse_only:
        return path
    launch_unless_finished(warm_start_command(settings), settings.out_dir / "warm_start" / "build", settings.processes)
    if not path.is_dir():
        raise RuntimeError(f"the warm start was built, but not at {path}, where the trainer's cache key of its flags "
                           f"puts it: delete {settings.out_dir / 'cache'} and {settings.out_dir / 'warm_start'} and "
                           "run again")
    return path


def warm_start_command(settings: Settings) -> list[str]:
    return ["--seed", str(WARM_START_SEED), "--cache-dir", str(settings.out_dir / "cache" / "warm"),
            "--warm-start-steps", str(settings.warm_start_steps), *warm_start_flags(), "--train-iters", "0",
            "--eval-size", str(settings.eval_size), *RL_FLAGS, *task_flags()]


def warm_start_path(settings: Settings) -> Path:
    """Where the warm start's checkpoint lies: the trainer's own cache key of its flags (launch/embedded.py)."""
    from megatron_dppo.data.tokenizer import CharTokenizer
    from megatron_dppo.launch.arguments import parse_args as trainer_args
    from megatron_dppo.launch.embedded import cache_key

    key = cache_key(trainer_args(warm_start_command(settings)), CharTokenizer.for_synthetic_task().vocab_size,
                    settings.processes)
    return settings.out_dir / "cache" / "warm" / f"embedded_{key}" / "warm_start"


def init_model(settings: Settings) -> Path:
    """The embedded model's initial weights beside the warm start (what the trainer saves before it trains; saved
    here when missing, so that an analysis reads the model's size without building the warm start)."""
    from megatron_dppo.data.tokenizer import CharTokenizer
    from megatron_dppo.launch.arguments import parse_args as trainer_args
    from megatron_dppo.launch.embedded import tiny_model

    model_dir = warm_start_path(settings).parent / "init"
    if not (model_dir / "config.json").is_file():
        CharTokenizer.for_synthetic_task().save_random_model(
            model_dir, seed=WARM_START_SEED, **tiny_model(trainer_args(warm_start_command(settings))))
    return model_dir


def rl_flags(settings: Settings, method: str, seed: int, warm_start: Path,
             method_flags: list[str] | None = None) -> list[str]:
    """The trainer flags of one RL run (bench/peer_grpo.py gives the TRL peer these very settings); `method_flags`:
    other flags than the method's own (a RENAMED method's of its time)."""
    method_flags = list(ALL_METHODS[method] if method_flags is None else method_flags)
    if set(method_flags) & set(PAIRING_FLAGS):
        raise ValueError(f"{method}'s flags {method_flags} set {set(method_flags) & set(PAIRING_FLAGS)}: its seed-s "
                         "run would no longer share GRPO's seed-s pool, order, held-out set or start (PAIRING_FLAGS)")
    # --load pins the start to the shared warm start and --seed stays the warm start's, so every run shares one
    # embedded init (the rollout engine's starting file, overwritten by the first weight sync); --rl-seed, the same
    # for every method's seed s (RESEEDED: offset), decides the pool, its order, and the sampling and pruning draws.
    return [*RL_FLAGS, *task_flags(), *method_flags, "--seed", str(WARM_START_SEED),
            "--rl-seed", str(seed + RESEEDED.get(method, 0)), "--load", str(warm_start),
            "--cache-dir", str(settings.out_dir / "cache" / "init"), "--warm-start-steps", "0",
            "--time-budget-s", str(settings.budget_s), "--time-budget-prices", *CLOCK_PRICES,
            "--eval-interval", str(settings.eval_interval),
            "--eval-size", str(settings.eval_size)]


def run_dir_of(settings: Settings, method: str, seed: int) -> Path:
    return settings.out_dir / "runs" / method / f"seed_{seed}"


def run_rl(settings: Settings, method: str, seed: int, warm_start: Path) -> Path:
    """One method's seed-s run: restored from its records, else run. A RENAMED method: restored from the record of
    its old command, else run with RENAMED_FLAGS, else refused."""
    run_dir = run_dir_of(settings, method, seed)
    if method in RENAMED and restore_renamed(settings, method, seed, warm_start):
        return run_dir
    if ALL_METHODS[method] is None:
        old = RENAMED[method]
        raise ValueError(f"{method} has no record of seed {seed} and no flags of today: give "
                         f"accuracy_runs.RENAMED_FLAGS[{method!r}] the flags that reproduce `{' '.join(old.flags)}` at "
                         f"revision {old.revision} to run it")
    return launch_recorded(settings, rl_flags(settings, method, seed, warm_start), run_dir)


def run_grpo_tuning(settings: Settings, warm_start: Path) -> dict[str, list[Path]]:
    """GRPO at RL_FLAGS (the grpo method's runs themselves) and at each of GRPO_GRID's settings, changed alone, over
    the seeds: label -> its run directories, seed by seed."""
    run_dirs = {"RL_FLAGS": [run_rl(settings, "grpo", seed, warm_start) for seed in settings.seeds]}
    for flag, values in GRPO_GRID.items():
        for value in values:
            run_dirs[f"{flag} {value}"] = [launch_recorded(
                settings, [*rl_flags(settings, "grpo", seed, warm_start), flag, value],
                settings.out_dir / "tuning" / f"{flag.lstrip('-')}_{value}" / f"seed_{seed}")
                for seed in settings.seeds]
    return run_dirs


# ------------------------------------------------------------------------------------------------ records
# Finished RL runs are also kept, compressed, in the repository (RECORDS_DIR), so that the full table is finished over
# several sittings on fresh machines. A record sits under its run's path (runs/<method>/seed_<n>) in a folder named
# by the hash of its command (paths of the repo and of --out-dir aside): a run with the same command, from the same
# warm start (its held-out accuracy at the start), is restored into --out-dir instead of run again, and a changed
# setting is a new command, recorded beside the old ones, which stay valid for their own command. A RENAMED method's
# records sit under its new name, each in the folder of the command it ran with. The warm start itself is rebuilt
# (deterministic on the CPU build).
RECORDS_DIR = REPO / "bench" / "records" / "time_to_accuracy"
RECORD_FILES = ("summary.json", "metrics.jsonl", OUTCOMES_FILE, MACHINE_FILE)  # stored gzipped, + command.txt


def portable_command(command: str, out_dir: Path) -> str:
    """A run's command line (command.txt) with this checkout's and this --out-dir's paths named by placeholders."""
    return command.strip().replace(str(REPO), "$REPO").replace(str(out_dir), "$OUT")


def command_hash(portable: str) -> str:
    return hashlib.sha256(portable.encode()).hexdigest()[:12]


def record_dir_for(settings: Settings, run_dir: Path, portable: str) -> Path:
    """Where the records keep the run of `run_dir` started with the (portable) command `portable`: under the folder
    of the warm start it started from (records_root)."""
    return records_root(settings) / run_dir.relative_to(settings.out_dir) / command_hash(portable)


def records_root(settings: Settings) -> Path:
    """The records of one warm start: records_dir/warm_start_<its held-out accuracy>. The same flags build another
    warm start on another machine (its floating-point kernels differ: 0.2285 where the first sittings ran, 0.2754 on
    an AVX-512 machine), and a run is only comparable with runs from its own warm start, so each keeps its records
    apart. Without a build here (--analyse-only), --records-warm-start names the folder, or the only one there is."""
    accuracy = warm_start_accuracy(settings)
    if accuracy != accuracy:  # nan: nothing built and nothing named
        folders = sorted(settings.records_dir.glob("warm_start_*"))
        if len(folders) != 1:
            raise ValueError(f"{len(folders)} warm starts have records in {settings.records_dir} "
                             f"({', '.join(f.name for f in folders) or 'none'}): name one with --records-warm-start, "
                             "or build the warm start here (drop --analyse-only)")
        return folders[0]
    return settings.records_dir / warm_start_folder(accuracy)


def warm_start_folder(accuracy: float) -> str:
    return f"warm_start_{accuracy:.4f}"


def warm_start_accuracy(settings: Settings) -> float:
    """The held-out accuracy every restored run must start from: the warm start built here, or, under
    --analyse-only without a build, the one --records-warm-start names (nan: neither)."""
    if settings.warm_start_built:
        return json.loads(settings.warm_start_summary.read_text())["heldout_accuracy_before"]
    return settings.records_warm_start if settings.records_warm_start is not None else float("nan")


def save_record(run_dir: Path, record_dir: Path, portable: str) -> None:
    """Copy a finished run's command (portable) and files (gzipped, without timestamps) to record_dir."""
    record_dir.mkdir(parents=True, exist_ok=True)
    (record_dir / "command.txt").write_text(portable + "\n")
    for name in RECORD_FILES:
        if (run_dir / name).is_file():
            with open(record_dir / f"{name}.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
                out.write((run_dir / name).read_bytes())


def restore_record(settings: Settings, record_dir: Path, run_dir: Path, command: str) -> bool:
    """Restore record_dir (the record of `command`) into run_dir if it holds a finished run that started from this
    warm start; command.txt says the command it ran with."""
    if not (record_dir / "summary.json.gz").is_file():
        return False
    recorded = json.loads(gzip.decompress((record_dir / "summary.json.gz").read_bytes()))["heldout_accuracy_before"]
    if warm_start_folder(recorded) != record_dir.relative_to(settings.records_dir).parts[0]:
        raise RuntimeError(f"{record_dir} starts from a warm start of held-out accuracy {recorded}, not the one its "
                           "folder names: the record was moved by hand; delete it to run it again")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text(command + "\n")
    for name in RECORD_FILES:
        if (record_dir / f"{name}.gz").is_file():
            (run_dir / name).write_bytes(gzip.decompress((record_dir / f"{name}.gz").read_bytes()))
    print(f"restored {run_dir} from {record_dir}", flush=True)
    return True


def restore_renamed(settings: Settings, method: str, seed: int, warm_start: Path) -> bool:
    """A RENAMED method's seed-s run from the record of its old command (its old flags in its old name's run
    directory), kept under the new name's run path; False where there is none."""
    if not settings.records_dir:
        return False
    old = RENAMED[method]
    old_run_dir = run_dir_of(settings, old.name, seed)
    command = " ".join(command_for(rl_flags(settings, old.name, seed, warm_start, list(old.flags)), old_run_dir,
                                   settings.processes)[1:])
    portable = portable_command(command, settings.out_dir)
    run_dir = run_dir_of(settings, method, seed)
    return restore_record(settings, record_dir_for(settings, run_dir, portable), run_dir, command)


def launch_recorded(settings: Settings, flags: list[str], run_dir: Path) -> Path:
    """launch_unless_finished, reading the run back from settings.records_dir when it was recorded there, and
    recording it there when it finishes (settings.save_records); with --analyse-only, the reading back only (the run
    may stay unfinished)."""
    command = " ".join(command_for(flags, run_dir, settings.processes)[1:])
    portable = portable_command(command, settings.out_dir)
    record_dir = record_dir_for(settings, run_dir, portable) if settings.records_dir else None
    if record_dir and not finished(run_dir, flags, settings.processes):
        restore_record(settings, record_dir, run_dir, command)
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
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="default: METHODS (the baselines, DPPO, the null check, and with the first "
                             "--secondary-seeds seeds the other methods); the baselines are always added")
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help="RL seeds (default 1 to 6, then 9 and 12 as the verdict's rule asks; quick: 1; "
                             f"--screen: the first {SCREEN_SEEDS})")
    parser.add_argument("--secondary-seeds", type=int, default=3,
                        help=f"how many of the seeds {', '.join(SECONDARY_METHODS)} run with (default 3)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="RL time per run, evaluations excluded (default 240; quick 25)")
    parser.add_argument("--warm-start-steps", type=int, default=None,
                        help=f"default: {TASK_SETTINGS['warm_start_steps']} (the worked task's); quick 200")
    parser.add_argument("--eval-interval", type=int, default=None, help="steps between evaluations (default 10; "
                                                                        "quick 6)")
    parser.add_argument("--eval-size", type=int, default=None, help="held-out problems (default 512; quick 128)")
    parser.add_argument("--processes", type=int, default=2, help="torchrun --nproc-per-node (default 2)")
    parser.add_argument("--out-dir", default=None, help="runs and caches (default runs/time_to_accuracy[_quick])")
    parser.add_argument("--write-page", default=None, help="rewrite the generated block of this markdown page")
    parser.add_argument("--figures-dir", default=None, help="default: <page dir>/figures, else <out-dir>/figures")
    parser.add_argument("--tune-grpo", action="store_true",
                        help="instead of the methods: GRPO at RL_FLAGS (the grpo method's runs) against GRPO_GRID's "
                             "settings, scored by the mean held-out accuracy over the budget; writes the grpo-tuning "
                             "block")
    parser.add_argument("--screen", action="store_true",
                        help=f"instead of the methods: SCREENING's DPPO variants, {SCREEN_SEEDS} seeds, against the "
                             "grpo runs; writes the screening block")
    parser.add_argument("--variants", nargs="+", choices=list(SCREENING), default=list(SCREENING),
                        help="with --screen: the variants to run (default all); the block reports every variant "
                             "with the seeds its finished runs have (more seeds for a chosen one: --seeds 1 ... 6)")
    parser.add_argument("--no-records", action="store_true",
                        help=f"neither restore nor record runs in {RECORDS_DIR.relative_to(REPO)} (finished runs, "
                             "kept in the repository so that later sittings resume them: restored for any command "
                             "they were run with, recorded at the full benchmark's default settings)")
    parser.add_argument("--records-warm-start", type=float, default=None,
                        help="with --analyse-only and no warm start built here: the held-out accuracy of the warm "
                             "start whose records to read (bench/records keeps each warm start's apart; default: the "
                             "only one there)")
    parser.add_argument("--analyse-only", action="store_true",
                        help="start no run: the tables and the page from the runs already finished (and those the "
                             "records hold), each method with the seeds it has")
    args = parser.parse_args(argv)
    quick = args.quick

    def pick(value, full, smoke):
        return value if value is not None else (smoke if quick else full)

    out_dir = Path(args.out_dir or ("runs/time_to_accuracy_quick" if quick else "runs/time_to_accuracy"))
    page = Path(args.write_page) if args.write_page else None
    default_seeds = [1] if quick else list(range(1, (SCREEN_SEEDS if args.screen else 6) + 1))
    settings = Settings(
        out_dir=out_dir, methods=[*BASELINES, *[m for m in args.methods if m not in BASELINES]],
        seeds=args.seeds or default_seeds, secondary_seeds=args.secondary_seeds,
        looks=() if quick or args.seeds else (6, 9, 12), budget_s=pick(args.budget_s, 240.0, 25.0),
        warm_start_steps=pick(args.warm_start_steps, TASK_SETTINGS["warm_start_steps"], 200),
        eval_interval=pick(args.eval_interval, 10, 6), eval_size=pick(args.eval_size, 512, 128),
        processes=args.processes, quick=quick, page=page,
        figures_dir=Path(args.figures_dir) if args.figures_dir else (
            (page.parent if page else out_dir) / "figures" / page_block(quick)), tune_grpo=args.tune_grpo,
        screen=args.screen, variants=args.variants, analyse_only=args.analyse_only,
        records_dir=None if args.no_records or quick else RECORDS_DIR, records_warm_start=args.records_warm_start,
        # new records: the full benchmark's runs only, at its default settings (--methods/--seeds among them)
        save_records=not any(value is not None for value in (args.budget_s, args.warm_start_steps, args.eval_interval,
                                                             args.eval_size)))
    for name, value in (("--budget-s", settings.budget_s), ("--warm-start-steps", settings.warm_start_steps),
                        ("--eval-interval", settings.eval_interval), ("--eval-size", settings.eval_size)):
        if value <= 0:
            parser.error(f"{name} {value} must be > 0")
    if args.screen and not SCREENING:
        parser.error("--screen: accuracy_runs.SCREENING names no DPPO variant; add {name: flags} there")
    return settings

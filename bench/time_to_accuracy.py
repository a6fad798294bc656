"""Time to accuracy where RL learns (the embedded default's regime): DPPO's two forms against three GRPO baselines,
with CPPO, D3S, the paper's deterministic DPPO and GRPO with partial rollouts beside them, from one warm start.

    0. (--tune-grpo, first) GRPO's own learning rate and rollout batch (8, 16, 32), one changed at a time from
       RL_FLAGS, scored by the mean held-out accuracy over the budget: every method then shares GRPO's best
    1. warm start: the embedded default's supervised warm start (cached), timed twice (built, then cached) to measure
       its supervised steps per second
    2. RL: every method x seed from that checkpoint (--load), the same flags and budget (240 s of RL), on the
       embedded default's 2048-problem pool; seed s of every method shares GRPO's seed s (the pool, its order, the
       held-out set, the start: accuracy_runs.PAIRING_FLAGS). Within a seed the methods run in a random order of the
       seed's own (accuracy_runs.run_order), so a slow stretch of the shared machine falls on none more than another.
       The baselines and DPPO's two forms run first, with every seed; after --seeds, one more paired seed at a time
       until every headline interval is narrower than 0.5 (wall or cost-model time), up to --max-seeds; then the
       other methods with the first 3 seeds
    3. control: a longer supervised warm start that spends the RL budget on more supervised steps instead
    4. analysis ─► the generated part of docs/results.md (bench/results_page.py): the estimator's calibration on
       simulated curves of known ratio and on grpo against grpo-paper; per baseline, every method's speed-up in wall
       time, cost-model time, tokens and FLOPs with its interval; the work each step did and the machine's load; the
       prompt level at work and what caps it; where the time goes; the Qwen3-4B projection; figures
    5. optional (--math-budget-s): the same methods' costs on MATH train prompts (tiny random model)

The three baselines: grpo-paper (GRPO as the DPPO paper ran it, every group trained: --no-dapo-filter), grpo (the DAPO
zero-variance filter, which every other method keeps) and dapo-dynamic-sampling (rounds of prompts until the batch
holds B varied groups: what many users run, and what GRESO measured its 2.0x against).
Noise is removed where it can be: runs interleaved; each step logs its work (rollout rounds, decode iterations,
generated and trained tokens); each run's machine.json says how busy the rest of the machine was; and every time is
also read as cost-model time: one least-squares fit of the step time on that work over every step of every run,
applied to each step's work, so that the machine's speed drops out of the comparison.
Runs are resumable: a run whose directory holds summary.json (started with the same command) is read, not re-run;
bench/records/time_to_accuracy keeps finished runs by command, so the table is finished over several sittings.
`touch runs/time_to_accuracy/pause.<name>` holds the bench before its next run until every pause file is gone.
The code: bench/accuracy_runs.py (methods, settings, runs, records), bench/training_run.py (one run through the entry
point, pausing, the machine's load), bench/accuracy_curves.py (the estimator), bench/estimator_check.py (the estimator
on simulated curves of known ratio), bench/run_costs.py (FLOPs, the step-cost fit, cost-model time),
bench/results_page.py (tables, figures, the page).
Definitions (also on the results page):
- RL time: the sum of the trainer's seconds_step (evaluations excluded); every curve starts at the warm start, 0 s
- a seed's curve: its held-out evaluations, each averaged with one neighbour on each side (centred: no lag), linear
  between evaluations; a method's curve: its seeds' curves averaged on a common grid up to the budget
- final accuracy: a seed's mean of its last 3 evaluations, averaged over seeds (each evaluation counted once)
- targets, per comparison: the warm start plus 50/75/90% of the LOWER of the two methods' gains (symmetric: swapping
  the two inverts the speed-up); the paper's target is the baseline's own final accuracy
- speed-up = the baseline's cost to a target / the method's; the headline is the geometric mean over 50/75/90%; a
  curve that never reaches a target counts its budget (marked †: a bound). 95% interval: log speed-up ± t(n-1) x the
  jackknife standard error over seed pairs (a seed's two runs dropped together)
- FLOPs: forward 2·P per token plus attention 4·L·d·(context / 2), backward twice the forward; training counts
  forward+backward over every trained token (plus one forward when an old-log-prob pass runs), rollout a forward
  over every generated token (prompt prefill not counted); P counts the tied embedding once.

Examples:
    python bench/time_to_accuracy.py --tune-grpo --seeds 1 2 --write-page docs/results.md   # GRPO's own settings
    python bench/time_to_accuracy.py --write-page docs/results.md          # the full benchmark and the page
    python bench/time_to_accuracy.py --analyse-only --seeds 1 2 3 4 5 6 --write-page docs/results.md   # page only
    python bench/time_to_accuracy.py --quick                               # smoke check
Last lines (DPPO's defaults against each baseline: wall time, cost-model time; then the paper's definition; then the
check against the ratio known in advance):
    dppo_speedup_vs_grpo: X [low, high]
    dppo_speedup_vs_grpo_cost_model: X [low, high]
    dppo_speedup_vs_grpo_filtered: X [low, high]   (and _cost_model)
    dppo_speedup_vs_grpo_dynamic_sampling: X [low, high]   (and _cost_model)
    dppo_speedup_vs_grpo..._paper_definition: X [low, high]
    grpo_filter_check: X [low, high], step-time ratio Y   (and _cost_model)
"""

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.accuracy_runs import (  # noqa: E402
    page_block,
    parse_args,
    prepare_warm_start,
    run_control,
    run_grpo_tuning,
    run_math_methods,
    run_order,
    run_rl,
)
from bench.results_page import (  # noqa: E402
    DECIDED_WIDTH,
    grpo_tuning_report,
    headline_decided,
    results_report,
    write_page,
)
from bench.training_run import finished  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv, __doc__)
    started = time.perf_counter()
    warm_start, sft_steps_per_second = prepare_warm_start(settings)
    if settings.tune_grpo:
        report = grpo_tuning_report(settings, run_grpo_tuning(settings, warm_start))
        print(report)
        if settings.page:
            write_page(settings.page, "grpo-tuning", report)
        return
    # the headline first (the baselines and DPPO's two forms), seed by seed, methods interleaved: a change in the
    # machine's load falls on all alike; then one more paired seed at a time until it decides, up to --max-seeds
    for seed in settings.seeds:
        run_seed(settings, seed, warm_start, started)
    while not settings.analyse_only and len(settings.seeds) < settings.max_seeds and not headline_decided(settings):
        settings.seeds.append(max(settings.seeds) + 1)
        print(f"the headline intervals are not yet narrower than {DECIDED_WIDTH}: adding seed {settings.seeds[-1]}",
              flush=True)
        run_seed(settings, settings.seeds[-1], warm_start, started)
    for seed in settings.seeds[:settings.secondary_seeds]:  # then the other methods, with the first seeds
        run_seed(settings, seed, warm_start, started, secondary=True)
    control = run_control(settings, sft_steps_per_second) if settings.control else None
    math_model = run_math_methods(settings) if settings.math_budget_s > 0 else None
    report, last_lines = results_report(settings, sft_steps_per_second, control, math_model, started)
    print(report)
    if settings.page:
        write_page(settings.page, page_block(settings.task, settings.quick), report)
    print(last_lines)


def run_seed(settings, seed: int, warm_start: Path, started: float, secondary: bool = False) -> None:
    """The headline's (or, `secondary`, the other) methods' runs with `seed`, in the seed's own order (run_order)."""
    for method in run_order(settings, seed, secondary):
        if finished(run_rl(settings, method, seed, warm_start)):
            print(f"finished {method} seed {seed} ({time.perf_counter() - started:.0f} s so far)", flush=True)


if __name__ == "__main__":
    main()

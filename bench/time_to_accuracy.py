"""Time to accuracy where RL learns (the embedded default's regime): DPPO against three GRPO baselines, with a null
check, DPPO's other forms, CPPO, D3S and GRPO with partial rollouts beside them, from one warm start; the verdict by
a rule fixed before the seeds ran (bench/verdict.py).

    0. (--tune-grpo) GRPO at RL_FLAGS (the grpo method's own runs, reused) against GRPO_GRID's settings (batch 64),
       scored by the mean held-out accuracy over the budget; (--screen) SCREENING's DPPO variants with 3 seeds against
       the grpo runs: their speed-up in cost-model time and their steps-to-target ratio
    1. warm start: the embedded default's supervised warm start (cached)
    2. RL: every method x seed from that checkpoint (--load), the same flags and budget (240 s of RL), on the
       embedded default's 2048-problem pool; seed s of every method shares GRPO's seed s (accuracy_runs.PAIRING_FLAGS)
       but the null check's, which draws --rl-seed s + 1000. Within a seed the methods run in a random order of the
       seed's own (accuracy_runs.run_order). The baselines, DPPO and the null check run with seeds 1-6; the rule looks
       at 6 paired seeds, then 9, then 12, and stops at the first look where every baseline's 95% interval of DPPO's
       speed-up in cost-model time is within x/÷ 1.25 (log half-width 0.22); the other methods run with the first 3
    3. analysis ─► the generated part of docs/results.md (bench/results_page.py): the status (the verdict, the goals,
       the checks), the estimator on simulated curves of known ratio and on the null and filter checks; per baseline,
       every method's speed-up in wall time, cost-model time, steps, tokens and FLOPs with its interval; the work each
       step did and the machine's load; the prompt level; where the time goes and the price list; the Qwen3-4B
       projection band; figures

The three baselines: grpo-paper (GRPO as the DPPO paper ran it, every group trained: --no-dapo-filter), grpo (the DAPO
zero-variance filter, which every other method keeps) and dapo-dynamic-sampling (rounds of prompts until the batch
holds B varied groups: what many users run, and what GRESO measured its 2.0x against).
Noise is removed where it can be: runs interleaved; each step logs its work (rollout rounds, engine batches, decode
iterations, generated and trained tokens); each run's machine.json says what else the machine ran; and every time is
also read as cost-model time (the primary axis): a price list of that work, fitted over every step of every run,
applied to each step's work, so that the machine's speed drops out of the comparison.
Runs are resumable: a run whose directory holds summary.json (started with the same command) is read, not re-run;
bench/records/time_to_accuracy keeps finished runs by command, so the table is finished over several sittings.
`touch runs/time_to_accuracy/pause.<name>` holds the bench before its next run until every pause file is gone.
The code: bench/accuracy_runs.py (methods, settings, runs, records), bench/training_run.py (one run through the entry
point, pausing, the machine's load), bench/accuracy_curves.py (the estimator), bench/verdict.py (the rule),
bench/estimator_check.py (the estimator and the rule on simulated curves of known ratio), bench/run_costs.py (FLOPs,
the price list, cost-model time), bench/results_page.py (tables, figures, the page).
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
    python bench/time_to_accuracy.py --write-page docs/results.md          # the verdict's seeds and the page
    python bench/time_to_accuracy.py --analyse-only --seeds 1 2 3 4 5 6 --write-page docs/results.md   # page only
    python bench/time_to_accuracy.py --screen --write-page docs/results.md # SCREENING's variants, 3 seeds
    python bench/time_to_accuracy.py --screen --variants dppo-fixed-c0 --seeds 1 2 3 4 5 6 --write-page docs/results.md
    python bench/time_to_accuracy.py --tune-grpo --seeds 1 2 --write-page docs/results.md   # GRPO at batch 64
    python bench/time_to_accuracy.py --quick                               # smoke check
Last lines (DPPO's defaults against each baseline: the verdict, then the speed-ups on wall time, cost-model time and
the paper's definition; then the checks against ratios known in advance):
    dppo_verdict_vs_grpo: faster|slower|equivalent|undecided (cost-model time, N seeds)   (and _filtered,
        _dynamic_sampling; for an equivalence dppo_equivalence_vs_KEY: [low, high])
    dppo_speedup_vs_grpo: X [low, high]   (and _cost_model, _paper_definition; the same for _filtered and
        _dynamic_sampling)
    grpo_filter_check: X [low, high], step-time ratio Y   (and _cost_model)
    grpo_null_check: X [low, high]   (and _cost_model)
"""

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.accuracy_runs import (  # noqa: E402
    RENAMED,
    page_block,
    parse_args,
    prepare_warm_start,
    restore_renamed,
    run_grpo_tuning,
    run_order,
    run_rl,
    seed_methods,
)
from bench.markdown_table import write_page  # noqa: E402
from bench.results_page import results_report, rule_stops  # noqa: E402
from bench.training_run import finished  # noqa: E402
from bench.tuning_reports import grpo_tuning_report, screening_report  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv, __doc__)
    started = time.perf_counter()
    warm_start = prepare_warm_start(settings)
    if settings.tune_grpo:
        report = grpo_tuning_report(settings, run_grpo_tuning(settings, warm_start))
        publish(settings, "grpo-tuning", report, "")
        return
    if settings.screen:  # the variants alone, seed by seed, against the recorded grpo runs (restored first)
        for seed in settings.seeds:
            run_methods(settings, seed, ["grpo", *run_order(settings, seed, list(settings.variants))], warm_start,
                        started)
        publish(settings, "screening", *screening_report(settings))
        return
    for seed in settings.seeds:
        run_methods(settings, seed, run_order(settings, seed, seed_methods(settings, seed)), warm_start, started)
    # the verdict's rule: at each look past the first, three more paired seeds unless every interval is narrow enough
    for look in settings.looks[1:]:
        if settings.analyse_only or rule_stops(settings):
            break
        print(f"the rule goes on to its next look: seeds {len(settings.seeds) + 1}-{look}", flush=True)
        for seed in range(max(settings.seeds) + 1, max(settings.seeds) + 1 + look - len(settings.seeds)):
            settings.seeds.append(seed)
            run_methods(settings, seed, run_order(settings, seed, seed_methods(settings, seed)), warm_start, started)
    for method in RENAMED:  # read back from their records for the page, never run here
        for seed in settings.seeds:
            restore_renamed(settings, method, seed, warm_start)
    publish(settings, page_block(settings.quick), *results_report(settings, started))


def run_methods(settings, seed: int, methods: list[str], warm_start: Path, started: float) -> None:
    """`methods`' runs with `seed`, in that order."""
    for method in methods:
        if finished(run_rl(settings, method, seed, warm_start)):
            print(f"finished {method} seed {seed} ({time.perf_counter() - started:.0f} s so far)", flush=True)


def publish(settings, block: str, report: str, last_lines: str) -> None:
    """Print the report (and write it as the page's `block`), then the last lines."""
    print(report)
    if settings.page:
        write_page(settings.page, block, report)
    if last_lines:
        print(last_lines)


if __name__ == "__main__":
    main()

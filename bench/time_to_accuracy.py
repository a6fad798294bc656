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
    4. analysis ─► tables, figures (megatron_dppo/metrics.py plot_runs), the generated part of docs/results.md:
       time, tokens and FLOPs to GRPO's final accuracy with a bootstrap interval; the prompt level at work (epochs,
       pruned share, zero-variance share, how well history predicted); where the time goes; the step-cost fit;
       fewer steps x shorter steps; the Qwen3-4B projection
    5. optional (--math-budget-s): the same methods' costs on MATH train prompts (tiny random model)

Every run is started first, then the report is made from the finished runs. Runs are resumable: a run whose
directory holds summary.json (and was started with the same command) is read, not re-run, so the full table is
finished over several sittings; --methods/--seeds/--budget-s restrict a run.
The code: bench/accuracy_runs.py (methods, settings, runs, the records kept in the repository), bench/training_run.py
(one run through the entry point), bench/accuracy_curves.py (targets, times to target, bootstrap intervals),
bench/run_costs.py (FLOPs, phases, the step-cost fit), bench/results_page.py (tables, figures, the page).
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
    run_rl,
    seeds_of,
)
from bench.results_page import grpo_tuning_report, results_report, write_page  # noqa: E402
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
    for seed in settings.seeds:  # seed by seed, so that a change in the machine's load falls on every method alike
        for method in (method for method in settings.methods if seed in seeds_of(settings, method)):
            if finished(run_rl(settings, method, seed, warm_start)):
                print(f"finished {method} seed {seed} ({time.perf_counter() - started:.0f} s so far)", flush=True)
    control = run_control(settings, sft_steps_per_second) if settings.control else None
    math_model = run_math_methods(settings) if settings.math_budget_s > 0 else None
    report, last_line = results_report(settings, sft_steps_per_second, control, math_model, started)
    print(report)
    if settings.page:
        write_page(settings.page, page_block(settings.task, settings.quick), report)
    print(last_line)


if __name__ == "__main__":
    main()

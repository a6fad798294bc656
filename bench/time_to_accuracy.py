"""Time to accuracy in the paper's regime: DPPO (its defaults and the paper's forms), CPPO, D3S, DAPO's dynamic
sampling and GRPO with partial rollouts against two GRPO baselines, from one warm start.

    0. (--tune-grpo, first) GRPO's own learning rate and batch, one changed at a time from RL_FLAGS: every method
       then shares GRPO's best, so that no method wins against a mistuned rival
    1. warm start: one supervised warm start of the embedded tiny model (cached), timed twice (built, then cached)
       to measure its supervised steps per second
    2. RL: every method x seed starts from that checkpoint (--load) with the same flags and time budget, on a pool
       of 256 problems that GRPO revisits about 7 times in the budget (DPPO's refill draws about 3x as often; the
       paper: 15 epochs). Seed s of every method shares GRPO's seed s: the pool's content and order, the held-out
       set and the start (accuracy_runs.PAIRING_FLAGS); --rl-seed varies the RL randomness, never the start
    3. control: a longer supervised warm start that spends the RL budget on more supervised steps instead, on the
       same warm-start data
    4. analysis ─► tables, figures (megatron_dppo/metrics.py plot_runs), the generated part of docs/results.md:
       per baseline, time, tokens and FLOPs to its 50/75/90% targets and its final accuracy, with paired bootstrap
       intervals; the prompt level at work (epochs, pruned share, zero-variance share, how well history predicted);
       where the time goes; the step-cost fit; fewer steps x shorter steps; the Qwen3-4B projection
    5. optional (--math-budget-s): the same methods' costs on MATH train prompts (tiny random model)

The two baselines: grpo-paper, GRPO as the DPPO paper ran it (every group trained, --no-dapo-filter), and grpo, GRPO
with DAPO's zero-variance filter (RL_FLAGS' --dapo-filter, which every other method keeps): the paper's 2.37x was
measured against the first, and the filter alone already skips much of what DPPO prunes.
The budget is sized to where the curves rise: in the 150 s runs of the first full table, GRPO's held-out accuracy
rose for about 30 s and then sat on a plateau, where a crossing time is set by evaluation noise more than by
learning. Hence 75 s of RL (the rise and a margin as long again, for slower methods) and 256 held-out problems every
6 steps: about every 2 s of GRPO's RL time (0.35 s a step), so that GRPO's seed-mean curve, which was still below
its 90% target at its first evaluation after 40 steps, has at least five evaluations before it (the page counts
them). An evaluation of 256 problems costs about 1.7 s (those of 1024 cost about 6.6 s), so a GRPO run spends
about 65 s evaluating beside its 75 s of RL: dense, not the bulk, and never counted in the RL time. A method with
shorter steps evaluates more often per RL second and spends more of its wall time evaluating.
Every run is started first, then the report is made from the finished runs. Runs are resumable: a run whose
directory holds summary.json (and was started with the same command) is read, not re-run, so the full table is
finished over several sittings; bench/records/time_to_accuracy keeps finished runs by command.
--methods/--seeds/--budget-s restrict a run (the two baselines are always run).
The code: bench/accuracy_runs.py (methods, settings, runs, the records kept in the repository), bench/training_run.py
(one run through the entry point), bench/accuracy_curves.py (targets, times to target, paired bootstrap intervals),
bench/run_costs.py (FLOPs, phases, the step-cost fit), bench/results_page.py (tables, figures, the page).
Definitions (also on the results page):
- RL time: the sum of the trainer's seconds_step (evaluations excluded); every curve starts at the warm start, 0 s
- final accuracy: mean of the last 3 held-out evaluations (the trainer's --eval-interval ones and the final one)
- targets, per baseline, on its seed-mean curve (accuracy averaged over seeds, evaluation by evaluation): its gain
  is its final accuracy minus the warm start's; the targets are the warm start plus 50%, 75% and 90% of the gain,
  and the paper's target is the final accuracy itself
- time to a target: where a seed-mean curve's trailing mean of 3 evaluations crosses it, interpolated between
  evaluations; a curve that never reaches it counts its budget (marked on the page: its speed-up is an upper bound)
- speed-up = the baseline's time / the method's, on the seed-mean curves of the seeds both ran; the headline is
  the geometric mean of the 50/75/90% speed-ups, the paper's definition the speed-up to the final accuracy; 95%
  interval: a bootstrap over seed pairs (seed indices resampled, each resample recomputing the baseline's targets
  and both curves from the same seeds)
- FLOPs: forward 2·P per token plus attention 4·L·d·(context / 2), backward twice the forward; training counts
  forward+backward over every trained token (plus one forward when an old-log-prob pass runs), rollout counts a
  forward over every generated token (decode; prompt prefill not counted); P counts the tied embedding once.

Examples:
    python bench/time_to_accuracy.py --tune-grpo --seeds 1 2 --write-page docs/results.md   # GRPO's own settings
    python bench/time_to_accuracy.py --write-page docs/results.md              # the full benchmark and the page
    python bench/time_to_accuracy.py --quick                                   # smoke check, about 12 min
    python bench/time_to_accuracy.py --methods dppo dppo-no-refill --seeds 1 2 --budget-s 60
Last lines (DPPO's defaults; the speed-up and its 95% paired interval), against GRPO as the paper ran it and against
GRPO with the DAPO filter, the headline then the paper's definition:
    dppo_speedup_vs_grpo: X [low, high]
    dppo_speedup_vs_grpo_filtered: X [low, high]
    dppo_speedup_vs_grpo_paper_definition: X [low, high]
    dppo_speedup_vs_grpo_filtered_paper_definition: X [low, high]
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
    for seed in settings.seeds:  # seed by seed, methods interleaved: a change in the machine's load falls on all alike
        run_seed(settings, seed, warm_start, started)
    # seeds until the headline decides: one more paired seed at a time, up to --max-seeds
    while not settings.analyse_only and len(settings.seeds) < settings.max_seeds and not headline_decided(settings):
        settings.seeds.append(max(settings.seeds) + 1)
        print(f"the headline intervals are not yet narrower than {DECIDED_WIDTH}: adding seed {settings.seeds[-1]}",
              flush=True)
        run_seed(settings, settings.seeds[-1], warm_start, started)
    control = run_control(settings, sft_steps_per_second) if settings.control else None
    math_model = run_math_methods(settings) if settings.math_budget_s > 0 else None
    report, last_lines = results_report(settings, sft_steps_per_second, control, math_model, started)
    print(report)
    if settings.page:
        write_page(settings.page, page_block(settings.task, settings.quick), report)
    print(last_lines)


def run_seed(settings, seed: int, warm_start: Path, started: float) -> None:
    """Every method's run with `seed`, in the seed's own random order (run_order)."""
    for method in run_order(settings, seed):
        if finished(run_rl(settings, method, seed, warm_start)):
            print(f"finished {method} seed {seed} ({time.perf_counter() - started:.0f} s so far)", flush=True)


if __name__ == "__main__":
    main()

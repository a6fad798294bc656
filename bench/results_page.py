"""The time-to-accuracy bench's report: its tables, figures and the generated blocks of docs/results.md, from the
runs bench/accuracy_runs.py finished (none is started here).

    finished runs ─► load_analysed: load_groups (run_costs) and the price list that gives cost-model time
    ─► compare_all: per axis and baseline (accuracy_runs.BASELINES), every method's speed-up to the 50/75/90%
       targets with its paired interval (accuracy_curves.compare_paired)
    ─► the verdict on verdict.PRIMARY_AXIS (bench/verdict.py), the null and filter checks, the status paragraph
    ─► the work each step did and the machine, the prompt level, where the time goes, fewer x shorter steps, the
       Qwen3-4B projection band, figures ─► results_report (the block and the bench's last lines)
    screening_report (--screen), grpo_tuning_report (--tune-grpo) ─► write_page (between the block's markers)

Invariant: every figure the page's prose gives about the runs is generated here, from the same numbers as the
tables (the status paragraph included), so that no hand-written figure can disagree with its block.
"""

import os
import statistics
import time
from pathlib import Path

from bench import prompt_prediction, verdict
from bench.accuracy_curves import (
    MIN_INTERVAL_SEEDS,
    PAPER_TARGET,
    TARGET_FRACTIONS,
    accuracy_points,
    compare_paired,
    seed_mean_runs,
)
from bench.accuracy_runs import (
    ALL_METHODS,
    BASELINES,
    HEADLINE_BASELINE,
    HEADLINE_METHOD,
    NULL_CHECK,
    PAIRING_FLAGS,
    RENAMED,
    RESEEDED,
    RL_FLAGS,
    SECONDARY_METHODS,
    Settings,
    init_model,
    pool_size,
    samples_per_prompt,
    task_flags,
    warm_start_flags,
)
from bench.estimator_check import calibration, calibration_table
from bench.markdown_table import markdown
from bench.run_costs import (
    PHASES,
    ModelSize,
    fit_step_cost,
    load_groups,
    model_size,
    phase_breakdown,
    price_list,
    with_cost_model,
    with_projected_cost,
)
from megatron_dppo.metrics import Run, plot_runs
from megatron_dppo.servers.embedded.scheduler import MAX_BATCH_SIZE

CALIBRATION_RATIOS = (1.0, 1.5, 2.37)  # the known speed-ups the page reads simulated benches at (2.37: the paper's)
CALIBRATION_DATASETS = 300  # simulated benches per ratio
BASELINE_NAMES = {"grpo-paper": "GRPO as the DPPO paper ran it, every group trained",
                  "grpo": "GRPO with the DAPO filter, zero-variance groups dropped",
                  "dapo-dynamic-sampling": "GRPO with DAPO's dynamic sampling, rounds until the batch is varied"}
# The bench's last lines: DPPO's defaults against each baseline (the key of each line)
LAST_LINE_KEYS = {"grpo-paper": "grpo", "grpo": "grpo_filtered", "dapo-dynamic-sampling": "grpo_dynamic_sampling"}
# The goals for DPPO against each baseline: (speed-up, the 95% interval's low end at least), on the primary axis
GOALS = {"grpo-paper": (2.37, 1.5), "grpo": (1.3, None), "dapo-dynamic-sampling": (2.0, None)}
# What a speed-up is read on: any cumulative cost of the runs (run_costs); "step": steps taken, so that a speed-up
# in steps is the per-step learning (fewer steps to the same accuracy)
AXES = {"seconds_steps": "RL wall time", "cost_model_seconds": "cost-model time", "step": "steps",
        "tokens_generated_total": "generated tokens", "tokens_trained_total": "trained tokens", "flops_total": "FLOPs"}
WALL, COST_MODEL, PRIMARY = "seconds_steps", "cost_model_seconds", verdict.PRIMARY_AXIS
# grpo and grpo-paper are the same optimiser step by step (the filter drops only zero-advantage groups and keeps the
# full batch's normaliser): grpo's speed-up over grpo-paper is known in advance, their step-time ratio
FILTER_CHECK = ("grpo-paper", "grpo")
NOT_REACHED = "†"  # a time (and cost) to a target the curve never reached: its budget stands in
# Qwen3-4B on MATH on 8 H100s: the share of a GRPO step that is generation (the rest: log-probs and update); peers
# report 45-70% for long math responses, an assumption and not a measurement of ours: the projection is a band over it
PROJECTION_SHARES = (0.45, 0.55, 0.70)


def results_report(settings: Settings, started: float) -> tuple[str, str]:
    """The generated block of the page, from the finished runs, and the bench's last lines."""
    size = model_size(init_model(settings))
    groups, cost = load_analysed(settings, size)
    comparisons = compare_all(groups)
    flat = {method: list(by_seed.values()) for method, by_seed in groups.items()}
    rule = rule_verdicts(comparisons)
    lines = last_lines(comparisons, groups, rule)
    work = work_summary(groups)
    cap = prompt_level_cap(settings.out_dir / "runs", groups, method=dppo_read(groups))
    sections = [
        f"### Status\n\n{status(comparisons, groups, rule, work, cap)}",
        settings_section(settings, groups, size),
        f"### The estimator where the answer is known\n\n{known_ratio_section(groups, comparisons)}",
        *[speedup_section(baseline, groups, comparisons) for baseline in BASELINES],
        f"### The work each step did, and the machine (mean per step over every seed)\n\n{work_table(work)}",
        f"### The prompt level at work (all seeds; epochs over the {pool_size()}-problem pool)\n\n"
        f"{prompt_level_table(settings.out_dir / 'runs', groups, pool_size())}\n\n{cap['text']}",
        f"### Where the time goes (mean per step, ms and share of the step)\n\n{phase_table(flat)}",
        f"### The price list behind cost-model time\n\n{price_section(flat, cost)}",
        "### Projection for Qwen3-4B on MATH, 8 H100s (on paper, not measured)\n\n"
        f"{projection(groups, dppo_read(groups))}",
        figures_section(settings, groups),
        f"Bench wall time (runs not already finished + analysis): {time.perf_counter() - started:.0f} s. "
        "Last lines:\n\n" + "\n".join(f"    {line}" for line in lines)]
    return "\n\n".join(sections), "\n".join(lines)


def analysed_seeds(settings: Settings, method: str) -> list[int]:
    return settings.seeds[:settings.secondary_seeds] if method in SECONDARY_METHODS else settings.seeds


def load_analysed(settings: Settings, size: ModelSize | None, methods: list[str] | None = None,
                  required: tuple[str, ...] = tuple(BASELINES)) -> tuple[dict[str, dict[int, Run]], dict]:
    """Every finished run of `methods` (default: settings.methods and the RENAMED ones; method -> seed -> run, each
    method with the seeds it has) with its cost columns, the cost-model time among them, and the price list that
    priced it (one fit over every step of every run)."""
    methods = methods or [*settings.methods, *RENAMED]
    groups = load_groups(settings.out_dir / "runs", {m: analysed_seeds(settings, m) for m in methods}, size,
                         samples_per_prompt())
    missing = [baseline for baseline in required if baseline not in groups]
    if missing:
        raise ValueError(f"no finished run of the baseline(s) {missing}: every speed-up is read against every "
                         f"baseline; run them (bench/time_to_accuracy.py always adds them to --methods)")
    cost = fit_step_cost([run for by_seed in groups.values() for run in by_seed.values()])
    return {m: {s: with_cost_model(run, cost) for s, run in by_seed.items()} for m, by_seed in groups.items()}, cost


def compare_all(groups: dict[str, dict[int, Run]], baselines=tuple(BASELINES)) -> dict[str, dict[str, dict]]:
    """axis -> baseline -> method -> compare_paired over the seeds both ran; an axis that some run does not count
    (FLOPs without a model size) is left out."""
    out = {}
    for axis in AXES:
        if any(run.records[-1].get(axis, 0.0) <= 0 for by_seed in groups.values() for run in by_seed.values()):
            continue
        curves = {m: {s: accuracy_points(run, axis) for s, run in by_seed.items()} for m, by_seed in groups.items()}
        out[axis] = {b: {m: compare_paired(curves[b], points) for m, points in curves.items()} for b in baselines}
    return out


def rule_verdicts(comparisons: dict, method: str = HEADLINE_METHOD) -> dict[str, dict]:
    """baseline -> verdict.verdicts of `method` against each baseline on the primary axis (no runs: undecided)."""
    return verdict.verdicts({b: comparisons[PRIMARY][b].get(method) for b in BASELINES})


def rule_stops(settings: Settings) -> bool:
    """verdict.should_stop for the headline method on the runs finished so far with settings.seeds, priced by the
    page's own price list (fitted over every run the page reads)."""
    groups, _ = load_analysed(settings, None)
    if HEADLINE_METHOD not in groups:
        return False
    comparisons = compare_all({m: groups[m] for m in (*BASELINES, HEADLINE_METHOD)})
    return verdict.should_stop({b: comparisons[PRIMARY][b][HEADLINE_METHOD] for b in BASELINES})


def interval_text(result: dict | None, kind: str = "headline") -> str:
    """`X [low, high]`; `X [no interval: fewer than 3 seeds]` before the third paired seed; nan where a run or the
    baseline's gain is missing."""
    if not result or not result["estimate"]:
        return "nan"
    if not result[f"{kind}_interval"]:
        return f"{result['estimate'][kind]:.2f} [no interval: fewer than {MIN_INTERVAL_SEEDS} seeds]"
    low, high = result[f"{kind}_interval"]
    return f"{result['estimate'][kind]:.2f} [{low:.2f}, {high:.2f}]"


def step_time_ratio(groups: dict[str, dict[int, Run]], baseline: str, method: str, axis: str) -> float:
    """The baseline's x (RL time) to take the first K steps over the method's, summed over the seeds both ran (K:
    the fewest steps any of their runs took): the speed-up two methods that learn alike step by step must show."""
    seeds = sorted(set(groups[baseline]) & set(groups[method]))
    steps = min(len(groups[name][seed].records) for name in (baseline, method) for seed in seeds)
    return (sum(groups[baseline][s].records[steps - 1][axis] for s in seeds)
            / sum(groups[method][s].records[steps - 1][axis] for s in seeds))


def holds(result: dict | None, truth: float) -> bool:
    interval = result["headline_interval"] if result and result["estimate"] else None
    return bool(interval) and interval[0] <= truth <= interval[1]


def check_lines(groups: dict[str, dict[int, Run]], comparisons: dict) -> list[str]:
    """The known-ratio checks on the runs, on wall and cost-model time: grpo against grpo-paper, whose speed-up is
    their step-time ratio, and grpo-null against grpo, whose is 1."""
    lines = []
    baseline, method = FILTER_CHECK
    for axis in (WALL, COST_MODEL):
        suffix = "" if axis == WALL else "_cost_model"
        lines.append(f"grpo_filter_check{suffix}: {interval_text(comparisons[axis][baseline][method])}, step-time "
                     f"ratio {step_time_ratio(groups, baseline, method, axis):.2f}"
                     if method in groups else f"grpo_filter_check{suffix}: nan")
    baseline, method = NULL_CHECK
    for axis in (WALL, COST_MODEL):
        lines.append(f"grpo_null_check{'' if axis == WALL else '_cost_model'}: "
                     f"{interval_text(comparisons[axis][baseline].get(method))}")
    return lines


def last_lines(comparisons: dict, groups: dict[str, dict[int, Run]], rule: dict[str, dict]) -> list[str]:
    """DPPO's defaults against each baseline: the verdict (and for an equivalence its interval), then `name: X [low,
    high]` on wall time, on cost-model time, and the paper's definition (time to the baseline's final accuracy);
    then the known-ratio checks."""
    axis_name = AXES[PRIMARY]
    lines = []
    for baseline, key in LAST_LINE_KEYS.items():
        decided = rule[baseline]
        lines.append(f"dppo_verdict_vs_{key}: {decided['verdict']} ({axis_name}, {decided['seeds']} seeds)")
        if decided["equivalence_interval"]:
            low, high = decided["equivalence_interval"]
            lines.append(f"dppo_equivalence_vs_{key}: [{low:.2f}, {high:.2f}]")
    for baseline, key in LAST_LINE_KEYS.items():
        result = {axis: comparisons[axis][baseline].get(HEADLINE_METHOD) for axis in (WALL, COST_MODEL)}
        lines.append(f"dppo_speedup_vs_{key}: {interval_text(result[WALL])}")
        lines.append(f"dppo_speedup_vs_{key}_cost_model: {interval_text(result[COST_MODEL])}")
        lines.append(f"dppo_speedup_vs_{key}_paper_definition: {interval_text(result[WALL], 'paper')}")
    return lines + check_lines(groups, comparisons)


def dppo_read(groups: dict[str, dict[int, Run]]) -> str:
    """The DPPO whose runs the page's DPPO sections read: the headline method, or before it has a run, the first
    RENAMED one (its records)."""
    return next((m for m in (HEADLINE_METHOD, *RENAMED) if m in groups), HEADLINE_METHOD)


def status(comparisons: dict, groups: dict[str, dict[int, Run]], rule: dict[str, dict], work: dict[str, dict],
           cap: dict) -> str:
    """The page's status paragraph, from the same numbers as the tables and last lines: the rule's verdict for the
    headline method and, read by the same rule, for each RENAMED one that has runs; the goals; the checks."""
    rows = []
    for method in (HEADLINE_METHOD, *RENAMED):
        decided_by = rule if method == HEADLINE_METHOD else rule_verdicts(comparisons, method)
        if method != HEADLINE_METHOD and method not in groups:
            continue
        for baseline, decided in decided_by.items():
            goal, low_end = GOALS[baseline]
            result = comparisons[PRIMARY][baseline].get(method)
            estimate = result["estimate"]["headline"] if result and result["estimate"] else None
            interval = decided["interval"]
            met = estimate is not None and estimate >= goal and (low_end is None or bool(interval and
                                                                                      interval[0] > low_end))
            rows.append([method, baseline, f"**{decided['verdict']}** ({decided['seeds']} seeds)",
                         interval_text(result), interval_text(comparisons[WALL][baseline].get(method)),
                         f"{goal}x" + (f", low end above {low_end}" if low_end else ""), "met" if met else "not met"])
    table = markdown(["method", "against", f"verdict ({AXES[PRIMARY]})", "speed-up in cost-model time [95%]",
                      "speed-up in RL wall time [95%]", "the goal", ""], rows)
    checks = []
    for name, (baseline, method), truth in (("filter check", FILTER_CHECK, None), ("null check", NULL_CHECK, 1.0)):
        if method not in groups:
            checks.append(f"the {name} ({method} against {baseline}) has no runs yet")
            continue
        result = comparisons[COST_MODEL][baseline].get(method)
        expected = truth if truth is not None else step_time_ratio(groups, baseline, method, COST_MODEL)
        checks.append(f"the {name} ({method} against {baseline}) reads {interval_text(result)} in cost-model time "
                      f"against a true {expected:.2f}: {'holds' if holds(result, expected) else 'FAILS'}")
    where, read = "", dppo_read(groups)
    if read in work and "grpo" in work:
        method_work, grpo_work = work[read], work["grpo"]
        where = (f" Where the time goes: {read} trains {method_work['informative']:.1f} informative groups a step "
                 f"against grpo's {grpo_work['informative']:.1f} (zero-variance share of the rolled-out groups "
                 f"{1 - method_work['informative_share']:.0%} against {1 - grpo_work['informative_share']:.0%})"
                 + (f"; its keep rule, replayed on grpo's steps, lowers the step's gradient variance "
                    f"{cap['variance_gain']:.2f}x against uniform keeping, where a perfect predictor would "
                    f"{cap['oracle_gain']:.2f}x" if cap.get("variance_gain") else "") + ".")
    return (f"DPPO against each baseline by the rule fixed above (primary axis {AXES[PRIMARY]}; Holm's "
            f"correction across the three baselines; the last lines give {HEADLINE_METHOD}'s):\n\n{table}\n\n"
            f"Checks on the runs: {'; '.join(checks)}.{where}")


def known_ratio_section(groups: dict[str, dict[int, Run]], comparisons: dict) -> str:
    """The estimator's calibration on simulated curves of known ratio (bench/estimator_check.py) at this bench's
    seed count, and its reading of the runs whose ratio is known: grpo against grpo-paper (their step-time ratio) and
    grpo against itself with independent seeds (1)."""
    seeds = max(len(by_seed) for by_seed in groups.values())
    if seeds >= MIN_INTERVAL_SEEDS:
        rows = calibration(list(CALIBRATION_RATIOS), seeds, CALIBRATION_DATASETS)
        simulated = (f"Simulated benches of {seeds} paired seeds whose true speed-up is set in advance (`python "
                     f"bench/estimator_check.py --seeds {seeds}`: the curve, noise and step times of the "
                     f"embedded default's runs; {CALIBRATION_DATASETS} benches per ratio), read by this page's "
                     f"estimator:\n\n{calibration_table(rows, seeds)}\n\n")
    else:
        simulated = (f"The simulated calibration needs {MIN_INTERVAL_SEEDS} paired seeds or more (an interval over "
                     f"fewer has no degrees of freedom); the runs have {seeds}.\n\n")
    return (simulated +
            "On the runs: grpo and grpo-paper are the same optimiser step by step (the filter drops only "
            "zero-advantage groups and keeps the full batch's normaliser), so grpo's speed-up over grpo-paper must "
            "read their step-time ratio (the RL time of their first K steps, K the fewest steps any of their runs "
            f"took); {NULL_CHECK[1]} is grpo with independent seeds (its seed-s run draws --rl-seed s + "
            f"{RESEEDED[NULL_CHECK[1]]}: another pool, order and sampling, everything else equal), so its speed-up "
            "over grpo must read 1.0, under the learning noise every comparison of two methods faces:\n\n"
            + "\n".join(f"    {line}" for line in check_lines(groups, comparisons)))


def settings_section(settings: Settings, groups: dict[str, dict[int, Run]], size: ModelSize) -> str:
    """What was run: the settings, the finished runs and every flag."""
    renamed = "; ".join(f"{name}: `{' '.join(old.flags)}` as run at revision {old.revision} (its records, read by the "
                        f"command they ran with)" for name, old in RENAMED.items() if name in groups)
    return (
        f"Settings: the worked synthetic task, seeds {settings.seeds} (the baselines, {HEADLINE_METHOD} and "
        f"{NULL_CHECK[1]} with every seed, {', '.join(SECONDARY_METHODS)} with the first {settings.secondary_seeds}); "
        f"seed s of every method shares GRPO's seed s (`{' '.join(PAIRING_FLAGS)}`: the pool, its order, the held-out "
        f"set, the start), but {NULL_CHECK[1]}'s draws --rl-seed s + {RESEEDED[NULL_CHECK[1]]}. RL budget "
        f"{settings.budget_s:.0f} s per run (evaluations excluded), warm start {settings.warm_start_steps} supervised "
        f"steps (`{' '.join(warm_start_flags())}`), {settings.eval_size} held-out problems every "
        f"{settings.eval_interval} steps, {settings.processes} processes. Model: {size.parameters} parameters.\n"
        f"Finished runs (seeds): " + "; ".join(f"{m} {sorted(by_seed)}" for m, by_seed in groups.items()) + ".\n"
        f"Common RL flags: `{' '.join(RL_FLAGS + task_flags())}`; per method: "
        + "; ".join(f"{m}: `{' '.join(ALL_METHODS[m])}`" for m in groups if ALL_METHODS.get(m))
        + (f"; {renamed}" if renamed else "") + ".")


def figures_section(settings: Settings, groups: dict[str, dict[int, Run]]) -> str:
    """Draws every run's curves and the seed-mean curves; links to them, relative to the page (or --out-dir)."""
    figures = plot_runs([run for by_seed in groups.values() for run in by_seed.values()], settings.figures_dir,
                        ("heldout_accuracy", "reward_mean"), ("seconds_steps",), smooth=10,
                        title="worked synthetic task: all methods, all seeds")
    figures += plot_runs(seed_mean_runs(groups), settings.figures_dir / "seed_mean", ("heldout_accuracy",),
                         ("seconds_steps",), title="worked synthetic task: mean over seeds, each evaluation "
                                                   "centred on its neighbours")
    link_root = settings.page.parent if settings.page else settings.out_dir
    return "\n".join(f"![{path.parent.name}/{path.stem}]({os.path.relpath(path, link_root)})" for path in figures)


# ------------------------------------------------------------------------------------------------ tables
def fmt_count(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def fmt_speedup(result: dict, kind: str = "headline") -> str:
    """`**X**x [low, high]`, marked † where a seed-mean curve never reached a target and its end stood in."""
    estimate = result["estimate"]
    if estimate is None:
        return "no gain"
    reached = estimate["reached_all"] if kind == "headline" else estimate["reached_paper"]
    interval = result[f"{kind}_interval"]
    bounds = f"{interval[0]:.2f}, {interval[1]:.2f}" if interval else "fewer than 3 seeds"
    return f"**{estimate[kind]:.2f}x**{'' if reached else NOT_REACHED} [{bounds}]"


def target_label(fraction: float, accuracy: float) -> str:
    return f"{'final' if fraction == PAPER_TARGET else f'{100 * fraction:.0f}%'} ({accuracy:.3f})"


def speedup_section(baseline: str, groups: dict[str, dict[int, Run]], comparisons: dict) -> str:
    """Every method against one baseline: per method its final accuracy and its speed-ups on every axis (wall time,
    cost-model time, tokens, FLOPs) with their intervals, then the RL time and speed-up to each target."""
    title = f"### Time to accuracy against {baseline} ({BASELINE_NAMES[baseline]})"
    wall = comparisons[WALL][baseline]
    reference = wall[baseline]["estimate"]  # the baseline against itself, over all its seeds
    if reference is None:
        return f"{title}\n\n{baseline}'s final accuracy is not above the warm start's: no rising part to time."
    last = TARGET_FRACTIONS[-1]
    last_time = reference["baseline_times"][last][0]
    evaluations = statistics.fmean(sum(0 < x <= last_time for x, _ in accuracy_points(run, WALL))
                                   for run in groups[baseline].values())
    summary, per_target = [], []
    for method, result in wall.items():
        summary.append([method, str(len(result["seeds"])), f"{result['final_mean']:.3f} ± {result['final_se']:.3f}",
                        *[fmt_speedup(comparisons[axis][baseline][method]) for axis in comparisons],
                        fmt_speedup(result, "paper")])
        estimate = result["estimate"]
        if estimate is None or method == baseline:
            continue
        for fraction, (seconds, reached) in estimate["times"].items():
            per_target.append([method, target_label(fraction, estimate["targets"][fraction]),
                               f"{estimate['baseline_times'][fraction][0]:.1f}"
                               f"{'' if estimate['baseline_times'][fraction][1] else NOT_REACHED}",
                               f"{seconds:.1f}{'' if reached else NOT_REACHED}",
                               f"{estimate['speedups'][fraction]:.2f}x"])
    summary_header = ["method", "seeds", "final accuracy (mean ± SE)",
                      *[f"speed-up in {AXES[axis]} [95% interval]" for axis in comparisons],
                      "wall time to the baseline's final accuracy (paper's definition)"]
    target_header = ["method", "target (accuracy)", f"{baseline}'s RL s to it", "method's RL s to it",
                     "speed-up (wall)"]
    return (
        f"{title}\n\n{baseline} reaches its {100 * last:.0f}% target (against itself) after {last_time:.1f} s of RL, "
        f"after {evaluations:.1f} evaluations on average per seed.\n\n"
        f"{markdown(summary_header, summary)}\n\n{markdown(target_header, per_target)}\n\n"
        f"Speed-up = {baseline}'s cost to a target / the method's (the headline: the geometric mean over the 50/75/90% "
        "targets), read on seed-mean curves over the seeds both ran (seed s of each shares the pool, its order and "
        "the held-out set). Targets: the warm start plus 50/75/90% of the lower of the two methods' gains. 95% "
        "intervals: jackknife over seed pairs, t quantiles, on the log speed-up. "
        f"{NOT_REACHED}: a seed-mean curve never reached a target within its budget; its end stood in, so that "
        "speed-up is a bound.")


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


def work_summary(groups: dict[str, dict[int, Run]]) -> dict[str, dict]:
    """Per method, the mean step's logged work (rollout rounds, engine batches, decode iterations, groups rolled out
    and how many of them had varied rewards, generated and trained tokens), its speed (µs per generated token in the
    rollout phase), informative groups per second of RL time and of cost-model time, wall over cost-model time, and
    what else the machine ran meanwhile (machine.json: the load monitor's other processes' CPU per second of the run;
    None for runs recorded before it measured them, whose reading subtracted two clocks and was clipped at 0)."""
    out = {}
    for method, by_seed in groups.items():
        records = [r for run in by_seed.values() for r in run.records]
        mean = step_means(records)
        rl_seconds = sum(run.records[-1]["seconds_steps"] for run in by_seed.values())
        model_seconds = sum(run.records[-1]["cost_model_seconds"] for run in by_seed.values())
        informative = mean("groups_rolled_out") - mean("zero_variance_groups_rolled_out")
        machines = [(run.summary or {}).get("machine") or {} for run in by_seed.values()]  # run_costs.load_groups
        others = [machine["other_cores_busy"] for machine in machines if "other_cpu_seconds" in machine]
        out[method] = {
            "rounds": mean("dapo_rounds", 1.0), "batches": mean("engine_batches", 1.0),
            "iterations": mean("decode_iterations"), "groups": mean("groups_rolled_out"), "informative": informative,
            "informative_share": informative / max(mean("groups_rolled_out"), 1e-9),
            "generated": mean("tokens_generated"), "trained": mean("tokens_trained"),
            "microseconds": 1e6 * sum(float(r.get("seconds_rollout", 0)) for r in records) / max(
                sum(float(r.get("tokens_generated", 0)) for r in records), 1),
            "per_rl_second": informative * len(records) / rl_seconds,
            "per_model_second": informative * len(records) / model_seconds,
            "wall_over_model": rl_seconds / model_seconds,
            "estimated": statistics.fmean(bool(r.get("work_estimated")) for r in records),
            "others": (statistics.fmean(others), max(others)) if others else None}
    return out


def work_table(work: dict[str, dict]) -> str:
    rows = [[method, f"{w['rounds']:.2f}", f"{w['batches']:.2f}", f"{w['iterations']:.0f}"
             + (f" ({w['estimated']:.0%} estimated)" if w["estimated"] else ""), f"{w['groups']:.1f}",
             f"{w['informative']:.1f}", f"{w['informative_share']:.2f}", fmt_count(w["generated"]),
             fmt_count(w["trained"]), f"{w['microseconds']:.0f}", f"{w['per_rl_second']:.1f}",
             f"{w['per_model_second']:.1f}", f"{w['wall_over_model']:.2f}",
             f"{w['others'][0]:.2f} (max {w['others'][1]:.2f})" if w["others"] else "not measured"]
            for method, w in work.items()]
    header = ["method", "rollout rounds", "engine batches", "decode iterations", "groups rolled out",
              "informative groups", "informative share", "tokens generated", "tokens trained",
              "rollout µs per generated token", "informative groups per RL s", "informative groups per cost-model s",
              "RL wall time / cost-model time", "other processes' cores busy during its runs (mean, max)"]
    return (markdown(header, rows) + "\n\nInformative: a group whose rewards vary (the others have zero advantage "
            f"and no gradient). Engine batches: the embedded engine decodes at most {MAX_BATCH_SIZE} rows at once, the "
            "rest in a later batch, whose loop runs after the first, as long as its own longest response; decode "
            "iterations sum over a step's batches. Runs recorded before the trainer logged its batches had them "
            f"derived (each rollout round's groups rolled out x {samples_per_prompt()} rows, {MAX_BATCH_SIZE} at a "
            "time), and logged the longest response's iterations only: where a round overflowed one batch, the later "
            "batch's iterations are estimated (the longest mean response of its groups over the run's own ratio of "
            "that to the logged iterations on one-batch steps) and the step is priced, not fitted. RL wall time / "
            "cost-model time near 1 for every method: the price list prices each method's steps alike. Cores busy: "
            "the other processes' CPU seconds during each run per second of the run (`machine.json`: every process's "
            "CPU time and its reaped children's, read before and after, the bench's own aside); runs recorded before "
            "this monitor are not measured.")


def step_means(records: list[dict]):
    """mean(key, default): the mean of a logged value over `records` (default where a step does not log it)."""
    def mean(key: str, default: float = 0.0) -> float:
        return statistics.fmean(float(r.get(key, default)) for r in records)

    return mean


def price_section(groups: dict[str, list[Run]], cost: dict) -> str:
    """The price list (run_costs.fit_step_cost) and what it makes of each method's mean step: the part priced by
    tokens and the part that is not (the fixed part and decode iterations)."""
    rows = []
    for method, runs in groups.items():
        records = [r for run in runs for r in run.records]
        mean = step_means(records)
        priced = {term: cost["prices"][term] * mean(term, 1.0 if term == "fixed" else 0.0) for term in cost["prices"]}
        step = sum(priced.values())
        rows.append([method, f"{1000 * mean('seconds_step'):.0f}", f"{1000 * step:.0f}",
                     *[f"{1000 * value:.0f} ({value / step:.0%})" for value in priced.values()]])
    header = ["method", "ms/step (wall)", "ms/step (cost model)",
              *[term.replace("_", " ").replace("tokens ", "") for term in cost["prices"]]]
    return (f"Non-negative least squares of every step's time on its logged work, over every step of every run "
            f"(bench/run_costs.py; ± a jackknife standard error over runs): {price_list(cost)}. A method's mean step, "
            f"priced (ms and share):\n\n{markdown(header, rows)}")


def projection(groups: dict[str, dict[int, Run]], method: str = HEADLINE_METHOD) -> str:
    """The measured runs carried to a token-bound step (no fixed cost, as at 4,096-token responses): each step costs
    share x its generated tokens / grpo-paper's mean step's + (1 - share) x its trained tokens / grpo-paper's, and
    the speed-up is read on that cost as the headline is (the geometric mean over the 50/75/90% targets, the paired
    interval), for each generation share of PROJECTION_SHARES and each baseline."""
    if method not in groups:
        return f"No projection: {method} has no finished run."
    records = [r for run in groups[HEADLINE_BASELINE].values() for r in run.records]
    reference = (statistics.fmean(float(r.get("tokens_generated", 0)) for r in records),
                 statistics.fmean(float(r.get("tokens_trained", 0)) for r in records))
    rows = []
    for baseline in BASELINES:
        row = [baseline]
        for share in PROJECTION_SHARES:
            axis = f"projected_{share}"
            curves = {name: {seed: accuracy_points(with_projected_cost(run, share, reference), axis)
                             for seed, run in groups[name].items()} for name in (baseline, method)}
            row.append(interval_text(compare_paired(curves[baseline], curves[method])))
        rows.append(row)
    header = ["against", *[f"generation {100 * share:.0f}% of a GRPO step" for share in PROJECTION_SHARES]]
    return (f"Assumptions: (1) the step is token-bound: generation scales with generated tokens and the update with "
            f"trained tokens (at 4,096-token responses and batches of 32 x 8 a fixed cost like ours is small); (2) "
            f"generation is {', '.join(f'{100 * share:.0f}%' for share in PROJECTION_SHARES)} of a {HEADLINE_BASELINE} "
            f"step (peers report this range; the rest: log-probs and update); (3) {method}'s measured steps carry "
            f"over: their tokens and how many of them reach each target. {method}'s speed-up then, read as the "
            "headline is (geometric mean over the 50/75/90% targets, 95% interval over paired seeds):\n\n"
            f"{markdown(header, rows)}\n\nThe paper: 2.37x, to GRPO's final accuracy.")


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


def prompt_level_cap(root: Path, groups: dict[str, dict[int, Run]], reference: str = "grpo",
                     method: str = HEADLINE_METHOD) -> dict:
    """What the prompt level buys DPPO and what would cap it: its keep rule replayed on `reference`'s outcomes (every
    drawn group rolled out) at `method`'s mean kept fraction of drawn prompts (prompt_prediction.keep_rule_gain);
    {"text", "variance_gain", "oracle_gain"}."""
    if reference not in groups or method not in groups:
        return {"text": f"(needs finished runs of {reference} and {method})"}
    keep_fraction = statistics.fmean(float(r.get("kept_fraction_prompts", 1.0)) for run in groups[method].values()
                                     for r in run.records[1:])
    runs = [prompt_prediction.read_outcomes(root / reference / f"seed_{seed}") for seed in groups[reference]]
    gain = prompt_prediction.keep_rule_gain(runs, keep_fraction)
    return {"variance_gain": gain.variance_gain, "oracle_gain": gain.oracle_gain, "text": (
        f"{method}'s keep rule replayed on {reference}'s steps (every drawn group rolled out; "
        f"`prompt_prediction.keep_rule_gain`), keeping {keep_fraction:.2f} of the drawn prompts as {method} did: "
        f"{100 * gain.informative_share:.0f}% of the kept groups have varied rewards against "
        f"{100 * gain.base_share:.0f}% of all drawn, and the step's gradient variance is "
        f"**{gain.variance_gain:.2f}x lower** than keeping the same number uniformly at random. A predictor that "
        f"knew every outcome would make it {gain.oracle_gain:.2f}x lower. With refill, DPPO rolls out as many "
        "groups as GRPO and its step estimates the gradient of all the prompts it drew: the history's prediction "
        "is the whole of its lever against the filtered GRPO.")}

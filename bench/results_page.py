"""The time-to-accuracy bench's report: its tables, figures and the generated blocks of docs/results.md, from the
runs bench/accuracy_runs.py finished (none is started here).

    finished runs ─► load_groups (run_costs) ─► per baseline (accuracy_runs.BASELINES): every method's times, tokens
    and FLOPs to the baseline's 50/75/90% targets and its final accuracy, the speed-ups and their paired intervals
    (accuracy_curves.compare_paired) ─► the prompt level at work, where the time goes, fewer steps x shorter steps,
    the Qwen3-4B projection, the control, figures (megatron_dppo.metrics.plot_runs), the MATH cost table
    ─► results_report (the block and the bench's last lines) ─► write_page (between the block's markers)
"""

import json
import os
import statistics
import time
from pathlib import Path

from bench import prompt_prediction
from bench.accuracy_curves import (
    MIN_INTERVAL_SEEDS,
    PAPER_TARGET,
    TARGET_FRACTIONS,
    accuracy_points,
    compare_paired,
    final_accuracy,
    seed_mean_curve,
    seed_mean_runs,
)
from bench.accuracy_runs import (
    ALL_METHODS,
    BASELINES,
    HEADLINE_BASELINE,
    HEADLINE_METHOD,
    PAIRING_FLAGS,
    RL_FLAGS,
    SECONDARY_METHODS,
    Settings,
    pool_size,
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
    speedup_decomposition,
    steps_at,
    token_dependent_seconds,
    value_at,
    with_cost_model,
    with_costs,
)
from bench.training_run import finished
from megatron_dppo.metrics import Run, load_run, plot_runs

CALIBRATION_RATIOS = (1.0, 1.5, 2.37)  # the known speed-ups the page reads simulated benches at (2.37: the paper's)
CALIBRATION_DATASETS = 300  # simulated benches per ratio
BASELINE_NAMES = {"grpo-paper": "GRPO as the DPPO paper ran it, every group trained",
                  "grpo": "GRPO with the DAPO filter, zero-variance groups dropped",
                  "dapo-dynamic-sampling": "GRPO with DAPO's dynamic sampling, rounds until the batch is varied"}
# The bench's last lines: DPPO's defaults against each baseline, the headline then the paper's definition
LAST_LINE_NAMES = {"grpo-paper": "dppo_speedup_vs_grpo", "grpo": "dppo_speedup_vs_grpo_filtered",
                   "dapo-dynamic-sampling": "dppo_speedup_vs_grpo_dynamic_sampling"}
# What a speed-up is read on: any cumulative cost of the runs (run_costs), the headline on the first
AXES = {"seconds_steps": "RL wall time", "cost_model_seconds": "cost-model time",
        "tokens_generated_total": "generated tokens", "tokens_trained_total": "trained tokens", "flops_total": "FLOPs"}
WALL, COST_MODEL = "seconds_steps", "cost_model_seconds"
DECIDED_WIDTH = 0.5  # an interval narrower than this decides a headline
# grpo and grpo-paper are the same optimiser step by step (the filter drops only zero-advantage groups and keeps the
# full batch's normaliser): grpo's speed-up over grpo-paper is known in advance, their step-time ratio
FILTER_CHECK = ("grpo-paper", "grpo")
NOT_REACHED = "†"  # a time (and cost) to a target the curve never reached: its budget stands in


def results_report(settings: Settings, sft_steps_per_second: float, control: tuple[Path, int] | None,
                   math_model: Path | None, started: float) -> tuple[str, str]:
    """The generated block of the page, from the finished runs, and the bench's last lines. `control`: the control's
    run directory and its extra supervised steps (run_control); `math_model`: the MATH runs' model (None: none)."""
    size = model_size(next((settings.out_dir / "cache" / "init").glob("embedded_*/init")))
    groups, cost = load_analysed(settings, size)
    comparisons = compare_all(groups)
    flat = {method: list(by_seed.values()) for method, by_seed in groups.items()}
    wall = comparisons[WALL]
    sections = [settings_section(settings, groups, size),
                f"### The estimator where the answer is known\n\n{known_ratio_section(groups, comparisons, settings)}"]
    sections += [speedup_section(baseline, groups, comparisons) for baseline in BASELINES]
    headline = wall[HEADLINE_BASELINE]
    target_times = {method: result["estimate"]["times"][TARGET_FRACTIONS[-1]][0]
                    if result["estimate"] and result["estimate"]["times"][TARGET_FRACTIONS[-1]][1] else None
                    for method, result in headline.items()}
    sections += [
        f"### The work each step did, and the machine (mean per step over every seed)\n\n{work_table(groups)}",
        f"### The prompt level at work (all seeds; epochs over the {pool_size()}-problem pool)\n\n"
        f"{prompt_level_table(settings.out_dir / 'runs', groups, pool_size())}\n\n"
        f"{prompt_level_cap(settings.out_dir / 'runs', groups)}",
        f"### Where the time goes (mean per step, ms and share of the step)\n\n{phase_table(flat)}",
        f"### Fewer steps or shorter steps (to {HEADLINE_BASELINE}'s {100 * TARGET_FRACTIONS[-1]:.0f}% target)\n\n"
        f"{decomposition_table(groups, target_times, HEADLINE_BASELINE, cost)}",
        f"### Projection for Qwen3-4B on MATH, 8 H100s (on paper, not measured)\n\n"
        f"{projection(groups, target_times, HEADLINE_BASELINE)}",
    ]
    if control and finished(control[0]):  # --analyse-only: when it has run (here or in the records)
        sections.append(control_section(settings, control, sft_steps_per_second, headline))
    sections.append(figures_section(settings, groups))
    if math_model:
        sections.append(math_section(settings, math_model))
    lines = last_lines(comparisons, groups)
    sections.append(f"Bench wall time (runs not already finished + analysis): {time.perf_counter() - started:.0f} s. "
                    "Last lines:\n\n" + "\n".join(f"    {line}" for line in lines))
    return "\n\n".join(sections), "\n".join(lines)


def load_analysed(settings: Settings, size: ModelSize) -> tuple[dict[str, dict[int, Run]], dict]:
    """Every finished run (method -> seed -> run, each method with the seeds it has) with its cost columns, the
    cost-model time among them, and the step-cost fit that priced it (one fit over every step of every run)."""
    seeds = {m: settings.seeds if m not in SECONDARY_METHODS else settings.seeds[:settings.secondary_seeds]
             for m in settings.methods}
    groups = load_groups(settings.out_dir / "runs", seeds, size)
    missing = [baseline for baseline in BASELINES if baseline not in groups]
    if missing:
        raise ValueError(f"no finished run of the baseline(s) {missing}: every speed-up is read against every "
                         f"baseline; run them (bench/time_to_accuracy.py always adds them to --methods)")
    cost = fit_step_cost([run for by_seed in groups.values() for run in by_seed.values()])
    return {m: {s: with_cost_model(run, cost) for s, run in by_seed.items()} for m, by_seed in groups.items()}, cost


def compare_all(groups: dict[str, dict[int, Run]]) -> dict[str, dict[str, dict[str, dict]]]:
    """axis -> baseline -> method -> compare_paired over the seeds both ran; an axis that some run does not count
    (FLOPs without a model size) is left out."""
    out = {}
    for axis in AXES:
        if any(run.records[-1].get(axis, 0.0) <= 0 for by_seed in groups.values() for run in by_seed.values()):
            continue
        curves = {m: {s: accuracy_points(run, axis) for s, run in by_seed.items()} for m, by_seed in groups.items()}
        out[axis] = {b: {m: compare_paired(curves[b], points) for m, points in curves.items()} for b in BASELINES}
    return out


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


def check_lines(groups: dict[str, dict[int, Run]], comparisons: dict) -> list[str]:
    """grpo against grpo-paper, whose speed-up is their step-time ratio: on wall time and on cost-model time."""
    baseline, method = FILTER_CHECK
    if baseline not in groups or method not in groups:
        return ["grpo_filter_check: nan"]
    return [f"grpo_filter_check{'' if axis == WALL else '_cost_model'}: "
            f"{interval_text(comparisons[axis][baseline][method])}, step-time ratio "
            f"{step_time_ratio(groups, baseline, method, axis):.2f}" for axis in (WALL, COST_MODEL)]


def last_lines(comparisons: dict, groups: dict[str, dict[int, Run]]) -> list[str]:
    """DPPO's defaults against each baseline: `name: X [low, high]` on wall time, then on cost-model time, then the
    paper's definition (time to the baseline's final accuracy); then the known-ratio check."""
    lines = []
    for baseline, name in LAST_LINE_NAMES.items():
        lines.append(f"{name}: {interval_text(comparisons[WALL].get(baseline, {}).get(HEADLINE_METHOD))}")
        lines.append(f"{name}_cost_model: "
                     f"{interval_text(comparisons[COST_MODEL].get(baseline, {}).get(HEADLINE_METHOD))}")
    for baseline, name in LAST_LINE_NAMES.items():
        lines.append(f"{name}_paper_definition: "
                     f"{interval_text(comparisons[WALL].get(baseline, {}).get(HEADLINE_METHOD), 'paper')}")
    return lines + check_lines(groups, comparisons)


def decided(comparisons: dict) -> bool:
    """Every headline interval of DPPO against a baseline narrower than DECIDED_WIDTH, on wall time or, where not
    there, on cost-model time (bench/time_to_accuracy.py adds seeds until this holds)."""
    def width(axis: str, baseline: str) -> float:
        result = comparisons[axis].get(baseline, {}).get(HEADLINE_METHOD)
        interval = result["headline_interval"] if result else None
        return interval[1] - interval[0] if interval else float("inf")

    return all(min(width(WALL, b), width(COST_MODEL, b)) < DECIDED_WIDTH for b in LAST_LINE_NAMES)


def headline_decided(settings: Settings) -> bool:
    """decided() on the runs finished so far with settings.seeds."""
    size = model_size(next((settings.out_dir / "cache" / "init").glob("embedded_*/init")))
    return decided(compare_all(load_analysed(settings, size)[0]))


def known_ratio_section(groups: dict[str, dict[int, Run]], comparisons: dict, settings: Settings) -> str:
    """The estimator's calibration on simulated curves of known ratio (bench/estimator_check.py) at this bench's
    seed count, and its reading of grpo against grpo-paper, whose ratio is their step-time ratio."""
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
            "took):\n\n" + "\n".join(f"    {line}" for line in check_lines(groups, comparisons)))


def settings_section(settings: Settings, groups: dict[str, dict[int, Run]], size: ModelSize) -> str:
    """What was run: the settings, the finished runs and every flag."""
    return (
        f"Settings: the {settings.task} synthetic task, {len(settings.seeds)} seed(s) {settings.seeds}, every method "
        f"with every seed; seed s of every method shares GRPO's seed s (`{' '.join(PAIRING_FLAGS)}`: the pool, its "
        f"order, the held-out set, the start). RL budget {settings.budget_s:.0f} s per run (evaluations excluded), "
        f"warm start {settings.warm_start_steps} supervised steps (`{' '.join(warm_start_flags(settings.task))}`), "
        f"{settings.eval_size} held-out problems every {settings.eval_interval} steps, {settings.processes} "
        f"processes. Model: {size.parameters} parameters.\n"
        f"Finished runs (seeds): " + "; ".join(f"{m} {sorted(by_seed)}" for m, by_seed in groups.items()) + ".\n"
        f"Common RL flags: `{' '.join(RL_FLAGS + task_flags(settings.task))}`; per method: "
        + "; ".join(f"{m}: `{' '.join(ALL_METHODS[m])}`" for m in settings.methods) + ".")


def control_section(settings: Settings, control: tuple[Path, int], sft_steps_per_second: float,
                    comparisons: dict[str, dict]) -> str:
    """The supervised control's accuracy against every method's final accuracy."""
    control_dir, extra_steps = control
    accuracy = json.loads((control_dir / "summary.json").read_text())["heldout_accuracy_before"]
    return (f"### Supervised control (seed {settings.seeds[0]})\n\n"
            f"The warm start measured {sft_steps_per_second:.2f} supervised steps/s, so the RL budget of "
            f"{settings.budget_s:.0f} s buys {extra_steps} more supervised steps on the same warm-start data: a warm "
            f"start of {settings.warm_start_steps + extra_steps} steps reaches held-out accuracy "
            f"**{accuracy:.3f}**, against "
            + ", ".join(f"{m} {r['final_mean']:.3f}" for m, r in comparisons.items())
            + " (final accuracy of RL, mean over seeds).")


def figures_section(settings: Settings, groups: dict[str, dict[int, Run]]) -> str:
    """Draws every run's curves and the seed-mean curves; links to them, relative to the page (or --out-dir)."""
    figures = plot_runs([run for by_seed in groups.values() for run in by_seed.values()], settings.figures_dir,
                        ("heldout_accuracy", "reward_mean"), ("seconds_steps",), smooth=10,
                        title=f"{settings.task} synthetic task: all methods, all seeds")
    figures += plot_runs(seed_mean_runs(groups), settings.figures_dir / "seed_mean", ("heldout_accuracy",),
                         ("seconds_steps",), title=f"{settings.task} synthetic task: mean over seeds, each evaluation "
                                                   "centred on its neighbours")
    link_root = settings.page.parent if settings.page else settings.out_dir
    return "\n".join(f"![{path.parent.name}/{path.stem}]({os.path.relpath(path, link_root)})" for path in figures)


def math_section(settings: Settings, model_dir: Path) -> str:
    """The methods' per-step costs on MATH train prompts (run_math_methods' runs)."""
    size = model_size(model_dir)
    groups = load_groups(settings.out_dir / "math", dict.fromkeys(settings.methods, settings.seeds[:1]), size)
    return (f"### MATH train prompts, tiny random model, {settings.math_budget_s:.0f} s per method "
            f"(seed {settings.seeds[0]})\n\n"
            f"{math_table({m: list(r.values()) for m, r in groups.items()}, size)}")


def grpo_tuning_report(settings: Settings, run_dirs: dict[str, list[Path]]) -> str:
    """Each GRPO setting (run_grpo_tuning's runs) scored by the mean held-out accuracy over the RL budget (the area
    under its seed-mean accuracy-vs-time curve / the budget: higher is faster to any accuracy); a table."""
    rows = []
    for label, dirs in run_dirs.items():
        runs = [with_costs(load_run(run_dir, label), None, False) for run_dir in dirs]
        points = [accuracy_points(run, "seconds_steps") for run in runs]
        curve = seed_mean_curve(points)
        area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(curve, curve[1:]))
        final = statistics.fmean(final_accuracy(seed_points) for seed_points in points)
        rows.append([label, f"{area / max(curve[-1][0], 1e-9):.3f}", f"{final:.3f}",
                     f"{statistics.fmean(len(run.records) for run in runs):.0f}"])
    best = max(rows, key=lambda row: float(row[1]))
    return (markdown(["GRPO setting", "mean held-out accuracy over the budget", "final accuracy", "steps"], rows)
            + f"\n\nBest: {best[0]} ({len(settings.seeds)} seeds, {settings.budget_s:.0f} s each).")


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


def work_table(groups: dict[str, dict[int, Run]]) -> str:
    """Per method, the mean step's logged work (rollout rounds, decode iterations, groups rolled out and how many of
    them had varied rewards, generated and trained tokens), its speed (µs per generated token in the rollout phase),
    informative groups per second of RL time and of cost-model time, and what else the machine did meanwhile."""
    rows = []
    for method, by_seed in groups.items():
        records = [r for run in by_seed.values() for r in run.records]
        mean = step_means(records)
        informative = mean("groups_rolled_out") - mean("zero_variance_groups_rolled_out")
        rl_seconds = sum(run.records[-1]["seconds_steps"] for run in by_seed.values())
        model_seconds = sum(run.records[-1]["cost_model_seconds"] for run in by_seed.values())
        microseconds = 1e6 * sum(float(r.get("seconds_rollout", 0)) for r in records) / max(
            sum(float(r.get("tokens_generated", 0)) for r in records), 1)
        others = [machine["other_cores_busy"] for machine in (machine_record(run) for run in by_seed.values())
                  if machine and machine.get("other_cores_busy") is not None]
        rows.append([method, f"{mean('dapo_rounds', 1.0):.2f}", f"{mean('decode_iterations'):.0f}",
                     f"{mean('groups_rolled_out'):.1f}", f"{informative:.1f}",
                     f"{informative / max(mean('groups_rolled_out'), 1e-9):.2f}",
                     fmt_count(mean("tokens_generated")), fmt_count(mean("tokens_trained")), f"{microseconds:.0f}",
                     f"{informative * len(records) / rl_seconds:.1f}",
                     f"{informative * len(records) / model_seconds:.1f}",
                     f"{statistics.fmean(others):.2f} (max {max(others):.2f})" if others else "-"])
    header = ["method", "rollout rounds", "decode iterations", "groups rolled out", "informative groups",
              "informative share", "tokens generated", "tokens trained", "rollout µs per generated token",
              "informative groups per RL s", "informative groups per cost-model s",
              "other processes' cores busy during its runs (mean, max)"]
    return (markdown(header, rows) + "\n\nInformative: a group whose rewards vary (the others have zero advantage "
            "and no gradient). Cores busy: the machine's busy CPU time during each run minus the run's own, per "
            "second of the run (`machine.json` beside each run): the load the shared machine added.")


def step_means(records: list[dict]):
    """mean(key, default): the mean of a logged value over `records` (default where a step does not log it)."""
    def mean(key: str, default: float = 0.0) -> float:
        return statistics.fmean(float(r.get(key, default)) for r in records)

    return mean


def machine_record(run: Run) -> dict | None:
    """The run's machine.json (what else the machine did while it ran; run_costs.load_groups reads it), if any."""
    return (run.summary or {}).get("machine")


def decomposition_table(runs: dict[str, dict[int, Run]], times: dict[str, float | None], baseline: str,
                        cost: dict) -> str:
    """Speed-up = fewer steps x shorter steps at the seed-mean times to one target (`times`: method -> RL seconds,
    None where never reached), and the step-cost fit `cost` (fitted on every run's steps) split into its fixed and
    token-dependent parts."""
    parts = speedup_decomposition(runs, times, baseline)
    token_cost = {}
    for method, by_seed in runs.items():
        phases = phase_breakdown(list(by_seed.values()))
        token_cost[method] = (phases["seconds_step"], token_dependent_seconds(cost, phases))
    base_step, base_tokens = token_cost[baseline]
    rows = []
    for method, part in parts.items():
        step, tokens = token_cost[method]
        rows.append([method, f"{part['steps']:.0f}" if part["steps"] is not None else "not reached",
                     f"{part['step_ratio']:.2f}x" if part["step_ratio"] else "-",
                     f"{part['step_time_ratio']:.2f}x" if part["step_time_ratio"] else "-",
                     f"{1000 * (step - tokens):.0f} / {1000 * tokens:.0f}", f"{base_tokens / tokens:.2f}x"
                     if tokens > 0 else "-"])
    header = ["method", "steps to target (seed mean)", f"fewer steps: {baseline} steps / steps",
              f"shorter steps: {baseline} s/step / s/step", "fixed / token-dependent ms per step (fit)",
              f"{baseline} token-dependent time / method's"]
    fit = (f"Fit over every step of every run (R² {cost['r_squared']:.2f}): step ≈ {1000 * cost['fixed']:.0f} ms "
           f"+ {1000 * cost['per_round']:.0f} ms per rollout round"
           f" + {1000 * cost['per_iteration']:.2f} ms per decode iteration + {1e6 * cost['per_generated']:.0f} µs per "
           f"generated token + {1e6 * cost['per_trained']:.0f} µs per trained token. Of {baseline}'s mean step "
           f"({1000 * base_step:.0f} ms) the part that does not scale with tokens (fixed and decode iterations) is "
           f"{100 * (base_step - base_tokens) / base_step:.0f}%.")
    return markdown(header, rows) + "\n\n" + fit


# Qwen3-4B on MATH on 8 H100s: the share of a GRPO step that is generation (the rest: log-probs and update), as peers
# report for long math responses; an assumption, not a measurement of ours
PROJECTION_GENERATION_SHARE = 0.65


def projection(runs: dict[str, dict[int, Run]], times: dict[str, float | None], baseline: str,
               method: str = HEADLINE_METHOD) -> str:
    """The measured ratios carried to a token-bound step (no fixed cost): speed-up = fewer steps / (generation share
    x generated-token ratio + update share x trained-token ratio), per step, up to the time to one target (`times`:
    method -> seed-mean RL seconds to it, None where never reached)."""
    if method not in runs or not times.get(method):
        return f"No projection: {method} did not reach {baseline}'s {100 * TARGET_FRACTIONS[-1]:.0f}% target."
    step_ratio = speedup_decomposition(runs, times, baseline)[method]["step_ratio"]
    per_step = {}
    for name in (baseline, method):
        steps = statistics.fmean(steps_at(run, times[name]) for run in runs[name].values())
        per_step[name] = [statistics.fmean(value_at(run, key, "seconds_steps", times[name]) for run in
                                           runs[name].values()) / steps
                          for key in ("tokens_generated_total", "tokens_trained_total")]
    generated = per_step[method][0] / per_step[baseline][0]
    trained = per_step[method][1] / per_step[baseline][1]
    share = PROJECTION_GENERATION_SHARE
    step_cost = share * generated + (1 - share) * trained
    return (f"Assumptions: (1) the step is token-bound: generation scales with generated tokens and the update with "
            f"trained tokens (at 4,096-token responses and batches of 32 x 8 a fixed cost like ours is small); "
            f"(2) a GRPO step is {100 * share:.0f}% generation and {100 * (1 - share):.0f}% log-probs and update; "
            f"(3) {method}'s measured ratios against {baseline} carry over: {generated:.2f}x its generated tokens and "
            f"{trained:.2f}x its trained tokens per step, and {step_ratio:.2f}x fewer steps to its "
            f"{100 * TARGET_FRACTIONS[-1]:.0f}% target. Then a {method} step costs {share:.2f} x {generated:.2f} + "
            f"{1 - share:.2f} x {trained:.2f} = {step_cost:.2f} of GRPO's, and the time to target "
            f"{1 / step_ratio:.2f} x {step_cost:.2f}: **about {step_ratio / step_cost:.2f}x** (the paper: 2.37x, "
            "to GRPO's final accuracy).")


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


def prompt_level_cap(root: Path, groups: dict[str, dict[int, Run]], reference: str = "grpo",
                     method: str = HEADLINE_METHOD) -> str:
    """What the prompt level buys DPPO and what would cap it: its keep rule replayed on `reference`'s outcomes (every
    drawn group rolled out) at `method`'s mean kept fraction of drawn prompts (prompt_prediction.keep_rule_gain)."""
    if reference not in groups or method not in groups:
        return f"(needs finished runs of {reference} and {method})"
    keep_fraction = statistics.fmean(float(r.get("kept_fraction_prompts", 1.0)) for run in groups[method].values()
                                     for r in run.records[1:])
    runs = [prompt_prediction.read_outcomes(root / reference / f"seed_{seed}") for seed in groups[reference]]
    gain = prompt_prediction.keep_rule_gain(runs, keep_fraction)
    return (f"{method}'s keep rule replayed on {reference}'s steps (every drawn group rolled out; "
            f"`prompt_prediction.keep_rule_gain`), keeping {keep_fraction:.2f} of the drawn prompts as {method} did: "
            f"{100 * gain.informative_share:.0f}% of the kept groups have varied rewards against "
            f"{100 * gain.base_share:.0f}% of all drawn, and the step's gradient variance is "
            f"**{gain.variance_gain:.2f}x lower** than keeping the same number uniformly at random. A predictor that "
            f"knew every outcome would make it {gain.oracle_gain:.2f}x lower. With refill, DPPO rolls out as many "
            "groups as GRPO and its step estimates the gradient of all the prompts it drew: the history's prediction "
            "is the whole of its lever against the filtered GRPO.")


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

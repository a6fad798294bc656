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
    FINAL_WINDOW,
    PAPER_TARGET,
    TARGET_FRACTIONS,
    accuracy_points,
    compare_paired,
    final_accuracy,
    mean_curve,
    seed_mean_runs,
)
from bench.accuracy_runs import (
    ALL_METHODS,
    BASELINES,
    HEADLINE_BASELINE,
    HEADLINE_METHOD,
    PAIRING_FLAGS,
    RL_FLAGS,
    Settings,
    pool_size,
    task_flags,
    warm_start_flags,
)
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
    with_costs,
)
from bench.training_run import finished
from megatron_dppo.metrics import Run, load_run, plot_runs

BASELINE_NAMES = {"grpo-paper": "GRPO as the DPPO paper ran it, every group trained",
                  "grpo": "GRPO with the DAPO filter, zero-variance groups dropped"}
# The bench's last lines: DPPO's defaults against each baseline, the headline, then the paper's definition
LAST_LINE_NAMES = {"grpo-paper": "dppo_speedup_vs_grpo", "grpo": "dppo_speedup_vs_grpo_filtered"}
NOT_REACHED = "†"  # a time (and cost) to a target the curve never reached: its budget stands in
COST_KEYS = ("tokens_generated_total", "tokens_trained_total", "flops_total")


def results_report(settings: Settings, sft_steps_per_second: float, control: tuple[Path, int] | None,
                   math_model: Path | None, started: float) -> tuple[str, str]:
    """The generated block of the page, from the finished runs, and the bench's last lines. `control`: the control's
    run directory and its extra supervised steps (run_control); `math_model`: the MATH runs' model (None: none)."""
    size = model_size(next((settings.out_dir / "cache" / "init").glob("embedded_*/init")))
    groups = load_groups(settings.out_dir / "runs", dict.fromkeys(settings.methods, settings.seeds), size)
    missing = [baseline for baseline in BASELINES if baseline not in groups]
    if missing:
        raise ValueError(f"no finished run of the baseline(s) {missing}: every speed-up is read against both "
                         f"baselines; run them (bench/time_to_accuracy.py always adds them to --methods)")
    curves = {method: {seed: accuracy_points(run, "seconds_steps") for seed, run in by_seed.items()}
              for method, by_seed in groups.items()}
    comparisons = {baseline: {method: compare_paired(curves[baseline], points) for method, points in curves.items()}
                   for baseline in BASELINES}
    flat = {method: list(by_seed.values()) for method, by_seed in groups.items()}
    sections = [settings_section(settings, groups, size)]
    sections += [speedup_section(baseline, groups, curves[baseline], comparisons[baseline]) for baseline in BASELINES]
    headline = comparisons[HEADLINE_BASELINE]
    target_times = {method: result["estimate"]["times"][TARGET_FRACTIONS[-1]][0]
                    if result["estimate"] and result["estimate"]["times"][TARGET_FRACTIONS[-1]][1] else None
                    for method, result in headline.items()}
    sections += [
        f"### The prompt level at work (all seeds; epochs over the {pool_size()}-problem pool)\n\n"
        f"{prompt_level_table(settings.out_dir / 'runs', groups, pool_size())}",
        f"### Where the time goes (mean per step, ms and share of the step)\n\n{phase_table(flat)}",
        f"### Fewer steps or shorter steps (to {HEADLINE_BASELINE}'s {100 * TARGET_FRACTIONS[-1]:.0f}% target)\n\n"
        f"{decomposition_table(groups, target_times, HEADLINE_BASELINE)}",
        f"### Projection for Qwen3-4B on MATH, 8 H100s (on paper, not measured)\n\n"
        f"{projection(groups, target_times, HEADLINE_BASELINE)}",
    ]
    if control and finished(control[0]):  # --analyse-only: when it has run (here or in the records)
        sections.append(control_section(settings, control, sft_steps_per_second, headline))
    sections.append(figures_section(settings, groups))
    if math_model:
        sections.append(math_section(settings, math_model))
    lines = last_lines(comparisons)
    sections.append(f"Bench wall time (runs not already finished + analysis): {time.perf_counter() - started:.0f} s. "
                    "Last lines:\n\n" + "\n".join(f"    {line}" for line in lines))
    return "\n\n".join(sections), "\n".join(lines)


def last_lines(comparisons: dict[str, dict[str, dict]]) -> list[str]:
    """`name: X [low, high]` of DPPO's defaults against each baseline: the headline speed-ups, then the paper's
    definition (time to the baseline's final accuracy); `name: nan` where a run or the baseline's gain is missing."""
    lines = []
    for kind, suffix in (("headline", ""), ("paper", "_paper_definition")):
        for baseline, name in LAST_LINE_NAMES.items():
            result = comparisons.get(baseline, {}).get(HEADLINE_METHOD)
            interval = result[f"{kind}_interval"] if result else None
            if result and result["estimate"] and interval:
                lines.append(f"{name}{suffix}: {result['estimate'][kind]:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]")
            else:
                lines.append(f"{name}{suffix}: nan")
    return lines


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
                         ("seconds_steps",), title=f"{settings.task} synthetic task: mean over seeds, trailing mean of "
                                                   f"{FINAL_WINDOW} evaluations")
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
        curve = mean_curve([accuracy_points(run, "seconds_steps") for run in runs])
        area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(curve, curve[1:]))
        rows.append([label, f"{area / max(curve[-1][0], 1e-9):.3f}", f"{final_accuracy(curve):.3f}",
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


def fmt_speedup(value: float, reached: bool, interval: tuple[float, float] | None, reached_share: float,
                usable: float) -> str:
    """`**X**x [low, high]`, marked where the point estimate counted a budget, with the share of bootstrap draws
    that reached every target where some did not, and of draws left out (no gain) where there were any."""
    notes = [f"{100 * reached_share:.0f}% of draws reach"] * (reached_share < 0.999)
    notes += [f"{100 * (1 - usable):.0f}% of draws without a gain left out"] * (usable < 0.999)
    bounds = f"{interval[0]:.2f}, {interval[1]:.2f}" if interval else "-"
    return f"**{value:.2f}x**{'' if reached else NOT_REACHED} [{', '.join([bounds, *notes])}]"


def costs_at(runs: dict[int, Run], seeds: list[int], seconds: float) -> dict[str, float]:
    """Mean over `seeds` of each run's cumulative tokens and FLOPs at `seconds` of RL time (its whole run's when
    it ends earlier)."""
    return {key: statistics.fmean(value_at(runs[seed], key, "seconds_steps", seconds) for seed in seeds)
            for key in COST_KEYS}


def target_label(fraction: float, accuracy: float) -> str:
    return f"{'final' if fraction == PAPER_TARGET else f'{100 * fraction:.0f}%'} ({accuracy:.3f})"


def speedup_section(baseline: str, groups: dict[str, dict[int, Run]], baseline_points: dict[int, list],
                    comparisons: dict[str, dict]) -> str:
    """Every method against one baseline (comparisons: compare_paired per method): the targets, a summary (final
    accuracy, the headline and the paper's speed-ups with their paired intervals, costs to the last headline target
    against the baseline's) and a table per target (RL time, speed-up, tokens and FLOPs to it)."""
    title = f"### Time to accuracy against {baseline} ({BASELINE_NAMES[baseline]})"
    reference = comparisons[baseline]["estimate"]  # the baseline against itself, over all its seeds
    if reference is None:
        return f"{title}\n\n{baseline}'s final accuracy is not above the warm start's: no rising part to time."
    targets, last = reference["targets"], TARGET_FRACTIONS[-1]
    warm, final = reference["warm_start"], reference["final"]
    last_time = reference["baseline_times"][last][0]
    evaluations = sum(0 < x <= last_time for x, _ in mean_curve(list(baseline_points.values())))
    summary, per_target = [], []
    for method, result in comparisons.items():
        estimate, seeds = result["estimate"], result["seeds"]
        if estimate is None:  # the baseline over these seeds gained nothing
            summary.append([method, str(len(seeds)), f"{result['final_mean']:.3f} ± {result['final_se']:.3f}",
                            "no gain", "no gain", "-"])
            continue
        base_costs = costs_at(groups[baseline], seeds, estimate["baseline_times"][last][0])
        costs = costs_at(groups[method], seeds, estimate["times"][last][0])
        summary.append([
            method, str(len(seeds)), f"{result['final_mean']:.3f} ± {result['final_se']:.3f}",
            fmt_speedup(estimate["headline"], estimate["reached_all"], result["headline_interval"],
                        result["reached_all"], result["usable"]),
            fmt_speedup(estimate["paper"], estimate["reached_paper"], result["paper_interval"],
                        result["reached_paper"], result["usable"]),
            " / ".join(f"{costs[key] / base_costs[key]:.2f}" if base_costs[key] else "-" for key in COST_KEYS)])
        for fraction, (seconds, reached) in estimate["times"].items():
            costs = costs_at(groups[method], seeds, seconds)
            per_target.append([method, target_label(fraction, estimate["targets"][fraction]),
                               f"{seconds:.1f}{'' if reached else NOT_REACHED}",
                               f"{estimate['speedups'][fraction]:.2f}x", *[fmt_count(costs[key]) for key in COST_KEYS]])
    summary_header = ["method", "seeds", "final accuracy (mean ± SE)",
                      "speed-up: geometric mean of 50/75/90% [95% paired interval]",
                      "speed-up to the final accuracy (paper's definition) [95% paired interval]",
                      f"cost to the {100 * last:.0f}% target vs {baseline} (gen / trained / FLOPs)"]
    target_header = ["method", "target (accuracy)", "RL s to target", f"speed-up vs {baseline}",
                     "tokens generated", "tokens trained", "FLOPs"]
    return (
        f"{title}\n\nTargets on {baseline}'s seed-mean curve: its gain is its final accuracy {final:.3f} (mean of "
        f"its last {FINAL_WINDOW} evaluations) minus the warm start's {warm:.3f}, and the targets are the warm start "
        f"plus 50/75/90% of it: " + " / ".join(f"{targets[f]:.3f}" for f in TARGET_FRACTIONS) + f". {baseline} "
        f"reaches its {100 * last:.0f}% target after {last_time:.1f} s of RL and {evaluations} evaluations.\n\n"
        f"{markdown(summary_header, summary)}\n\n{markdown(target_header, per_target)}\n\n"
        f"Speed-up = {baseline}'s RL time to a target / the method's, on seed-mean curves over the seeds both ran "
        "(seed s of each shares the pool, its order and the held-out set); the headline is the geometric mean of the "
        "50/75/90% speed-ups. 95% intervals: bootstrap draws of seed pairs, each draw recomputing the targets and "
        f"both curves from the same seeds. {NOT_REACHED} never reached within the budget: the budget (the seed-mean "
        "RL time of the last evaluation) stands in for the time and the whole run's tokens and FLOPs for the costs, "
        "so the speed-up there is an upper bound.")


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


def decomposition_table(runs: dict[str, dict[int, Run]], times: dict[str, float | None], baseline: str) -> str:
    """Speed-up = fewer steps x shorter steps at the seed-mean times to one target (`times`: method -> RL seconds,
    None where never reached), and a token cost model of the step fitted on every run's steps."""
    parts = speedup_decomposition(runs, times, baseline)
    cost = fit_step_cost([run for by_seed in runs.values() for run in by_seed.values()])
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
           f"+ {1000 * cost['per_iteration']:.2f} ms per decode iteration + {1e6 * cost['per_generated']:.0f} µs per "
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

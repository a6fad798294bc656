"""The time-to-accuracy bench's report: its tables, figures and the generated blocks of docs/results.md, from the
runs bench/accuracy_runs.py finished (none is started here).

    finished runs ─► load_groups (run_costs) ─► time to GRPO's final accuracy (accuracy_curves), the prompt level at
    work, where the time goes, fewer steps x shorter steps, the Qwen3-4B projection, the control, figures
    (megatron_dppo.metrics.plot_runs), the MATH cost table ─► results_report ─► write_page (between the block's
    markers)
"""

import json
import os
import statistics
import time
from pathlib import Path

from bench import prompt_prediction
from bench.accuracy_curves import (
    FINAL_WINDOW,
    accuracy_points,
    compare_mean_curves,
    compare_to_baseline,
    final_accuracy,
    mean_curve,
    seed_mean_runs,
)
from bench.accuracy_runs import (
    ALL_METHODS,
    HEADLINE_METHOD,
    RL_FLAGS,
    VARIANTS,
    Settings,
    pool_size,
    seeds_of,
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


def results_report(settings: Settings, sft_steps_per_second: float, control: tuple[Path, int] | None,
                   math_model: Path | None, started: float) -> tuple[str, str]:
    """The generated block of the page, from the finished runs, and the bench's last line. `control`: the control's
    run directory and its extra supervised steps (run_control); `math_model`: the MATH runs' model (None: none)."""
    size = model_size(next((settings.out_dir / "cache" / "init").glob("embedded_*/init")))
    groups = load_groups(settings.out_dir / "runs", {method: seeds_of(settings, method)
                                                     for method in settings.methods}, size)
    table, results = accuracy_table(groups)
    flat = {method: list(by_seed.values()) for method, by_seed in groups.items()}
    sections = [
        settings_section(settings, groups, size),
        f"### Time to GRPO's final accuracy ({results['grpo']['target']:.3f}) on the {settings.task} synthetic "
        f"task\n\n{table}",
        f"### The prompt level at work (all seeds; epochs over the {pool_size()}-problem pool)\n\n"
        f"{prompt_level_table(settings.out_dir / 'runs', groups, pool_size())}",
        f"### Where the time goes (mean per step, ms and share of the step)\n\n{phase_table(flat)}",
        f"### Fewer steps or shorter steps\n\n{decomposition_table(groups, results)}",
        f"### Projection for Qwen3-4B on MATH, 8 H100s (on paper, not measured)\n\n{projection(groups, results)}",
    ]
    if control and finished(control[0]):  # --analyse-only: when it has run (here or in the records)
        sections.append(control_section(settings, control, sft_steps_per_second, results))
    sections.append(figures_section(settings, groups))
    if math_model:
        sections.append(math_section(settings, math_model))
    headline = results.get(HEADLINE_METHOD, {})
    last_line = (f"dppo_speedup_vs_grpo: {headline['speedup']:.2f} [{headline['interval'][0]:.2f}, "
                 f"{headline['interval'][1]:.2f}]" if headline.get("speedup") else "dppo_speedup_vs_grpo: nan")
    sections.append(f"Bench wall time (runs not already finished + analysis): {time.perf_counter() - started:.0f} s. "
                    f"Last line: `{last_line}`")
    return "\n\n".join(sections), last_line


def settings_section(settings: Settings, groups: dict[str, dict[int, Run]], size: ModelSize) -> str:
    """What was run: the settings, the finished runs and every flag."""
    return (
        f"Settings: the {settings.task} synthetic task, {len(settings.seeds)} seed(s) {settings.seeds} (the "
        f"variants {', '.join(m for m in settings.methods if m in VARIANTS) or 'none'}: seeds "
        f"{settings.variant_seeds}), RL budget "
        f"{settings.budget_s:.0f} s per run, warm start {settings.warm_start_steps} supervised steps "
        f"(`{' '.join(warm_start_flags(settings.task))}`), {settings.eval_size} held-out problems every "
        f"{settings.eval_interval} steps, {settings.processes} processes. Model: {size.parameters} parameters.\n"
        f"Finished runs (seeds): " + "; ".join(f"{m} {sorted(by_seed)}" for m, by_seed in groups.items()) + ".\n"
        f"Common RL flags: `{' '.join(RL_FLAGS + task_flags(settings.task))}`; per method: "
        + "; ".join(f"{m}: `{' '.join(ALL_METHODS[m])}`" for m in settings.methods) + ".")


def control_section(settings: Settings, control: tuple[Path, int], sft_steps_per_second: float,
                    results: dict[str, dict]) -> str:
    """The supervised control's accuracy against every method's final accuracy."""
    control_dir, extra_steps = control
    accuracy = json.loads((control_dir / "summary.json").read_text())["heldout_accuracy_before"]
    rl_finals = {m: r["final_mean"] for m, r in results.items()}
    return (f"### Supervised control (seed {settings.seeds[0]})\n\n"
            f"The warm start measured {sft_steps_per_second:.2f} supervised steps/s, so the RL budget of "
            f"{settings.budget_s:.0f} s buys {extra_steps} more supervised steps on the same warm-start data: a warm "
            f"start of {settings.warm_start_steps + extra_steps} steps reaches held-out accuracy "
            f"**{accuracy:.3f}**, against "
            + ", ".join(f"{m} {a:.3f}" for m, a in rl_finals.items()) + " (final accuracy of RL, mean over seeds).")


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

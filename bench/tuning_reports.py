"""The page's blocks that choose settings rather than judge DPPO: GRPO's tuning (--tune-grpo) and the screening of
DPPO's variants (--screen), from the runs bench/accuracy_runs.py finished.

    run_grpo_tuning's runs ─► grpo_tuning_report: each setting's mean held-out accuracy over the budget
    SCREENING's runs and grpo's ─► screening_report: each variant's speed-up in cost-model time and in steps
"""

import statistics
from pathlib import Path

from bench.accuracy_curves import accuracy_points, final_accuracy, seed_mean_curve
from bench.accuracy_runs import SCREEN_SEEDS, SCREENING, Settings
from bench.markdown_table import markdown
from bench.results_page import COST_MODEL, WALL, compare_all, fmt_speedup, interval_text, load_analysed
from bench.run_costs import price_list, with_costs
from megatron_dppo.metrics import load_run


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
            + f"\n\nBest: {best[0]} ({len(settings.seeds)} seeds, {settings.budget_s:.0f} s each; RL_FLAGS: batch "
              "32, the grpo method's own runs; each other setting changed alone from it).")


def screening_report(settings: Settings) -> tuple[str, str]:
    """SCREENING's DPPO variants against grpo over the seeds both ran: per variant its speed-up in cost-model time
    (what it costs) and in steps (what a step learns) with their intervals, its seeds and flags; and one last line
    per variant. The price list is fitted over every run the report loads (grpo's and the variants')."""
    groups, cost = load_analysed(settings, None, ["grpo", *SCREENING], required=("grpo",))
    comparisons = compare_all(groups, baselines=("grpo",))
    rows, lines = [], []
    for name in SCREENING:
        if name not in groups:
            rows.append([name, "0", "no finished run", "-", "-", f"`{' '.join(SCREENING[name])}`"])
            continue
        result = {axis: comparisons[axis]["grpo"][name] for axis in (COST_MODEL, "step", WALL)}
        rows.append([name, str(len(result[COST_MODEL]["seeds"])), fmt_speedup(result[COST_MODEL]),
                     fmt_speedup(result["step"]), fmt_speedup(result[WALL]), f"`{' '.join(SCREENING[name])}`"])
        lines.append(f"screening_{name}: {interval_text(result[COST_MODEL])} cost model, "
                     f"{interval_text(result['step'])} steps")
    header = ["variant", "seeds", "speed-up in cost-model time [95%]", "steps-to-target ratio [95%] (per-step "
              "learning)", "speed-up in RL wall time [95%]", "flags (after RL_FLAGS)"]
    return ("DPPO variants against grpo (the filtered GRPO's recorded runs), over the paired seeds the seeds column "
            f"counts ({SCREEN_SEEDS} each, more for a chosen one), read as the headline is (the geometric mean over "
            "the 50/75/90% targets; 95% intervals over seed pairs). "
            f"Price list over these runs: {price_list(cost)}.\n\n{markdown(header, rows)}"), "\n".join(lines)

"""The time-to-accuracy estimator run where its answer is known in advance: simulated paired runs whose true speed-up
is set, read by bench/accuracy_curves.compare_paired, so that the page can say what the estimator reads for a true
1.0, 1.5 and 2.37 and how often its interval covers the truth.

    CurveModel (a baseline seed: warm start, gain, rise, and the noise the records show) ─► simulate_pair: seed s's
    baseline run and method run, the method taking every step `ratio` times faster (the same learning per step, as
    grpo against grpo-paper) ─► compare_paired over n seeds ─► calibration: per true ratio, the median estimate, the
    share of intervals that hold the true ratio and their median width

The noise, per run: a level shift of its final accuracy (seeds differ in how far they get; independent between a
pair's two runs, as the records showed), a slow wobble of the curve (an autoregressive process over evaluations),
the binomial noise of evaluating a fixed number of held-out problems, and the shared machine's speed (each run's step
time scaled by a lognormal factor). python bench/estimator_check.py prints the table.

--rule: the verdict's rule (bench/verdict.py) on simulated benches of the primary axis (COST_MODEL_CURVE: cost-model
time, whose per-run speed varies far less than wall time's): a method whose every step is a set ratio faster than
each of three baselines, seeds added look by look as the bench adds them, Holm's correction across the three; the
table gives how often each verdict comes out per true ratio (its error rates) and the seeds the rule used.
    python bench/estimator_check.py --rule --write-page docs/results.md   # the page's verdict-rule block
"""

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import verdict  # noqa: E402
from bench.accuracy_curves import MIN_INTERVAL_SEEDS, compare_paired  # noqa: E402
from bench.markdown_table import markdown  # noqa: E402


@dataclass(frozen=True)
class CurveModel:
    """A baseline run of the embedded default's regime (defaults read off GRPO's tuning runs at batch 32 and the
    noise of the earlier records: docs/results.md)."""

    warm_start: float = 0.232  # held-out accuracy before RL
    gain: float = 0.15  # the plateau's distance above the warm start
    rise_s: float = 50.0  # RL seconds for the baseline to cover 1 - 1/e of the gain
    step_s: float = 1.3  # the baseline's seconds per step (GRPO at 32 prompts x 8)
    budget_s: float = 240.0
    eval_interval: int = 10  # steps
    eval_size: int = 512  # held-out problems: the binomial noise of one evaluation
    level_sd: float = 0.016  # a run's final accuracy shifted by this much (SD)
    wobble_sd: float = 0.016  # the curve's slow wobble (SD) ...
    wobble_steps: float = 20.0  # ... correlated over this many steps
    speed_sd: float = 0.15  # SD of the log of a run's step-time factor (the shared machine)


# The primary axis: cost-model time prices each step's logged work, so a run's speed varies only with its work (the
# records' seeds: SD of the log cost-model seconds per step 0.006-0.042 within a method, against 0.04-0.19 wall)
COST_MODEL_CURVE = CurveModel(speed_sd=0.04)
RULE_RATIOS = (1.0, 1.3, 2.37)


def simulate_run(model: CurveModel, rng: np.random.Generator, ratio: float) -> list[tuple[float, float]]:
    """One run's (RL seconds, held-out accuracy) points: the warm start at 0, then one evaluation every
    eval_interval steps until the budget; `ratio` > 1 makes every step that many times shorter."""
    step_s = model.step_s / ratio * math.exp(rng.normal(0.0, model.speed_sd))
    steps = int(model.budget_s / step_s)
    level = model.gain + rng.normal(0.0, model.level_sd)
    correlation = math.exp(-model.eval_interval / model.wobble_steps)
    points, wobble = [(0.0, model.warm_start)], rng.normal(0.0, model.wobble_sd)
    for step in range(model.eval_interval, steps + 1, model.eval_interval):
        wobble = correlation * wobble + math.sqrt(1 - correlation ** 2) * rng.normal(0.0, model.wobble_sd)
        # learning follows the steps, not the seconds: the same step learns alike at any speed
        progress = 1 - math.exp(-step * model.step_s / model.rise_s)
        truth = min(max(model.warm_start + level * progress + wobble, 0.0), 1.0)
        points.append((step * step_s, rng.binomial(model.eval_size, truth) / model.eval_size))
    return points


def calibration(ratios: list[float], seeds: int, datasets: int, model: CurveModel = CurveModel(),
                seed: int = 0) -> list[dict]:
    """Per true ratio: `datasets` simulated benches of `seeds` paired seeds, each read by compare_paired; the median
    headline estimate, the share whose interval holds the true ratio, and the intervals' median width."""
    if seeds < MIN_INTERVAL_SEEDS:
        raise ValueError(f"{seeds} paired seeds give no interval to calibrate: {MIN_INTERVAL_SEEDS} or more do")
    rng = np.random.default_rng(seed)
    rows = []
    for ratio in ratios:
        estimates, covered, widths = [], [], []
        for _ in range(datasets):
            baseline = {s: simulate_run(model, rng, 1.0) for s in range(seeds)}
            method = {s: simulate_run(model, rng, ratio) for s in range(seeds)}
            result = compare_paired(baseline, method)
            if result["estimate"] is None or result["headline_interval"] is None:
                continue
            low, high = result["headline_interval"]
            estimates.append(result["estimate"]["headline"])
            covered.append(low <= ratio <= high)
            widths.append(high - low)
        rows.append({"ratio": ratio, "median": statistics.median(estimates), "coverage": statistics.fmean(covered),
                     "width": statistics.median(widths), "datasets": len(estimates)})
    return rows


def calibration_table(rows: list[dict], seeds: int) -> str:
    return markdown(["true speed-up", f"median estimate ({seeds} seeds)", "95% interval holds the truth",
                     "median interval width", "simulated benches"],
                    [[f"{r['ratio']:.2f}", f"{r['median']:.2f}", f"{100 * r['coverage']:.0f}%", f"{r['width']:.2f}",
                      str(r["datasets"])] for r in rows])


def rule_outcome(ratio: float, model: CurveModel, rng: np.random.Generator,
                 baselines: int = 3) -> tuple[list[str], int]:
    """One simulated bench read by the verdict's rule: a method `ratio` times faster per step than each of
    `baselines` baselines, paired seeds added up to each of verdict.LOOKS until verdict.should_stop; the verdicts
    (one per baseline) and the seeds used."""
    method, others = {}, [{} for _ in range(baselines)]
    for look in verdict.LOOKS:
        for seed in range(len(method), look):
            method[seed] = simulate_run(model, rng, ratio)
            for runs in others:
                runs[seed] = simulate_run(model, rng, 1.0)
        results = {index: compare_paired(runs, method) for index, runs in enumerate(others)}
        if verdict.should_stop(results) or look == verdict.LOOKS[-1]:
            return [decided["verdict"] for decided in verdict.verdicts(results).values()], look
    raise AssertionError("unreachable: the last look decides")


def rule_check(ratios: list[float], benches: int, model: CurveModel = COST_MODEL_CURVE, seed: int = 0) -> list[dict]:
    """Per true ratio: `benches` simulated benches read by the rule; the share of each verdict over every baseline of
    every bench, and the mean seeds used."""
    rng = np.random.default_rng(seed)
    rows = []
    for ratio in ratios:
        outcomes = [rule_outcome(ratio, model, rng) for _ in range(benches)]
        found = [v for verdicts, _ in outcomes for v in verdicts]
        rows.append({"ratio": ratio, "benches": benches, "seeds": statistics.fmean(s for _, s in outcomes),
                     **{v: found.count(v) / len(found) for v in verdict.VERDICTS}})
    return rows


def rule_table(rows: list[dict]) -> str:
    return markdown(["true speed-up", *verdict.VERDICTS, "mean paired seeds used", "simulated benches"],
                    [[f"{r['ratio']:.2f}", *[f"{100 * r[v]:.1f}%" for v in verdict.VERDICTS], f"{r['seeds']:.1f}",
                      str(r["benches"])] for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", nargs="+", type=float, default=None,
                        help="true speed-ups (default 1.0 1.5 2.37; --rule: 1.0 1.3 2.37)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[6, 12], help="paired seeds per simulated bench")
    parser.add_argument("--datasets", type=int, default=400, help="simulated benches per ratio")
    parser.add_argument("--rule", action="store_true", help="the verdict's rule, looks and Holm's correction included")
    parser.add_argument("--write-page", default=None, help="--rule: write the table as this page's verdict-rule block")
    parser.add_argument("--seed-noise", nargs="+", type=float, default=[1.0],
                        help="--rule: one table per scale of each run's level shift and slow wobble (1: the "
                             "CurveModel's)")
    args = parser.parse_args(argv)
    if args.rule:
        ratios = args.ratios or list(RULE_RATIOS)
        report = ("The rule on simulated benches of the primary axis (`python bench/estimator_check.py --rule "
                  f"--datasets {args.datasets} --seed-noise {' '.join(map(str, args.seed_noise))}`): a method whose "
                  "every step is the true ratio faster than each of three baselines, 512 held-out problems, each "
                  f"run's speed's log SD {COST_MODEL_CURVE.speed_sd}; {args.datasets} benches per ratio, each "
                  "baseline's verdict counted.")
        for scale in args.seed_noise:
            model = replace(COST_MODEL_CURVE, level_sd=scale * COST_MODEL_CURVE.level_sd,
                            wobble_sd=scale * COST_MODEL_CURVE.wobble_sd)
            report += (f"\n\nEach run's level shift {model.level_sd:.3f} and slow wobble {model.wobble_sd:.3f} (SD; "
                       f"{scale}x the CurveModel's):\n\n{rule_table(rule_check(ratios, args.datasets, model))}")
        print(report, flush=True)
        if args.write_page:
            from bench.markdown_table import write_page

            write_page(Path(args.write_page), "verdict-rule", report)
        return
    if min(args.seeds) < MIN_INTERVAL_SEEDS:
        parser.error(f"--seeds {min(args.seeds)}: an interval needs {MIN_INTERVAL_SEEDS} paired seeds or more")
    for seeds in args.seeds:
        print(calibration_table(calibration(args.ratios or [1.0, 1.5, 2.37], seeds, args.datasets), seeds),
              flush=True)


if __name__ == "__main__":
    main()

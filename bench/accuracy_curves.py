"""Held-out accuracy curves and the time to accuracy: the targets, when a curve reaches them, the speed-ups and their
intervals over paired seeds.

    Run (run_costs.with_costs' cumulative columns) ─► accuracy_points: (x, held-out accuracy) per evaluation, the
        warm start at 0, the final evaluation once; x is RL time, cost-model time, tokens or FLOPs (any cumulative
        cost: the estimator does not care which)
    ─► centred: each evaluation averaged with its neighbours on both sides (no lag)
    ─► seed_mean_curve: the seeds' piecewise-linear curves averaged on a common grid, up to the shortest seed's end
       (every seed of a method runs to its budget, so the curve runs to the budget)
    ─► comparison_targets: warm start + 50/75/90% of the gain of the LOWER of the two curves' final accuracies
       (symmetric in the two methods, and on the rising part of both); the paper's target, the baseline's own final
    ─► crossing_time per target ─► speedups: baseline cost / method cost; headline = geometric mean over 50/75/90%
    ─► compare_paired: the estimate over the seeds both ran and a jackknife-t interval on the log speed-up (and its
       standard error, which bench/verdict.py's rule reads)

Invariants: seed s's baseline run and method run enter or leave every estimate together (they share the pool, its
order, the held-out set and the start); every evaluation is counted once; nothing is read off a curve past the end of
the seeds' runs; swapping the two methods inverts every speed-up exactly.
bench/estimator_check.py runs this estimator on simulated curves whose ratio is known in advance and reports its
median and the interval's coverage; the results page prints that calibration beside the measurement.
"""

import functools
import math
import statistics

import numpy as np

from megatron_dppo.metrics import Run

FINAL_WINDOW = 3  # a seed's final accuracy: the mean of its last this many evaluations
SMOOTHING_HALF_WINDOW = 1  # evaluations on each side of a point in its centred mean
TARGET_FRACTIONS = (0.5, 0.75, 0.9)  # of the gain over the warm start: the headline's targets
PAPER_TARGET = 1.0  # the baseline's final accuracy itself: the paper's definition of time to accuracy
GRID_POINTS = 801  # points of the common grid the seeds' curves are averaged on
CONFIDENCE = 0.95
MIN_INTERVAL_SEEDS = 3  # paired seeds an interval needs (its leave-one-out estimates less one: 2 degrees of freedom)


def accuracy_points(run: Run, x_key: str) -> list[tuple[float, float]]:
    """(x, held-out accuracy): the warm start at 0, every logged evaluation, the final evaluation at the end. Where
    the last step was itself an evaluation step, the trainer's final evaluation of the same weights stands at the same
    x: it is kept once."""
    xs, accuracies = run.series("heldout_accuracy", x_key)
    if not xs:
        raise ValueError(f"run {run.label!r} has no held-out accuracy: it needs summary.json or --eval-interval")
    points = []
    for x, accuracy in zip(xs, accuracies):
        if points and x <= points[-1][0] and len(points) > 1:
            points[-1] = (points[-1][0], accuracy)  # the final evaluation at the last evaluation step's x: once
        else:
            points.append((x, accuracy))
    return points


def centred(points: list[tuple[float, float]], half_window: int = SMOOTHING_HALF_WINDOW) -> list[tuple[float, float]]:
    """Each evaluation's accuracy averaged with up to `half_window` evaluations on each side, the window shrunk
    symmetrically near the ends (the warm start and the last evaluation stay as measured): a curve rising at a
    constant rate is left where it is, where a trailing mean lags it by half its window."""
    out = []
    for index, (x, _) in enumerate(points):
        half = min(half_window, index, len(points) - 1 - index)
        out.append((x, statistics.fmean(y for _, y in points[index - half:index + half + 1])))
    return out


def final_accuracy(points: list[tuple[float, float]], window: int = FINAL_WINDOW) -> float:
    """The mean of a seed's last `window` evaluations (the warm start counts only where there are fewer)."""
    return statistics.fmean(accuracy for _, accuracy in points[-window:])


def seed_mean_curve(points_by_seed: list[list[tuple[float, float]]],
                    grid_points: int = GRID_POINTS) -> list[tuple[float, float]]:
    """The seeds' centred curves, each linear between its evaluations, averaged on a common grid from 0 to the end
    of the shortest seed (seeds evaluate at different x: their step times differ)."""
    curves = [centred(points) for points in points_by_seed]
    end = min(curve[-1][0] for curve in curves)
    grid = np.linspace(0.0, end, grid_points)
    mean = np.mean([np.interp(grid, [x for x, _ in c], [y for _, y in c]) for c in curves], axis=0)
    return list(zip(grid.tolist(), mean.tolist()))


def crossing_time(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first x where the curve reaches `target`, linear between the two points it lies between; None if never."""
    reached = np.flatnonzero(np.asarray([y for _, y in curve]) >= target - 1e-12)
    if reached.size == 0:
        return None
    index = int(reached[0])
    if index == 0:
        return curve[0][0]
    (x0, y0), (x, y) = curve[index - 1], curve[index]
    return x0 + (x - x0) * (target - y0) / (y - y0)


def comparison_targets(baseline: list[list[tuple[float, float]]],
                       method: list[list[tuple[float, float]]]) -> dict[float, float] | None:
    """fraction -> accuracy for one comparison (the seeds' points of each side): the warm start (the mean of every
    seed's first point) plus TARGET_FRACTIONS of the lower of the two final accuracies' gains, and PAPER_TARGET: the
    baseline's own final accuracy. None where either side gained nothing (no rising part to time).
    Why the lower final: targets read off the baseline's own curve are reached by the baseline by construction and by
    the method only by chance where both plateau at the same level, which biased every speed-up toward the
    baseline (0.90 read for a true 1.0 in simulation); the lower final is symmetric and lies below both plateaus."""
    warm = statistics.fmean(points[0][1] for points in baseline + method)
    final_baseline = statistics.fmean(final_accuracy(points) for points in baseline)
    final_method = statistics.fmean(final_accuracy(points) for points in method)
    gain = min(final_baseline, final_method) - warm
    if gain <= 0:
        return None
    return {**{fraction: warm + fraction * gain for fraction in TARGET_FRACTIONS}, PAPER_TARGET: final_baseline}


def times_to_targets(curve: list[tuple[float, float]], targets: dict[float, float]) -> dict[float, tuple[float, bool]]:
    """fraction -> (x at which the curve reaches the target, reached): a curve that never reaches a target counts its
    end (its budget), so that a speed-up there is a bound."""
    times = {}
    for fraction, target in targets.items():
        reached = crossing_time(curve, target)
        times[fraction] = (reached, True) if reached is not None else (curve[-1][0], False)
    return times


def geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(value) for value in values))


def speedups(baseline: list[list[tuple[float, float]]], method: list[list[tuple[float, float]]]) -> dict | None:
    """One comparison over the given seeds' points: the targets, each seed-mean curve's x to them, the speed-up per
    target (baseline x / method x), the headline (geometric mean over TARGET_FRACTIONS) and the paper's (to the
    baseline's final accuracy); None where a side gained nothing over the warm start."""
    targets = comparison_targets(baseline, method)
    if targets is None:
        return None
    baseline_times = times_to_targets(seed_mean_curve(baseline), targets)
    method_times = times_to_targets(seed_mean_curve(method), targets)
    # every target lies above the warm start, where both curves begin, so every time is past 0
    ratios = {fraction: baseline_times[fraction][0] / max(method_times[fraction][0], 1e-12) for fraction in targets}
    return {"warm_start": statistics.fmean(points[0][1] for points in baseline + method),
            "final": targets[PAPER_TARGET], "targets": targets,
            "baseline_times": baseline_times, "times": method_times, "speedups": ratios,
            "headline": geometric_mean([ratios[fraction] for fraction in TARGET_FRACTIONS]),
            "paper": ratios[PAPER_TARGET],
            "reached_all": all(method_times[f][1] and baseline_times[f][1] for f in TARGET_FRACTIONS),
            "reached_paper": method_times[PAPER_TARGET][1]}


@functools.lru_cache(maxsize=4096)
def t_cdf(x: float, dof: int) -> float:
    """Student's t distribution function, exact to about 1e-10: with x = sqrt(dof) tan(angle) the density becomes
    cos(angle)^(dof - 1) on [0, pi/2), a smooth integrand on a bounded interval (Simpson's rule, 2000 intervals)."""
    if x < 0:
        return 1.0 - t_cdf(-x, dof)

    def integral(end: float) -> float:
        grid = np.cos(np.linspace(0.0, end, 2001)) ** (dof - 1)
        return end / 6000 * float(grid[0] + grid[-1] + 4 * grid[1:-1:2].sum() + 2 * grid[2:-1:2].sum())

    return 0.5 + 0.5 * integral(math.atan(x / math.sqrt(dof))) / integral(math.pi / 2)


@functools.lru_cache(maxsize=4096)
def t_quantile(probability: float, dof: int) -> float:
    """The x at which t_cdf(x, dof) = probability (bisection)."""
    low, high = -1e3, 1e3
    for _ in range(80):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, dof) < probability else (low, middle)
    return (low + high) / 2


def jackknife_error(leave_one_out: list[float]) -> float:
    """The jackknife standard error of a log ratio from its leave-one-seed-out values (n seeds)."""
    n = len(leave_one_out)
    logs = [math.log(value) for value in leave_one_out]
    centre = statistics.fmean(logs)
    return math.sqrt((n - 1) / n * sum((value - centre) ** 2 for value in logs))


def jackknife_interval(estimate: float, leave_one_out: list[float],
                       confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A t interval for a positive ratio on the log scale: log(estimate) ± t(n-1) x the jackknife standard error of
    the leave-one-seed-out estimates (n seeds). None with fewer than 3 seeds."""
    n = len(leave_one_out)
    if n < MIN_INTERVAL_SEEDS:
        return None
    half = t_quantile(0.5 + confidence / 2, n - 1) * jackknife_error(leave_one_out)
    return math.exp(math.log(estimate) - half), math.exp(math.log(estimate) + half)


def compare_paired(baseline: dict[int, list], method: dict[int, list]) -> dict:
    """A method against a baseline over the seeds both ran (seed -> accuracy_points): speedups() over all of them,
    and jackknife-t intervals of the headline and the paper's speed-up (each leave-one-out estimate drops seed s's
    baseline run and method run together). "reached_all": both seed-mean curves reached every headline target
    (elsewhere an end stood in and the speed-up is a bound). Also the method's final accuracy over those seeds."""
    seeds = sorted(set(baseline) & set(method))
    if not seeds:
        raise ValueError(f"no seed in common (baseline {sorted(baseline)}, method {sorted(method)}): the comparison "
                         "is paired seed by seed, so run both with the same --seeds")

    def compare(sample: list[int]) -> dict | None:
        return speedups([baseline[s] for s in sample], [method[s] for s in sample])

    estimate = compare(seeds)
    intervals = {"headline_interval": None, "paper_interval": None, "log_se": None}
    if estimate is not None and len(seeds) >= MIN_INTERVAL_SEEDS:
        left_out = [compare([s for s in seeds if s != dropped]) for dropped in seeds]
        if all(draw is not None for draw in left_out):
            for kind in ("headline", "paper"):
                intervals[f"{kind}_interval"] = jackknife_interval(estimate[kind], [d[kind] for d in left_out])
            intervals["log_se"] = jackknife_error([d["headline"] for d in left_out])
    finals = [final_accuracy(method[s]) for s in seeds]
    return {"seeds": seeds, "estimate": estimate, **intervals,
            "final_mean": statistics.fmean(finals),
            "final_se": statistics.stdev(finals) / math.sqrt(len(finals)) if len(finals) > 1 else 0.0}


def seed_mean_runs(groups: dict[str, dict[int, Run]], x_key: str = "seconds_steps") -> list[Run]:
    """One curve per method for the figure: seed_mean_curve of its seeds' centred held-out accuracy against x_key."""
    return [Run(method, [{x_key: x, "heldout_accuracy": y} for x, y in seed_mean_curve(
        [accuracy_points(run, x_key) for run in by_seed.values()])]) for method, by_seed in groups.items()]

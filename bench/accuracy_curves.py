"""Held-out accuracy curves and the time to accuracy: the targets, when a curve reaches them, the speed-ups and their
paired bootstrap intervals.

    Run (with_costs' seconds_steps) ─► accuracy_points: (RL seconds, held-out accuracy), the warm start at 0
        ─► mean_curve over the seeds a method and the baseline share
        ─► target_accuracies on the baseline's seed-mean curve: warm start + 50/75/90% of its gain, and its final
           accuracy (the paper's definition)
        ─► times_to_targets: crossing_time of each, or the budget where the curve never reaches it
        ─► speedups: baseline time / method time per target; the headline is the geometric mean of 50/75/90%
        ─► compare_paired: the 95% interval of a bootstrap over seed pairs

Definitions (bench/time_to_accuracy.py's docstring and the results page): final accuracy is the mean of the last
FINAL_WINDOW evaluations; a curve reaches a target where the trailing mean of FINAL_WINDOW evaluations does.
Invariant: a resample draws seed indices, and seed s's baseline run and method run come in or stay out together
(they share the pool, its order, the held-out set and the start), so the baseline's targets and the method's times
are recomputed from the same seeds: what a seed does to both cancels in the ratio.
"""

import math
import random
import statistics

from megatron_dppo.metrics import Run, smoothed

FINAL_WINDOW = 3  # evaluations averaged for "final accuracy" and for reaching a target
TARGET_FRACTIONS = (0.5, 0.75, 0.9)  # of the baseline's gain over the warm start: the headline's targets
PAPER_TARGET = 1.0  # the baseline's final accuracy itself: the paper's definition of time to accuracy


def accuracy_points(run: Run, x_key: str) -> list[tuple[float, float]]:
    """(x, held-out accuracy): the warm start at 0, every logged evaluation, the final evaluation at the end."""
    xs, accuracies = run.series("heldout_accuracy", x_key)
    if not xs:
        raise ValueError(f"run {run.label!r} has no held-out accuracy: it needs summary.json or --eval-interval")
    return list(zip(xs, accuracies))


def final_accuracy(points: list[tuple[float, float]], window: int = FINAL_WINDOW) -> float:
    return statistics.fmean(accuracy for _, accuracy in points[-window:])


def mean_curve(points_by_seed: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Evaluation by evaluation: the mean RL time and the mean held-out accuracy over seeds (a method's seeds
    evaluate at the same steps; cut to the seed with the fewest evaluations)."""
    count = min(len(points) for points in points_by_seed)
    return [(statistics.fmean(points[i][0] for points in points_by_seed),
             statistics.fmean(points[i][1] for points in points_by_seed)) for i in range(count)]


def crossing_time(points: list[tuple[float, float]], target: float, window: int = FINAL_WINDOW) -> float | None:
    """When the trailing mean of `window` evaluations first reaches `target`, linearly interpolated between the two
    evaluations it lies between (a resolution finer than the evaluation interval); None if it never does."""
    trailing = list(zip([x for x, _ in points], smoothed([y for _, y in points], window)))
    for index, (x, y) in enumerate(trailing):
        if y >= target - 1e-12:
            if index == 0:
                return x
            (x0, y0) = trailing[index - 1]
            return x0 + (x - x0) * (target - y0) / (y - y0)
    return None


def target_accuracies(baseline_curve: list[tuple[float, float]]) -> dict[float, float] | None:
    """fraction -> accuracy: the warm start's accuracy plus that fraction of the baseline's gain (its final accuracy
    minus the warm start's), for TARGET_FRACTIONS and PAPER_TARGET; None where the baseline gained nothing (there is
    no rising part to time)."""
    warm, final = baseline_curve[0][1], final_accuracy(baseline_curve)
    if final <= warm:
        return None
    return {fraction: warm + fraction * (final - warm) for fraction in (*TARGET_FRACTIONS, PAPER_TARGET)}


def times_to_targets(curve: list[tuple[float, float]], targets: dict[float, float]) -> dict[float, tuple[float, bool]]:
    """fraction -> (RL seconds to reach the target, reached): a curve that never reaches a target counts its budget
    (the RL time of its last evaluation), so that its speed-up there is an upper bound."""
    times = {}
    for fraction, target in targets.items():
        reached = crossing_time(curve, target)
        times[fraction] = (reached, True) if reached is not None else (curve[-1][0], False)
    return times


def geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(value) for value in values))


def speedups(baseline_curve: list[tuple[float, float]], method_curve: list[tuple[float, float]]) -> dict | None:
    """The comparison of two seed-mean curves: the baseline's warm-start and final accuracy, the targets between
    them, each curve's times to them, the speed-up per target (baseline time / method time), the headline (geometric
    mean over TARGET_FRACTIONS) and the paper's (to the baseline's final accuracy); None where the baseline gained
    nothing over the warm start."""
    targets = target_accuracies(baseline_curve)
    if targets is None:
        return None
    baseline_times = times_to_targets(baseline_curve, targets)
    method_times = times_to_targets(method_curve, targets)
    # the targets lie above the warm start, where every curve starts, so every time is past 0
    ratios = {fraction: baseline_times[fraction][0] / max(method_times[fraction][0], 1e-9) for fraction in targets}
    return {"warm_start": baseline_curve[0][1], "final": targets[PAPER_TARGET], "targets": targets,
            "baseline_times": baseline_times, "times": method_times, "speedups": ratios,
            "headline": geometric_mean([ratios[fraction] for fraction in TARGET_FRACTIONS]),
            "paper": ratios[PAPER_TARGET],
            "reached_all": all(method_times[fraction][1] for fraction in TARGET_FRACTIONS),
            "reached_paper": method_times[PAPER_TARGET][1]}


def percentile_interval(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[int(0.025 * len(ordered))], ordered[min(int(0.975 * len(ordered)), len(ordered) - 1)]


def compare_paired(baseline: dict[int, list], method: dict[int, list], resamples: int = 2000,
                   seed: int = 0) -> dict:
    """A method against a baseline over the seeds both ran (seed -> accuracy_points): speedups() of their seed-mean
    curves, with 95% intervals from `resamples` bootstrap draws of seed indices (with replacement), each draw taking
    seed s's baseline run and method run together (targets and times recomputed from the same seeds). "usable": the
    share of draws in which the baseline gained over the warm start (the others have no targets and are left out);
    "reached_all" / "reached_paper": the share of those in which the method reached every headline target / the
    baseline's final accuracy (elsewhere its budget stood in). Also the method's final accuracy over those seeds."""
    seeds = sorted(set(baseline) & set(method))
    if not seeds:
        raise ValueError(f"no seed in common (baseline {sorted(baseline)}, method {sorted(method)}): the comparison "
                         "is paired seed by seed, so run both with the same --seeds")

    def compare(sample: list[int]) -> dict | None:
        return speedups(mean_curve([baseline[s] for s in sample]), mean_curve([method[s] for s in sample]))

    rng = random.Random(seed)
    draws = [compare([rng.choice(seeds) for _ in seeds]) for _ in range(resamples)]
    draws = [draw for draw in draws if draw is not None]
    finals = [final_accuracy(method[s]) for s in seeds]
    return {
        "seeds": seeds, "estimate": compare(seeds),
        "final_mean": statistics.fmean(finals),
        "final_se": statistics.stdev(finals) / math.sqrt(len(finals)) if len(finals) > 1 else 0.0,
        "usable": len(draws) / resamples,
        "headline_interval": percentile_interval([d["headline"] for d in draws]) if draws else None,
        "paper_interval": percentile_interval([d["paper"] for d in draws]) if draws else None,
        "reached_all": statistics.fmean(d["reached_all"] for d in draws) if draws else 0.0,
        "reached_paper": statistics.fmean(d["reached_paper"] for d in draws) if draws else 0.0,
    }


def seed_mean_runs(groups: dict[str, dict[int, Run]]) -> list[Run]:
    """One curve per method for the figure: held-out accuracy averaged over seeds evaluation by evaluation (a
    method's seeds evaluate at the same steps; cut to the seed with the fewest), at the seeds' mean RL time, then
    the trailing mean of FINAL_WINDOW evaluations that the time to target uses."""
    curves = []
    for method, by_seed in groups.items():
        points = mean_curve([accuracy_points(run, "seconds_steps") for run in by_seed.values()])
        ys = smoothed([y for _, y in points], FINAL_WINDOW)
        curves.append(Run(method, [{"seconds_steps": x, "heldout_accuracy": y} for (x, _), y in zip(points, ys)]))
    return curves

"""Held-out accuracy curves and the time to accuracy: the target, when a curve reaches it, and bootstrap intervals.

    Run (with_costs' seconds_steps) ─► accuracy_points: (RL seconds, held-out accuracy), the warm start at 0
        ─► mean_curve over a method's seeds ─► crossing_time of GRPO's final accuracy (final_accuracy)
        ─► compare_mean_curves: speed-up = GRPO's time / the method's, 95% bootstrap interval over seeds
        ─► compare_to_baseline: the same per seed (time_to_reach), median [min, max]

Definitions (bench/time_to_accuracy.py's docstring and the results page): final accuracy is the mean of the last
FINAL_WINDOW evaluations; a curve reaches a target where the trailing mean of FINAL_WINDOW evaluations does.
"""

import math
import random
import statistics

from megatron_dppo.metrics import Run, smoothed

FINAL_WINDOW = 3  # evaluations averaged for "final accuracy" and for reaching the target


def accuracy_points(run: Run, x_key: str) -> list[tuple[float, float]]:
    """(x, held-out accuracy): the warm start at 0, every logged evaluation, the final evaluation at the end."""
    xs, accuracies = run.series("heldout_accuracy", x_key)
    if not xs:
        raise ValueError(f"run {run.label!r} has no held-out accuracy: it needs summary.json or --eval-interval")
    return list(zip(xs, accuracies))


def final_accuracy(points: list[tuple[float, float]], window: int = FINAL_WINDOW) -> float:
    return statistics.fmean(accuracy for _, accuracy in points[-window:])


def time_to_reach(points: list[tuple[float, float]], target: float, window: int = FINAL_WINDOW) -> float | None:
    """First x at which the trailing mean of `window` evaluations reaches `target`; None if it never does."""
    for index, (x, _) in enumerate(points):
        recent = [accuracy for _, accuracy in points[max(0, index - window + 1):index + 1]]
        if statistics.fmean(recent) >= target - 1e-12:
            return x
    return None


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


def compare_mean_curves(curves: dict[str, dict[int, list]], baseline: str = "grpo", resamples: int = 2000,
                        seed: int = 0) -> dict[str, dict]:
    """The headline comparison, on each method's seed-mean curve: the target is the baseline's final accuracy
    (of its seed-mean curve); time to target is where a seed-mean curve's trailing mean crosses it
    (crossing_time); speed-up = baseline time / method time. The 95% interval resamples each method's seeds
    and the baseline's (with replacement, independently, target recomputed) `resamples` times. A baseline that
    never crosses counts its whole run; a method resample that never crosses counts its whole run too (an upper
    bound of its speed-up), and "crossed" says how often that did not happen."""
    if baseline not in curves or not curves[baseline]:
        raise ValueError(f"no {baseline} runs to compare against: include {baseline} in --methods")

    def times(base_points: list, method_points: list) -> tuple[float, float | None, float]:
        base_curve, method_curve = mean_curve(base_points), mean_curve(method_points)
        target = final_accuracy(base_curve)
        base_time = crossing_time(base_curve, target) or base_curve[-1][0]
        return base_time, crossing_time(method_curve, target), method_curve[-1][0]

    rng = random.Random(seed)
    base_points = list(curves[baseline].values())
    target = final_accuracy(mean_curve(base_points))
    results = {}
    for method, by_seed in curves.items():
        points = list(by_seed.values())
        base_time, method_time, _ = times(base_points, points)
        ratios, crossed = [], 0
        for _ in range(resamples):
            base_sample = [rng.choice(base_points) for _ in base_points]
            method_sample = [rng.choice(points) for _ in points]
            sample_base, sample_time, sample_end = times(base_sample, method_sample)
            crossed += sample_time is not None
            ratios.append(sample_base / max(sample_time if sample_time is not None else sample_end, 1e-9))
        ratios.sort()
        finals = [final_accuracy(p) for p in points]
        results[method] = {
            "target": target, "baseline_seconds": base_time, "seconds": method_time,
            "speedup": base_time / method_time if method_time else None,
            "interval": (ratios[int(0.025 * resamples)], ratios[min(int(0.975 * resamples), resamples - 1)]),
            "crossed": crossed / resamples, "final_mean": statistics.fmean(finals),
            "final_se": statistics.stdev(finals) / math.sqrt(len(finals)) if len(finals) > 1 else 0.0,
        }
    return results


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def compare_to_baseline(curves: dict[str, dict[int, list]], baseline: str = "grpo") -> dict[str, dict]:
    """Per method: final accuracy (mean, std over seeds), time to the baseline's final accuracy per seed, and the
    speed-up per seed (baseline time over method time) where both seeds exist. "baseline_times" holds the
    baseline's time per seed that every speed-up divides (its whole run where it never reaches the target)."""
    if baseline not in curves or not curves[baseline]:
        raise ValueError(f"no {baseline} runs to compare against: include {baseline} in --methods")
    target = statistics.fmean(final_accuracy(points) for points in curves[baseline].values())
    baseline_times = {}
    for seed, points in curves[baseline].items():
        reached = time_to_reach(points, target)
        baseline_times[seed] = reached if reached is not None else points[-1][0]
    results = {}
    for method, by_seed in curves.items():
        finals = [final_accuracy(points) for points in by_seed.values()]
        times = {seed: time_to_reach(points, target) for seed, points in by_seed.items()}
        speedups = [baseline_times[seed] / times[seed] for seed in sorted(times)
                    if times[seed] and seed in baseline_times]
        results[method] = {
            "target": target, "seeds": len(by_seed),
            "final_mean": statistics.fmean(finals), "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "times": times, "reached": sum(t is not None for t in times.values()),
            "speedup": median_spread(speedups) if speedups else None, "baseline_times": baseline_times,
        }
    return results


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

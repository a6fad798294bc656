"""The verdict's rule, fixed before the seeds that decide it ran: DPPO against each baseline on one primary axis.

    compare_paired results of DPPO against each baseline, on PRIMARY_AXIS, over n paired seeds
    ─► per baseline: the log speed-up's t statistic (jackknife standard error, n - 1 degrees of freedom)
    ─► Holm's correction across the baselines, first for a difference (faster / slower: the speed-up is not 1), then,
       for the baselines without one, for equivalence (two one-sided tests: the speed-up lies inside EQUIVALENCE)
    ─► one verdict per baseline: faster | slower | equivalent | undecided
    should_stop: at a look (LOOKS), every baseline's 95% interval is at most STOP_HALF_WIDTH wide on each side (log)

Invariants: the rule is scale-free (it reads logs: a speed-up of 2.37 is decided as readily as one of 1.0); a
baseline's verdict at family error ALPHA holds for all three at once (Holm, valid under any dependence: DPPO's seed-s
run is shared by the three comparisons); bench/estimator_check.py runs this very rule on simulated benches of known
speed-up and reports how often each verdict comes out.
"""

import math

from bench.accuracy_curves import t_cdf, t_quantile

# The primary axis: cost-model time (bench/run_costs.py's price list applied to each step's logged work). It prices
# what each method's steps do and takes out the shared machine's speed, which the load monitor shows varies from run
# to run (wall time carries it into every interval); wall time is still reported beside it.
PRIMARY_AXIS = "cost_model_seconds"
LOOKS = (6, 9, 12)  # paired seeds at which the rule is read; it stops at the first where should_stop holds, or 12
STOP_HALF_WIDTH = 0.22  # log units: a 95% interval within x/÷ 1.25 of its estimate (log 1.25 = 0.223)
ALPHA = 0.05  # family error over the baselines, for the difference and for equivalence
EQUIVALENCE = (0.8, 1.25)  # a speed-up inside this band is equivalent to none
VERDICTS = ("faster", "slower", "equivalent", "undecided")


def log_statistics(result: dict) -> tuple[float, float, int] | None:
    """(log estimate, its jackknife standard error, degrees of freedom) of a compare_paired result; None without an
    interval (fewer than 3 seeds, or a side that gained nothing)."""
    if not result or not result.get("estimate") or result.get("log_se") is None:
        return None
    return math.log(result["estimate"]["headline"]), result["log_se"], len(result["seeds"]) - 1


def interval(result: dict, confidence: float) -> tuple[float, float] | None:
    """The t interval of the speed-up at `confidence` (the log estimate ± t x its standard error)."""
    stats = log_statistics(result)
    if stats is None:
        return None
    centre, error, dof = stats
    half = t_quantile(0.5 + confidence / 2, dof) * error
    return math.exp(centre - half), math.exp(centre + half)


def half_width(result: dict) -> float:
    """The 95% interval's half-width in log units (inf without an interval)."""
    stats = log_statistics(result)
    return math.inf if stats is None else t_quantile(0.975, stats[2]) * stats[1]


def should_stop(results: dict[str, dict]) -> bool:
    """Every baseline's 95% interval within STOP_HALF_WIDTH of its estimate, in logs."""
    return all(half_width(result) <= STOP_HALF_WIDTH for result in results.values())


def difference_p(stats: tuple[float, float, int]) -> float:
    """Two-sided p-value of a speed-up of 1."""
    centre, error, dof = stats
    return 1.0 if error == 0 and centre == 0 else 2 * (1 - t_cdf(abs(centre) / max(error, 1e-300), dof))


def equivalence_p(stats: tuple[float, float, int]) -> float:
    """The larger of the two one-sided p-values against a speed-up at or outside EQUIVALENCE's bounds."""
    centre, error, dof = stats
    error = max(error, 1e-300)
    return max(1 - t_cdf((centre - math.log(EQUIVALENCE[0])) / error, dof),
               t_cdf((centre - math.log(EQUIVALENCE[1])) / error, dof))


def holm(p_values: dict[str, float], family: int, alpha: float = ALPHA) -> dict[str, float]:
    """Holm's step-down procedure over `family` hypotheses (p_values may hold fewer: the others count as not
    rejected): the rejected keys, each with the level it was tested at."""
    rejected = {}
    for rank, key in enumerate(sorted(p_values, key=p_values.get)):
        level = alpha / (family - rank)
        if p_values[key] > level:
            break
        rejected[key] = level
    return rejected


def verdicts(results: dict[str, dict]) -> dict[str, dict]:
    """baseline -> {"verdict", "seeds", "interval" (95%), "equivalence_interval" (the interval inside EQUIVALENCE
    at the level Holm tested it: 90% for the last of the family), "p"} for compare_paired results of DPPO against each
    baseline, on one axis."""
    stats = {key: log_statistics(result) for key, result in results.items()}
    known = {key: value for key, value in stats.items() if value is not None}
    different = holm({key: difference_p(value) for key, value in known.items()}, len(results))
    equivalent = holm({key: equivalence_p(value) for key, value in known.items() if key not in different},
                      len(results))
    out = {}
    for key, result in results.items():
        verdict, equivalence_interval = "undecided", None
        if key in different:
            verdict = "faster" if known[key][0] > 0 else "slower"
        elif key in equivalent:
            verdict, equivalence_interval = "equivalent", interval(result, 1 - 2 * equivalent[key])
        out[key] = {"verdict": verdict, "seeds": len(result["seeds"]) if result else 0,
                    "interval": interval(result, 0.95), "equivalence_interval": equivalence_interval}
    return out

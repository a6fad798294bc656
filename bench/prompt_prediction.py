"""How well a prompt's history predicts that its next group is zero-variance, and which history settings predict best.

    prompt_outcomes.jsonl of GRPO runs (metrics.OUTCOMES_FILE: every drawn prompt is rolled out, so no predictor chose
    which outcomes were seen)
    ─► replay every run's visits in order through the trainer's own PromptHistory(ema_decay, prior_strength): before
       a visit the predicted probability z that the group is zero-variance, after it the outcome
    ─► per setting: Brier score (against the base rate's), log-loss, and precision P(zero-variance | z ≥ 0.5) and
       recall P(z ≥ 0.5 | zero-variance), over all visits, the visits of prompts seen before, and first visits (where
       only the difficulty stratum's prior speaks)

`recorded_quality` reads the predictions a run recorded itself (a DPPO run's rolled-out groups are a weighted sample of
its drawn prompts: each counts 1 / keep probability, so the rates estimate those of every drawn prompt); the
time-to-accuracy page uses it for GRPO and DPPO.

    python bench/prompt_prediction.py runs/time_to_accuracy/runs/grpo/seed_*        # the default settings
    python bench/prompt_prediction.py RUN_DIRS --grid                                # decay x prior strength
Last line: `prediction_precision: P recall: R brier: B` (default settings, all visits after each prompt's first).
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dppo.algo.beta_binomial import all_equal_probability  # noqa: E402
from megatron_dppo.algo.history import PromptHistory  # noqa: E402
from megatron_dppo.metrics import OUTCOMES_FILE  # noqa: E402

DEFAULT_DECAY, DEFAULT_PRIOR = 0.5, 2.0  # --history-ema-decay, --history-prior-strength
GRID_DECAYS = (0.0, 0.3, 0.5, 0.7, 0.9)
GRID_PRIORS = (0.5, 1.0, 2.0, 4.0)
FLAG_THRESHOLD = 0.5  # a prompt is "flagged" as zero-variance when its predicted z reaches this


@dataclass
class Quality:
    visits: float  # (weighted) visits scored
    zero_variance_share: float
    brier: float
    base_brier: float  # the Brier score of always predicting the share
    log_loss: float
    precision: float  # P(zero-variance | flagged)
    recall: float  # P(flagged | zero-variance)


def read_outcomes(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / OUTCOMES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the run wrote no per-group outcomes (a run of an older "
                                "version, or one that took no step)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def quality(predictions: list[float], outcomes: list[bool], weights: list[float] | None = None) -> Quality:
    """Scores of predictions z against outcomes; `weights` (default 1) weigh each visit."""
    weights = [1.0] * len(predictions) if weights is None else weights
    total = sum(weights)
    if total == 0:
        return Quality(0.0, *[math.nan] * 6)
    share = sum(w for w, y in zip(weights, outcomes) if y) / total
    brier = sum(w * (z - y) ** 2 for w, z, y in zip(weights, predictions, outcomes)) / total
    clipped = [min(max(z, 1e-6), 1 - 1e-6) for z in predictions]
    log_loss = -sum(w * (math.log(z) if y else math.log(1 - z)) for w, z, y in zip(weights, clipped, outcomes)) / total
    flagged = sum(w for w, z in zip(weights, predictions) if z >= FLAG_THRESHOLD)
    hits = sum(w for w, z, y in zip(weights, predictions, outcomes) if y and z >= FLAG_THRESHOLD)
    zeros = share * total
    return Quality(total, share, brier, share * (1 - share), log_loss, hits / flagged if flagged else math.nan,
                   hits / zeros if zeros else math.nan)


def replayed_steps(records: list[dict], decay: float, prior: float, score: str = "zero_variance"):
    """A run's steps in order through a fresh PromptHistory(decay, prior): yields (visits, z, seen) per step, z [P]
    the history's predictions before the step (`score`: the zero-variance indicator's EMA, or the success-rate
    belief's P(all equal)) and seen [P] whether each prompt was visited before; the history then folds the step's
    outcomes."""
    history = PromptHistory(decay, prior)
    for step in sorted({r["step"] for r in records}):
        visits = [r for r in records if r["step"] == step]
        ids = [r["prompt_id"] for r in visits]
        difficulties = [r["difficulty"] for r in visits]
        if score == "success_rate":
            a, b = history.success_rate_posterior(ids, difficulties)
            z = torch.full_like(a, math.nan)
            known = ~torch.isnan(a)
            z[known] = all_equal_probability(a[known], b[known], len(visits[0]["rewards"]))
        else:
            z = history.zero_variance_probability(ids, difficulties)
        yield visits, z, [history.visits(prompt_id) > 0 for prompt_id in ids]
        history.update(ids, [0.0] * len(ids), [r["response_length_mean"] for r in visits],
                       rewards=[r["rewards"] for r in visits], difficulties=difficulties)


def replay(runs: list[list[dict]], decay: float, prior: float,
           score: str = "zero_variance") -> dict[str, tuple[list, list]]:
    """Per visit kind ("seen", "first"): (predictions, outcomes) of the history's predictor over every run."""
    kinds = {"seen": ([], []), "first": ([], [])}
    for records in runs:
        for visits, predicted, seen in replayed_steps(records, decay, prior, score):
            for record, z, before in zip(visits, predicted.tolist(), seen):
                if not math.isnan(z):
                    kind = kinds["seen" if before else "first"]
                    kind[0].append(z)
                    kind[1].append(bool(record["zero_variance"]))
    return kinds


@dataclass
class KeepRuleGain:
    variance_gain: float  # the step's gradient variance with uniform keep probabilities / with the rule's
    informative_share: float  # expected share of rolled-out groups whose rewards vary, under the rule
    base_share: float  # that share among all drawn groups (uniform keeping, GRPO)
    oracle_gain: float  # variance_gain of the rule fed the outcomes themselves (z = 0 or 1): what prediction could buy


def keep_rule_gain(runs: list[list[dict]], keep_fraction: float, p_min: float = 0.2, decay: float = DEFAULT_DECAY,
                   prior: float = DEFAULT_PRIOR, score: str = "zero_variance") -> KeepRuleGain:
    """DPPO's prompt level replayed on GRPO runs' steps (every drawn group rolled out): at each step the drawn prompts
    get the stochastic keep probabilities p_i = clip(c · sqrt(1 - z_i), p_min, 1) with mean `keep_fraction`, from
    the history's prediction z_i before the step. A group whose rewards vary carries gradient, so the 1/p-weighted
    estimate of the drawn batch's gradient has variance ∝ Σ_informative 1/p_i; uniform keeping (p = keep_fraction:
    the same expected rollouts) has Σ_informative 1/keep_fraction. Their ratio is what the history buys; the same
    rule fed the true outcomes gives the ceiling that a perfect predictor would reach."""
    from megatron_dppo.algo.pruning import proportional_keep_probs

    uniform = predicted = oracle = kept = informative_kept = informative = drawn = 0.0
    for records in runs:
        for visits, z, _ in replayed_steps(records, decay, prior, score):
            varied = torch.tensor([0.0 if r["zero_variance"] else 1.0 for r in visits], dtype=torch.float64)
            if torch.isnan(z).any():
                continue
            keep = proportional_keep_probs((1 - z).clamp(min=0).sqrt(), keep_fraction, p_min)
            perfect = proportional_keep_probs(varied, keep_fraction, p_min)
            uniform += float(varied.sum()) / keep_fraction
            predicted += float((varied / keep).sum())
            oracle += float((varied / perfect).sum())
            kept += float(keep.sum())
            informative_kept += float((keep * varied).sum())
            informative += float(varied.sum())
            drawn += len(visits)
    if not predicted:
        raise ValueError("no step with a prediction and a group with varied rewards: the runs are too short")
    return KeepRuleGain(uniform / predicted, informative_kept / kept, informative / drawn, uniform / oracle)


def success_rate_mixture(runs: list[list[dict]], grid_points: int = 41, iterations: int = 500
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution of the groups' true success rates, fitted to their pass counts: weights [grid_points] on
    success rates [grid_points] evenly spaced over [0, 1], the nonparametric maximum-likelihood binomial mixture (EM).
    Every visit of every run is one group; a prompt whose rate changes over the run counts at each rate it had."""
    counts = torch.tensor([sum(r["rewards"]) for records in runs for r in records], dtype=torch.float64)
    group_size = len(runs[0][0]["rewards"])
    rates = torch.linspace(0.0, 1.0, grid_points, dtype=torch.float64)
    binomial = torch.distributions.Binomial(group_size, probs=rates[None, :].clamp(1e-12, 1 - 1e-12))
    likelihood = binomial.log_prob(counts[:, None]).exp()  # [groups, grid]
    likelihood[:, 0] = (counts == 0).double()
    likelihood[:, -1] = (counts == group_size).double()
    weights = torch.full((grid_points,), 1.0 / grid_points, dtype=torch.float64)
    for _ in range(iterations):
        responsibility = likelihood * weights
        responsibility = responsibility / responsibility.sum(dim=1, keepdim=True).clamp(min=1e-300)
        weights = responsibility.mean(dim=0)
    return rates, weights


def success_rate_oracle_gain(runs: list[list[dict]], keep_fraction: float, p_min: float = 0.2,
                             samples: int = 200_000, seed: int = 0) -> float:
    """The keep rule's variance gain over uniform keeping for a predictor that knows each drawn prompt's true success
    rate p (the ceiling a history can approach: the outcome itself stays random): prompts drawn from the runs'
    fitted rates (success_rate_mixture), z = p^G + (1 - p)^G, p_i = clip(c sqrt(1 - z_i), p_min, 1) at mean
    `keep_fraction`, and the gain E[(1 - z)] / keep_fraction over E[(1 - z) / p], on the same footing as
    keep_rule_gain's (an informative group's share of the variance is its probability of being informative)."""
    from megatron_dppo.algo.pruning import proportional_keep_probs

    rates, weights = success_rate_mixture(runs)
    group_size = len(runs[0][0]["rewards"])
    generator = torch.Generator().manual_seed(seed)
    drawn = rates[torch.multinomial(weights, samples, replacement=True, generator=generator)]
    informative = 1.0 - drawn ** group_size - (1.0 - drawn) ** group_size
    keep = proportional_keep_probs(informative.clamp(min=0).sqrt(), keep_fraction, p_min)
    return float(informative.sum() / keep_fraction) / float((informative / keep).sum())


def recorded_quality(records: list[dict], after_step: int = 0) -> Quality:
    """Quality of the predictions a run recorded itself (visits after `after_step`), each visit weighted by
    1 / keep probability."""
    kept = [r for r in records if r["step"] > after_step and r.get("predicted_zero_variance") is not None]
    return quality([r["predicted_zero_variance"] for r in kept], [bool(r["zero_variance"]) for r in kept],
                   [1.0 / r["keep_prob"] for r in kept])


def row(name: str, result: Quality) -> str:
    return (f"| {name} | {result.visits:.0f} | {result.zero_variance_share:.2f} | {result.brier:.3f} "
            f"({result.base_brier:.3f}) | {result.log_loss:.3f} | {result.precision:.2f} | {result.recall:.2f} |")


HEADER = ("| predictor | visits | zero-variance share | Brier (base rate's) | log-loss | precision | recall |\n"
          "|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories holding prompt_outcomes.jsonl")
    parser.add_argument("--grid", action="store_true", help="every --history-ema-decay x --history-prior-strength")
    options = parser.parse_args()
    runs = [read_outcomes(run) for run in options.runs]
    settings = [(d, p) for d in GRID_DECAYS for p in GRID_PRIORS] if options.grid else [(DEFAULT_DECAY, DEFAULT_PRIOR)]
    print(HEADER)
    results = {}
    for decay, prior in settings:
        kinds = replay(runs, decay, prior)
        results[(decay, prior)] = quality(*kinds["seen"])
        print(row(f"decay {decay}, prior {prior}: seen prompts", results[(decay, prior)]))
        print(row(f"decay {decay}, prior {prior}: first visits (stratum prior)", quality(*kinds["first"])))
    chosen = results[(DEFAULT_DECAY, DEFAULT_PRIOR)] if (DEFAULT_DECAY, DEFAULT_PRIOR) in results else min(
        results.values(), key=lambda q: q.brier)
    print(f"prediction_precision: {chosen.precision:.2f} recall: {chosen.recall:.2f} brier: {chosen.brier:.3f}")


if __name__ == "__main__":
    main()

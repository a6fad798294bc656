"""What a run cost: the model's size, FLOPs per step, cumulative cost columns, where a step's time goes, and the
step-cost model (a price list of the logged work) that gives cost-model time; the runs of every method loaded with
those columns (load_groups).

    <runs>/<method>/seed_<n> ─► load_run ─► with_costs: + seconds_steps (RL time without evaluations),
        tokens_generated_total, tokens_trained_total, flops_total ─► with_engine_work: engine batches (logged, or
        derived for older records) ─► value_at / steps_at a time to target
    every step of every run ─► phase_breakdown (mean per phase)
                           ─► fit_step_cost: non-negative least squares of the step time on its PRICED_WORK
                              ─► price_list ─► with_cost_model: + cost_model_seconds (the prices applied to a run)

Invariants: every price is >= 0 (a price list, not a regression's signs); a step whose work was estimated rather
than logged is priced but never fitted; the fit's standard errors treat a run, not a step, as the independent unit.
"""

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.training_run import MACHINE_FILE, finished
from megatron_dppo.metrics import OUTCOMES_FILE, Run, load_run
from megatron_dppo.servers.embedded.scheduler import MAX_BATCH_SIZE

PHASES = ("seconds_rollout", "seconds_reward", "seconds_logprobs", "seconds_update", "seconds_sync")


@dataclass
class ModelSize:
    parameters: int
    layers: int
    hidden: int


def model_size(model_dir: Path) -> ModelSize:
    """Parameter count (tied embedding once), layers and hidden size of an HF model directory."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    parameters = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                parameters += math.prod(tensors.get_slice(name).get_shape())
    if parameters == 0:
        raise RuntimeError(f"no safetensors weights in {model_dir}: the model directory is incomplete")
    return ModelSize(parameters, config["num_hidden_layers"], config["hidden_size"])


def step_flops(record: dict, size: ModelSize, old_logprob_pass: bool) -> tuple[float, float]:
    """(training, rollout) FLOPs of one step from its logged token counts (the formula: bench/time_to_accuracy.py's
    docstring)."""
    trained = float(record.get("tokens_trained", 0))
    generated = float(record.get("tokens_generated", 0))
    # kept_fraction counts kept samples over drawn prompts x G; rollouts are the prompt level's survivors x G
    rollouts = generated / max(record.get("response_length_mean", 0.0), 1e-9)
    kept_sequences = record.get("kept_fraction", 0.0) / max(record.get("kept_fraction_prompts", 1.0), 1e-9) * rollouts
    context = trained / kept_sequences if kept_sequences > 0 else 0.0
    forward_per_token = 2 * size.parameters + 4 * size.layers * size.hidden * context / 2
    passes = 3 + (1 if old_logprob_pass else 0)  # forward + backward (2x forward) [+ old-log-prob forward]
    rollout_context = record.get("response_length_mean", 0.0) / 2
    return (trained * forward_per_token * passes,
            generated * (2 * size.parameters + 4 * size.layers * size.hidden * rollout_context))


def with_costs(run: Run, size: ModelSize | None, old_logprob_pass: bool) -> Run:
    """The run with cumulative cost columns added to every record: seconds_steps (RL wall time without
    evaluations), tokens_generated_total, tokens_trained_total, flops_total (training + rollout; 0 without a
    model size)."""
    totals = {"seconds_steps": 0.0, "tokens_generated_total": 0.0, "tokens_trained_total": 0.0, "flops_total": 0.0}
    records = []
    for record in run.records:
        train, rollout = step_flops(record, size, old_logprob_pass) if size is not None else (0.0, 0.0)
        totals["seconds_steps"] += float(record.get("seconds_step", 0.0))
        totals["tokens_generated_total"] += float(record.get("tokens_generated", 0))
        totals["tokens_trained_total"] += float(record.get("tokens_trained", 0))
        totals["flops_total"] += train + rollout
        records.append({**record, **totals})
    return Run(run.label, records, run.summary)


def value_at(run: Run, key: str, x_key: str, x: float | None) -> float | None:
    """The cumulative `key` at the first record whose `x_key` reaches x (x = 0: nothing spent yet)."""
    if x is None:
        return None
    if x <= 0:
        return 0.0
    for record in run.records:
        if record[x_key] >= x - 1e-12:
            return float(record[key])
    return float(run.records[-1][key])


def load_groups(root: Path, seeds_by_method: dict[str, list[int]], size: ModelSize | None,
                samples_per_prompt: int) -> dict[str, dict[int, Run]]:
    """Each method's finished runs under root (<method>/seed_<n>) with their cost columns and engine work
    (with_engine_work), and their machine.json as summary["machine"]: method -> seed -> run; a method with no finished
    run is left out."""
    groups = {}
    for method, seeds in seeds_by_method.items():
        by_seed = {}
        for seed in seeds:
            run_dir = root / method / f"seed_{seed}"
            if finished(run_dir):
                old_pass = method == "d3s"  # the trainer's only old-log-prob pass with one on-policy epoch
                outcomes = run_dir / OUTCOMES_FILE
                run = with_engine_work(with_costs(load_run(run_dir, method), size, old_pass), [
                    json.loads(line) for line in outcomes.read_text().splitlines() if line.strip()]
                    if outcomes.is_file() else [], samples_per_prompt)
                if (run_dir / MACHINE_FILE).is_file():  # what else the machine did meanwhile (training_run.launch)
                    run.summary = {**(run.summary or {}), "machine": json.loads((run_dir / MACHINE_FILE).read_text())}
                by_seed[seed] = run
        if by_seed:
            groups[method] = by_seed
    return groups


def phase_breakdown(runs: list[Run]) -> dict[str, float]:
    """Mean seconds per step of each phase over every step of the runs, the rest as 'other', and rates."""
    records = [r for run in runs for r in run.records]
    if not records:
        raise ValueError("no step records to break down")
    mean = {phase: statistics.fmean(float(r.get(phase, 0.0)) for r in records) for phase in PHASES}
    step = statistics.fmean(float(r.get("seconds_step", 0.0)) for r in records)
    mean["other"] = step - sum(mean.values())
    mean["seconds_step"] = step
    for key in ("kept_fraction", "packing_density", "reward_mean", "tokens_generated", "tokens_trained"):
        mean[key] = statistics.fmean(float(r.get(key, 0.0)) for r in records)
    return mean


# The step-cost model's price list: what one unit of each kind of logged work costs (seconds), fitted over every step
# of every run. A step pays its fixed part once, each decode iteration (one position of the engine's loop: its batches
# run one after another, each as long as its own longest response, so a second batch adds its own loop), and each
# generated and trained token. A batch's own cost (prefill, request) has no price of its own: only DAPO's rounds run
# several batches in these runs, each with its own loop, so it cannot be told apart from the iterations (the earlier
# per-round term read -131 ms); DAPO's rounds pay through their iterations and tokens.
PRICED_WORK = {"fixed": "a step", "decode_iterations": "a decode iteration",
               "tokens_generated": "a generated token", "tokens_trained": "a trained token"}


def with_engine_work(run: Run, outcomes: list[dict], samples_per_prompt: int) -> Run:
    """The run with every step's engine batches, logged (pipeline/experience.py roll_out) or, for runs recorded
    before they were logged, derived: each rollout round's groups_rolled_out x G rows, MAX_BATCH_SIZE at a time.
    Such a run logged the longest response's decode iterations over a round, not the sum over its batches: where a
    round overflowed one batch, the later batch's loop is estimated from `outcomes` (prompt_outcomes.jsonl) as the
    longest mean response length of its groups over the run's own ratio of that to the logged iterations on its
    one-batch steps, and the step is marked "work_estimated" (priced, but left out of the fit)."""
    if all("engine_batches" in record for record in run.records):
        return run
    per_batch = MAX_BATCH_SIZE // samples_per_prompt  # groups of one batch
    lengths: dict[int, list[float]] = {}
    for outcome in outcomes:
        lengths.setdefault(outcome["step"], []).append(outcome["response_length_mean"])
    records, ratios = [], []
    for record in run.records:
        rounds = work(record, "dapo_rounds")
        groups = float(record.get("groups_rolled_out", 0.0))
        batches = rounds * max(math.ceil(groups / rounds / per_batch - 1e-9), 1)
        record = {**record, "engine_batches": batches}
        means = lengths.get(int(record["step"]), [])
        if record.get("partial_chunks"):  # partial rollouts: chunks of their own, their iterations logged as run
            pass
        elif batches > rounds and len(means) > per_batch:  # one round (DAPO's rounds are one batch each)
            record["later_batch_length"] = max(means[per_batch:])
        elif means and record.get("decode_iterations"):
            ratios.append(max(means) / record["decode_iterations"])
        records.append(record)
    ratio = statistics.median(ratios) if ratios else 1.0
    for record in records:
        if "later_batch_length" in record:
            record["decode_iterations"] += min(record.pop("later_batch_length") / ratio, record["decode_iterations"])
            record["work_estimated"] = True
    return Run(run.label, records, run.summary)


def work(record: dict, term: str) -> float:
    """One step's amount of a priced kind of work (a step without DAPO's dynamic sampling is one rollout round,
    one engine batch where it did not log its batches)."""
    if term == "fixed":
        return 1.0
    return float(record.get(term, 1.0 if term in ("dapo_rounds", "engine_batches") else 0.0))


def nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin |design x - target| over x >= 0: the least-squares fit on every subset of the columns, the best one
    whose coefficients are all non-negative (the optimum's positive coefficients are the unconstrained fit on their
    columns; 2^columns fits, for the handful of priced kinds of work)."""
    best, columns = None, design.shape[1]
    for mask in range(1, 2 ** columns):
        chosen = [column for column in range(columns) if mask >> column & 1]
        solution = np.linalg.lstsq(design[:, chosen], target, rcond=None)[0]
        if (solution < 0).any():
            continue
        residual = float(((design[:, chosen] @ solution - target) ** 2).sum())
        if best is None or residual < best[0]:
            best = (residual, chosen, solution)
    coefficients = np.zeros(columns)
    coefficients[best[1]] = best[2]
    return coefficients


def fit_step_cost(runs: list[Run]) -> dict:
    """The price list: non-negative least squares of seconds_step on the PRICED_WORK of every step whose work was
    logged (not work_estimated), so that every price reads as what one more unit of that work costs; a kind of work
    that never varies is left out (priced 0; the fixed part takes it). Returns "prices" (term -> seconds),
    "standard_errors" (term -> jackknife over runs: each run's steps share its machine's speed, so the run, not the
    step, is the independent unit), "r_squared", "steps" and "steps_estimated", and the flat keys fixed, per_batch,
    per_iteration, per_generated, per_trained (seconds per unit)."""
    fitted = [[r for r in run.records if not r.get("work_estimated")] for run in runs]
    records = [r for run_records in fitted for r in run_records]
    terms = ["fixed", *(term for term in list(PRICED_WORK)[1:] if len({work(r, term) for r in records}) > 1)]
    if len(records) < 1 + len(terms):
        raise ValueError(f"{len(records)} step records cannot fit a {len(terms)}-term cost model: run longer or "
                         "more runs")

    def fit(subset: list[dict]) -> np.ndarray:
        design = np.array([[work(r, term) for term in terms] for r in subset])
        return nonnegative_least_squares(design, np.array([float(r.get("seconds_step", 0.0)) for r in subset]))

    coefficients = fit(records)
    target = np.array([float(r.get("seconds_step", 0.0)) for r in records])
    predicted = np.array([[work(r, term) for term in terms] for r in records]) @ coefficients
    total = float(((target - target.mean()) ** 2).sum())
    errors = dict.fromkeys(PRICED_WORK, 0.0)
    if len(fitted) >= 3:  # leave one run out
        left_out = np.array([fit([r for j, rs in enumerate(fitted) if j != i for r in rs]) for i in range(len(fitted))])
        spread = np.sqrt((len(fitted) - 1) / len(fitted) * ((left_out - left_out.mean(axis=0)) ** 2).sum(axis=0))
        errors.update(zip(terms, spread.tolist()))
    prices = {**dict.fromkeys(PRICED_WORK, 0.0), **dict(zip(terms, coefficients.tolist()))}
    return {"prices": prices, "standard_errors": errors, "steps": len(records),
            "steps_estimated": sum(len(run.records) for run in runs) - len(records),
            "r_squared": 1 - float(((target - predicted) ** 2).sum()) / total if total > 0 else 0.0,
            "fixed": prices["fixed"],
            "per_iteration": prices["decode_iterations"], "per_generated": prices["tokens_generated"],
            "per_trained": prices["tokens_trained"]}


def price_list(cost: dict) -> str:
    """The fit as a price list: each kind of work's price ± its jackknife standard error."""
    def price(term: str) -> str:
        value, error = cost["prices"][term], cost["standard_errors"][term]
        scale, unit = (1e6, "µs") if term.startswith("tokens") else (1e3, "ms")
        return f"{PRICED_WORK[term]} {scale * value:.3g} ± {scale * error:.2g} {unit}"

    return (f"{'; '.join(price(term) for term in PRICED_WORK)} (R² {cost['r_squared']:.2f} over {cost['steps']} steps"
            + (f"; {cost['steps_estimated']} steps with estimated work priced, not fitted" if cost["steps_estimated"]
               else "") + ")")


def predicted_step_seconds(record: dict, cost: dict) -> float:
    """The price list applied to one step's logged work: its time on a machine of the fit's average speed."""
    return sum(price * work(record, term) for term, price in cost["prices"].items())


def with_cost_model(run: Run, cost: dict) -> Run:
    """The run with cost_model_seconds added to every record: the cumulative predicted_step_seconds of its steps,
    RL time with the shared machine's speed taken out (every method's steps priced by one fit)."""
    total, records = 0.0, []
    for record in run.records:
        total += predicted_step_seconds(record, cost)
        records.append({**record, "cost_model_seconds": total})
    return Run(run.label, records, run.summary)


def with_projected_cost(run: Run, share: float, reference: tuple[float, float]) -> Run:
    """The run with projected_<share> added: the cumulative cost of its steps on a token-bound machine where a step
    of `reference`'s mean (generated, trained) tokens costs 1, `share` of it generation (generated tokens) and the
    rest log-probs and update (trained tokens)."""
    total, records = 0.0, []
    for record in run.records:
        total += (share * float(record.get("tokens_generated", 0)) / reference[0]
                  + (1 - share) * float(record.get("tokens_trained", 0)) / reference[1])
        records.append({**record, f"projected_{share}": total})
    return Run(run.label, records, run.summary)

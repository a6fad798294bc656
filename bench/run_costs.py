"""What a run cost: the model's size, FLOPs per step, cumulative cost columns, where a step's time goes, and the
step-cost fit; the runs of every method loaded with those columns (load_groups).

    <runs>/<method>/seed_<n> ─► load_run ─► with_costs: + seconds_steps (RL time without evaluations),
        tokens_generated_total, tokens_trained_total, flops_total ─► value_at / steps_at a time to target
    every step of every run ─► phase_breakdown (mean per phase) and fit_step_cost (least squares of the step time)
"""

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.training_run import MACHINE_FILE, finished
from megatron_dppo.metrics import Run, load_run

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


def load_groups(root: Path, seeds_by_method: dict[str, list[int]], size: ModelSize) -> dict[str, dict[int, Run]]:
    """Each method's finished runs under root (<method>/seed_<n>) with their cost columns: method -> seed -> run;
    a method with no finished run is left out."""
    groups = {}
    for method, seeds in seeds_by_method.items():
        by_seed = {}
        for seed in seeds:
            run_dir = root / method / f"seed_{seed}"
            if finished(run_dir):
                old_pass = method == "d3s"  # the trainer's only old-log-prob pass with one on-policy epoch
                run = with_costs(load_run(run_dir, method), size, old_pass)
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


def steps_at(run: Run, seconds: float) -> float:
    """Steps taken by the first record whose RL time reaches `seconds` (0 at 0 s)."""
    return value_at(run, "step", "seconds_steps", seconds)


def speedup_decomposition(runs: dict[str, dict[int, Run]], times: dict[str, float | None],
                          baseline: str) -> dict[str, dict]:
    """Per method of `times` (method -> seed-mean RL seconds to one target, None where never reached; the baseline's
    among them), its speed-up split into fewer steps x shorter steps: step_ratio = the baseline's mean steps to its
    time / the method's mean steps to its time, step_time_ratio = baseline s/step / method s/step over those spans;
    their product is the speed-up."""
    out = {}
    base_time = times[baseline]
    base_steps = statistics.fmean(steps_at(run, base_time) for run in runs[baseline].values())
    for method, reached in times.items():
        if not reached:
            out[method] = {"steps": None, "step_ratio": None, "step_time_ratio": None}
            continue
        steps = statistics.fmean(steps_at(run, reached) for run in runs[method].values())
        out[method] = {"steps": steps, "step_ratio": base_steps / steps,
                       "step_time_ratio": (base_time / base_steps) / (reached / steps)}
    return out


def fit_step_cost(runs: list[Run]) -> dict[str, float]:
    """Least squares over every step: seconds_step ≈ fixed + per_round · rollout rounds + per_iteration ·
    decode_iterations + per_generated · tokens_generated + per_trained · tokens_trained (decode_iterations: the
    engine's decode loop iterations, as many as the step's longest response, or the chunks' under partial rollouts,
    summed over DAPO's dynamic-sampling rounds; a term is left out where a run does not log it or it never varies).
    Returns the coefficients (seconds, seconds per round, iteration or token) and the fit's R²."""
    import torch

    records = [r for run in runs for r in run.records]
    iterations = all("decode_iterations" in r for r in records)
    rounds = len({float(r.get("dapo_rounds", 1.0)) for r in records}) > 1
    terms = (("dapo_rounds",) * rounds + ("decode_iterations",) * iterations
             + ("tokens_generated", "tokens_trained"))
    if len(records) < 1 + len(terms):
        raise ValueError(f"{len(records)} step records cannot fit a {1 + len(terms)}-term cost model: run longer or "
                         "more runs")
    design = torch.tensor([[1.0] + [work(r, term) for term in terms] for r in records], dtype=torch.float64)
    target = torch.tensor([float(r.get("seconds_step", 0.0)) for r in records], dtype=torch.float64)
    coefficients = torch.linalg.lstsq(design, target.unsqueeze(1)).solution.squeeze(1)
    residual = target - design @ coefficients
    total = ((target - target.mean()) ** 2).sum()
    r_squared = float(1 - (residual ** 2).sum() / total) if total > 0 else 0.0
    fixed, *values = coefficients.tolist()
    per_term = dict(zip(terms, values))
    return {"fixed": fixed, "per_round": per_term.get("dapo_rounds", 0.0),
            "per_iteration": per_term.get("decode_iterations", 0.0),
            "per_generated": per_term["tokens_generated"], "per_trained": per_term["tokens_trained"],
            "r_squared": r_squared}


def work(record: dict, term: str) -> float:
    """One step's amount of a cost term (a step without DAPO's dynamic sampling is one rollout round)."""
    return float(record.get(term, 1.0 if term == "dapo_rounds" else 0.0))


def predicted_step_seconds(record: dict, cost: dict) -> float:
    """The step-cost fit applied to one step's logged work: its time on a machine of the fit's average speed."""
    return (cost["fixed"] + cost["per_round"] * work(record, "dapo_rounds")
            + cost["per_iteration"] * work(record, "decode_iterations")
            + cost["per_generated"] * work(record, "tokens_generated")
            + cost["per_trained"] * work(record, "tokens_trained"))


def with_cost_model(run: Run, cost: dict) -> Run:
    """The run with cost_model_seconds added to every record: the cumulative predicted_step_seconds of its steps,
    RL time with the shared machine's speed taken out (every method's steps priced by one fit)."""
    total, records = 0.0, []
    for record in run.records:
        total += predicted_step_seconds(record, cost)
        records.append({**record, "cost_model_seconds": total})
    return Run(run.label, records, run.summary)


def token_dependent_seconds(cost: dict, phases: dict) -> float:
    """The part of a mean step (phase_breakdown) that scales with tokens, by the fit."""
    return cost["per_generated"] * phases["tokens_generated"] + cost["per_trained"] * phases["tokens_trained"]

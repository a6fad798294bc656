"""What a step's responses looked like, for the people running it: how many the length limit cut, what else a custom
reward said, and one record per response for --save-debug-rollout-data and the W&B table (metrics.py writes both).

    Rollouts.finish_reasons, .reward_extras ─► response_statistics ─► response_clip_ratio (the share of responses
        that ended at the length limit, finish reason "length": a thinking model cut before its answer scores 0),
        reward_extra/<key> (the mean of each numeric key a custom reward's dicts returned)
    Rollouts + Selection ─► rollout_samples ─► one dict per rolled-out response, in (prompt, sample) order

Invariants: every rolled-out response has one record, trained or not (weight 0: the DAPO filter or the completion
level dropped it); the response text is decoded as the reward read it (special tokens kept); a record is strict JSON
(a custom reward's NaN is null).
"""

import math
import numbers


def response_statistics(finish_reasons: list[str], reward_extras: list[dict]) -> dict:
    """response_clip_ratio over the step's responses, and reward_extra/<key> for each numeric key of the rewards'
    extras (averaged over the responses that have it; booleans as 0/1, so the mean is a share)."""
    stats = {"response_clip_ratio": (sum(reason == "length" for reason in finish_reasons) / len(finish_reasons)
                                     if finish_reasons else 0.0)}
    values: dict[str, list[float]] = {}
    for extras in reward_extras:
        for key, value in extras.items():
            if isinstance(value, numbers.Real) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    stats.update({f"reward_extra/{key}": sum(found) / len(found) for key, found in values.items()})
    return stats


def rollout_samples(rollouts, selection, tokenizer) -> list[dict]:
    """One record per rolled-out response (experience.Rollouts, experience.Selection): its prompt (id, text, row,
    reference), response (text, token ids, length, how it ended), reward (and a custom reward's other keys),
    advantage, the prompt level's keep probability and the weight it trains with (0: not trained)."""
    decision = rollouts.prompt_decision
    keep_probs = decision.keep_probs[decision.kept].tolist()
    group = rollouts.rewards.shape[1] if rollouts.rewards.dim() == 2 else 1
    trained = {(row, column): weight for row, column, weight in zip(selection.rows.tolist(),
                                                                    selection.columns.tolist(),
                                                                    selection.weights.tolist())}
    samples = []
    for index, output_ids in enumerate(rollouts.output_ids):
        row, column = divmod(index, group)
        prompt = rollouts.prompts[row]
        samples.append({
            "prompt_id": prompt.prompt_id, "prompt_index": row, "sample_index": column, "row": prompt.location,
            "prompt": prompt.text, "label": str(prompt.reference), "response": tokenizer.decode(output_ids),
            "response_ids": list(output_ids), "response_length": len(output_ids),
            "finish_reason": rollouts.finish_reasons[index] if rollouts.finish_reasons else None,
            "reward": float(rollouts.rewards[row, column]),
            "reward_extras": json_safe(rollouts.reward_extras[index]) if rollouts.reward_extras else {},
            "advantage": float(selection.advantages[row, column]), "prompt_keep_prob": float(keep_probs[row]),
            "weight": float(trained.get((row, column), 0.0)),
        })
    return samples


def json_safe(value):
    """`value` as strict JSON holds it: a non-finite number as None, a tuple as a list, anything else JSON has no
    type for (a custom reward may return any object beside its score) as its str."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return str(value)

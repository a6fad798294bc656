"""A reward written as verl writes one, for --custom-reward-function (training) and tools/evaluate.py:

    torchrun --nproc-per-node 8 examples/pretrain_dppo.py ... --prompt-data math --apply-chat-template \\
        --custom-reward-function examples/verl_style_reward.py:compute_score
    python tools/evaluate.py ... --custom-reward-function examples/verl_style_reward.py:compute_score

The trainer recognises verl's signature by its parameters and calls it by keyword, as verl's reward manager does:
solution_str is the decoded response, ground_truth the row's label, data_source the row's "data_source" field (or the
source the row came from: --prompt-data's name or file), extra_info the row's "extra_info" field (or the whole row).
It returns a dict with "score" (the reward trained on); the trainer logs the mean of every other numeric key per
step as reward_extra/<key> ("acc" and "boxed" here), tools/evaluate.py votes maj@k with "pred". A call that raises
stops the run, naming this function and the row (--custom-reward-max-failures tolerates a few).

This one checks the last \\boxed{...} of the response against the reference by exact string match after light
normalisation: a starting point to copy, stricter than the built-in math reward (--reward-type math, math-verify).
"""


def last_boxed(text: str) -> str | None:
    """The content of the last complete \\boxed{...} of `text` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, position = 0, start + len("\\boxed{")
    for index in range(position, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[position:index]
            depth -= 1
    return None


def normalise(answer: str) -> str:
    """Spaces and the common spelling variants of an answer removed (\\dfrac and \\frac, \\left( and (, a final dot)."""
    for variant, canonical in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""),
                               ("\\!", ""), ("$", "")):
        answer = answer.replace(variant, canonical)
    return "".join(answer.split()).rstrip(".")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    predicted = last_boxed(solution_str)
    correct = predicted is not None and normalise(predicted) == normalise(str(ground_truth))
    return {"score": 1.0 if correct else 0.0, "acc": correct, "boxed": predicted is not None,
            "pred": "" if predicted is None else predicted}

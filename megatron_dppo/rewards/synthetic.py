"""Reward of the synthetic arithmetic task: exact integer match, in exactly the trained shape.

    response "33$" ──► fullmatch "<decimal integer>$" ──► int(...) == reference ──► 1 / 0

A response scores 1 only when it is a decimal integer (optional minus sign, digits; leading zeros allowed)
immediately followed by the end marker `$` and nothing after it. Anything else scores 0: no end marker (the
sample ran out of tokens), trailing junk after the marker, spaces, or a wrong number. The response must be
decoded with special tokens kept, since `$` is the char tokenizer's eos token.
"""

import re

from megatron_dppo.data.synthetic import END_MARKER

_ANSWER_SHAPE = re.compile(r"(-?\d+)" + re.escape(END_MARKER))


def compute_score(response: str, reference: int | str) -> float:
    """1.0 when `response` is exactly '<reference>$' as an integer, else 0.0."""
    try:
        expected = int(reference)
    except (TypeError, ValueError) as error:
        raise ValueError(f"synthetic reference {reference!r} is not an integer; pass Problem.answer") from error
    match = _ANSWER_SHAPE.fullmatch(response)
    return 1.0 if match is not None and int(match.group(1)) == expected else 0.0

"""Rewards of the synthetic arithmetic tasks: the final answer only, in exactly the trained shape.

    worked: "37+58=95,95-12=83#83$" ──► fullmatch "<work without # or $>#<decimal integer>$" ──► int == reference
    answer: "83$"                   ──► fullmatch "<decimal integer>$"                         ──► int == reference

Like a math reward, the worked task's reward reads the final answer (the number after the one `#`) and never grades
the work before it: a correct final answer scores 1 even when an intermediate result is wrong or the work is
missing, and a wrong final answer scores 0 even after correct work. Format errors score 0: no `#`, more than one
`#` (which answer would be final?), anything but an integer between `#` and `$` (spaces included), no end marker
(the sample ran out of tokens) or anything after it. The answer-only task accepts the integer and `$` alone.
Integers may carry a minus sign and leading zeros. Responses must be decoded with special tokens kept, since `$`
is the char tokenizer's eos token.
"""

import re

from megatron_dppo.answers import ANSWER_MARKER, END_MARKER

_NOT_MARKERS = "[^" + re.escape(ANSWER_MARKER + END_MARKER) + "]*"
_INTEGER = r"(-?\d+)"
_WORKED_SHAPE = re.compile(_NOT_MARKERS + re.escape(ANSWER_MARKER) + _INTEGER + re.escape(END_MARKER))
_ANSWER_SHAPE = re.compile(_INTEGER + re.escape(END_MARKER))


def _final_answer_score(shape: re.Pattern, response: str, reference: int | str) -> float:
    try:
        expected = int(reference)
    except (TypeError, ValueError) as error:
        raise ValueError(f"synthetic reference {reference!r} is not an integer; pass Problem.answer") from error
    match = shape.fullmatch(response)
    return 1.0 if match is not None and int(match.group(1)) == expected else 0.0


def compute_score(response: str, reference: int | str) -> float:
    """Worked task: 1.0 when `response` is '<work>#<reference>$' (the work unchecked), else 0.0."""
    return _final_answer_score(_WORKED_SHAPE, response, reference)


def compute_answer_only_score(response: str, reference: int | str) -> float:
    """Answer-only task: 1.0 when `response` is exactly '<reference>$' as an integer, else 0.0."""
    return _final_answer_score(_ANSWER_SHAPE, response, reference)

"""GSM8K reward: the response's final number must equal the reference number.

    response ──► extract_final_answer (same order as the math reward: box, "the answer is", ####, last number)
             ──► last number in it ($, commas, units and \\text{} ignored) ──► exact rational comparison

GSM8K answers are plain numbers, so no symbolic check is needed and no process pool: the comparison is exact
(`Fraction`), so 18, 18.0, 18.00 and \\$18 all match 18, and 18.5 does not.
"""

import re
from fractions import Fraction

from megatron_dppo.rewards.math import extract_final_answer

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRACTION = re.compile(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}")


def reference_number(reference: str) -> Fraction:
    """The reference as a number: either a bare number or a full GSM8K answer ending in '#### N'."""
    text = reference.rsplit("####", 1)[1] if "####" in reference else reference
    number = parse_number(text)
    if number is None:
        raise ValueError(f"GSM8K reference {reference!r} holds no number; pass the number or the '#### N' answer text")
    return number


def parse_number(text: str) -> Fraction | None:
    """The last number in `text`, as an exact fraction; thousands separators and LaTeX fractions understood.

    The last, because an answer sentence often shows its working: "15 gallons * 8 = 120 pints".
    """
    cleaned = _FRACTION.sub(r"\1/\2", text.replace(",", ""))
    numbers = _NUMBER.findall(cleaned)
    if not numbers:
        return None
    numerator, _, denominator = numbers[-1].partition("/")
    if denominator and int(denominator) == 0:
        return None
    return Fraction(numerator) / Fraction(denominator or 1)


def final_number(response: str) -> Fraction | None:
    """The number the response gives as its final answer, or None."""
    answer, _ = extract_final_answer(response)
    return parse_number(answer) if answer is not None else None


def compute_score(response: str, reference: str) -> float:
    """1.0 when the response's final answer is the reference number, else 0.0."""
    expected = reference_number(reference)
    return 1.0 if final_number(response) == expected else 0.0

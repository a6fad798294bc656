"""GSM8K reward: the response's final number must equal the reference number.

    response ──► extract_final_answer (same order as the math reward: box, "the answer is", ####, last number)
             ──► last number in it ($, commas, units and \\text{} ignored) ──► exact rational comparison

GSM8K answers are plain numbers, so no symbolic check is needed and no process pool: the comparison is exact
(`Fraction`), so 18, 18.0, 18.00 and \\$18 all match 18, and 18.5 does not.
"""

from fractions import Fraction

from megatron_dppo.answers import extract_final_answer, parse_number, reference_number


def final_number(response: str) -> Fraction | None:
    """The number the response gives as its final answer, or None."""
    answer, _ = extract_final_answer(response)
    return parse_number(answer) if answer is not None else None


def compute_score(response: str, reference: str) -> float:
    """1.0 when the response's final answer is the reference number, else 0.0."""
    expected = reference_number(reference)
    return 1.0 if final_number(response) == expected else 0.0

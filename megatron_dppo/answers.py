"""How a task's final answer is written and read: the one leaf that the data loaders and the rewards both use.

    synthetic task:  "<work>#<answer>$"      ANSWER_MARKER, END_MARKER (STEP_SEPARATOR between worked steps)
    MATH:            solution "... \\boxed{<answer>}"   find_last_boxed; a response's answer: extract_final_answer
                     (last box, "the answer is", ####, last number, in that order)
    GSM8K:           "... #### <number>"      reference_number, parse_number (exact fractions)

Nothing here imports another module of the package, so data/ (which reads references when it loads rows) and
rewards/ (which reads answers from responses) depend on it and not on each other.
"""

import re
from fractions import Fraction

END_MARKER = "$"
ANSWER_MARKER = "#"  # the worked task's final answer follows it (the role of \\boxed{} in a math solution)
STEP_SEPARATOR = ","

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?", re.IGNORECASE)
_HASH_MARK = "####"
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_INLINE_MATH = re.compile(r"(?<!\\)\$((?:\\\$|[^$])+?)(?<!\\)\$")  # $...$, where \$ is a dollar sign


def find_last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} or \\fbox{...} (also the brace-less `\\boxed 5` form)."""
    position = len(text)
    while True:
        start = max(text.rfind(command, 0, position) for command in _BOX_COMMANDS)
        if start < 0:
            return None
        command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
        content = _read_box_argument(text, start + len(command))
        if content is not None:
            return content.strip()
        position = start


def _read_box_argument(text: str, index: int) -> str | None:
    """The argument after a box command at `index`: a balanced {...} group or one space-separated token."""
    if text.startswith("{", index):
        depth = 0
        for end in range(index, len(text)):
            if text[end] == "{":
                depth += 1
            elif text[end] == "}":
                depth -= 1
                if depth == 0:
                    return text[index + 1 : end]
        return None  # unbalanced: the response was cut inside the box
    if text.startswith(" ", index):
        token = text[index + 1 :].split(maxsplit=1)
        if token:
            return token[0].rstrip("$.")
    return None


def _after_answer_is(text: str) -> str | None:
    """What follows the last "the answer is", up to the end of that sentence or line."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    tail = text[matches[-1].end() :].split("\n", 1)[0]
    inline_math = _INLINE_MATH.search(tail)
    if inline_math:
        return inline_math.group(1).strip() or None
    sentence_end = _SENTENCE_END.search(tail)
    if sentence_end:
        tail = tail[: sentence_end.start()]
    return tail.strip().strip("$").rstrip(".").strip() or None


def _after_hash_mark(text: str) -> str | None:
    index = text.rfind(_HASH_MARK)
    if index < 0:
        return None
    return text[index + len(_HASH_MARK) :].split("\n", 1)[0].strip().rstrip(".") or None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def extract_final_answer(response: str) -> tuple[str | None, str]:
    """(answer, source) in priority order: last box, "the answer is", ####, last number."""
    for source, extract in (
        ("boxed", find_last_boxed),
        ("answer-is", _after_answer_is),
        (_HASH_MARK, _after_hash_mark),
        ("last-number", _last_number),
    ):
        answer = extract(response)
        if answer:
            return answer, source
    return None, "none"


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
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
    numbers = _PLAIN_NUMBER.findall(cleaned)
    if not numbers:
        return None
    numerator, _, denominator = numbers[-1].partition("/")
    if denominator and int(denominator) == 0:
        return None
    return Fraction(numerator) / Fraction(denominator or 1)

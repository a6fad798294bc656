"""Prompt data sets: loaders for every file of the shared data, length filtering, resumable shuffling.

    <data dir>/<file>.jsonl ──► row parser (one per file: field names differ) ──► Example(problem, answer)
                            ──► filter_by_prompt_length ──► PromptSampler (seeded epochs, resumable position)

Invariants
- Every Example has a non-empty `problem` and a non-empty `answer` string (the final answer, as the reward
  functions take it as `reference`); MATH and Minerva answers are the last \\boxed{} of the solution.
- A malformed row raises DataFormatError naming the file and line; with skip_bad_rows=True it is counted,
  reported in one warning per file, and left out.
"""

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_dppo.data.paths import shared_data_dir
from megatron_dppo.rewards.math import find_last_boxed

logger = logging.getLogger(__name__)

_MATH_DELIMITER = re.compile(r"(?<!\\)\$")  # an unescaped $ (\$ is a dollar sign)


class DataFormatError(ValueError):
    """A row of a data file does not have the fields its loader expects."""


@dataclass(frozen=True)
class Example:
    problem: str
    answer: str  # the reference final answer passed to the reward function
    source: str  # data set name
    line: int  # 1-based line in the source file
    solution: str | None = None  # worked solution, where the file has one


def _require_string(row: dict, field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(f"field {field!r} must be a non-empty string, got {value!r}")
    return value


def _boxed_answer(solution: str) -> str:
    answer = find_last_boxed(solution)
    if not answer:
        raise DataFormatError("the solution has no \\boxed{...} final answer")
    return answer


def _gsm8k_final_answer(answer_text: str) -> str:
    """The number after '#### ' in a GSM8K answer, with thousands separators removed."""
    if "####" not in answer_text:
        raise DataFormatError("the answer has no '#### <number>' final line")
    final = answer_text.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise DataFormatError("the answer's '####' line is empty")
    return final


def _number_to_answer(value: object) -> str:
    """AMC23 stores answers as floats (27.0): write integers without the '.0'."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise DataFormatError(f"field 'answer' must be a number or string, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str) and not value.strip():
        raise DataFormatError("field 'answer' is empty")
    return str(value).strip()


def _parse_math_row(row: dict, source: str, line: int) -> Example:
    solution = _require_string(row, "solution")
    return Example(_require_string(row, "problem"), _boxed_answer(solution), source, line, solution)


def _parse_gsm8k_row(row: dict, source: str, line: int) -> Example:
    answer_text = _require_string(row, "answer")
    return Example(_require_string(row, "question"), _gsm8k_final_answer(answer_text), source, line, answer_text)


def _parse_math500_row(row: dict, source: str, line: int) -> Example:
    return Example(
        _require_string(row, "problem"), _require_string(row, "answer").strip(), source, line, row.get("solution")
    )


def _parse_competition_row(row: dict, source: str, line: int) -> Example:
    """AIME24 and AMC23: 'problem' and an 'answer' that is a string (AIME, '025') or a float (AMC, 27.0)."""
    return Example(_require_string(row, "problem"), _number_to_answer(row.get("answer")), source, line)


def _parse_minerva_row(row: dict, source: str, line: int) -> Example:
    solution = _require_string(row, "solution")
    return Example(_require_string(row, "problem"), _boxed_answer(solution), source, line, solution)


def _parse_olympiadbench_row(row: dict, source: str, line: int) -> Example:
    """'question' (after an optional 'context'), and 'final_answer': a list of strings in $...$ ('$69$,$84$')."""
    question = _require_string(row, "question")
    context = row.get("context")
    if isinstance(context, str) and context.strip():
        question = f"{context.strip()}\n\n{question}"
    final_answers = row.get("final_answer")
    if not isinstance(final_answers, list) or not final_answers or not all(isinstance(a, str) for a in final_answers):
        raise DataFormatError(f"field 'final_answer' must be a non-empty list of strings, got {final_answers!r}")
    answer = ", ".join(_MATH_DELIMITER.sub("", a).strip() for a in final_answers)
    if not answer:
        raise DataFormatError("field 'final_answer' holds only empty strings")
    solutions = row.get("solution")
    solution = solutions[0] if isinstance(solutions, list) and solutions else None
    return Example(question, answer, source, line, solution)


@dataclass(frozen=True)
class DatasetSpec:
    relative_path: str
    parse_row: Callable[[dict, str, int], Example]


DATASETS: dict[str, DatasetSpec] = {
    "math_train": DatasetSpec("math/train.jsonl", _parse_math_row),
    "math_test": DatasetSpec("math/test.jsonl", _parse_math_row),
    "gsm8k_train": DatasetSpec("gsm8k/train.jsonl", _parse_gsm8k_row),
    "gsm8k_test": DatasetSpec("gsm8k/test.jsonl", _parse_gsm8k_row),
    "math500": DatasetSpec("bench/math500.jsonl", _parse_math500_row),
    "gsm8k": DatasetSpec("bench/gsm8k.jsonl", _parse_gsm8k_row),
    "aime24": DatasetSpec("bench/aime24.jsonl", _parse_competition_row),
    "amc23": DatasetSpec("bench/amc23.jsonl", _parse_competition_row),
    "minerva_math": DatasetSpec("bench/minerva_math.jsonl", _parse_minerva_row),
    "olympiadbench": DatasetSpec("bench/olympiadbench.jsonl", _parse_olympiadbench_row),
}
BENCHMARKS = ("math500", "gsm8k", "aime24", "amc23", "minerva_math", "olympiadbench")


def load_dataset(
    name: str, data_dir: str | Path | None = None, skip_bad_rows: bool = False, limit: int | None = None
) -> list[Example]:
    """Load one of DATASETS from the shared data directory (or `data_dir`)."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of {sorted(DATASETS)}")
    spec = DATASETS[name]
    path = Path(data_dir) / spec.relative_path if data_dir else shared_data_dir() / spec.relative_path
    return load_jsonl(path, spec.parse_row, name, skip_bad_rows=skip_bad_rows, limit=limit)


def load_jsonl(
    path: Path,
    parse_row: Callable[[dict, str, int], Example],
    source: str,
    skip_bad_rows: bool = False,
    limit: int | None = None,
) -> list[Example]:
    """Parse a JSON-lines file row by row; bad rows raise (file:line) or, when skipped, are counted."""
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist; check the data directory (DPPO_DATA_DIR)")
    examples: list[Example] = []
    skipped: list[str] = []
    with path.open(encoding="utf-8") as handle:
        for line_number, text in enumerate(handle, start=1):
            if limit is not None and len(examples) >= limit:
                break
            if not text.strip():
                continue
            try:
                row = json.loads(text)
                if not isinstance(row, dict):
                    raise DataFormatError(f"expected a JSON object, got {type(row).__name__}")
                examples.append(parse_row(row, source, line_number))
            except (json.JSONDecodeError, DataFormatError) as error:
                message = f"{path}:{line_number}: {error}"
                if not skip_bad_rows:
                    fix = ("fix the row, or leave it out: --skip-bad-rows (tools/evaluate.py) or "
                           "--data-skip-bad-rows (examples/pretrain_dppo.py)")
                    raise DataFormatError(f"{message} ({fix})") from error
                skipped.append(message)
    if skipped:
        logger.warning("skipped %d malformed rows of %s; first: %s", len(skipped), path, skipped[0])
    return examples


def filter_by_prompt_length(
    examples: Sequence[Example],
    render: Callable[[str], str],
    encode: Callable[[str], list[int]],
    max_prompt_tokens: int,
) -> list[Example]:
    """Keep the examples whose rendered prompt has at most `max_prompt_tokens` tokens."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be at least 1, got {max_prompt_tokens}")
    kept = [example for example in examples if len(encode(render(example.problem))) <= max_prompt_tokens]
    if len(kept) < len(examples):
        dropped = len(examples) - len(kept)
        logger.info("length filter: dropped %d of %d prompts longer than %d tokens", dropped, len(examples),
                    max_prompt_tokens)
    return kept


class PromptSampler:
    """Indices into a data set in a seeded random order, one fresh permutation per epoch, resumable.

    The order depends only on (seed, epoch), so `state_dict()` (epoch and position) saved with a checkpoint
    and given back to `load_state_dict` continues the exact same stream.
    """

    def __init__(self, num_items: int, seed: int):
        if num_items < 1:
            raise ValueError(f"PromptSampler needs at least one item, got {num_items} (is the data set empty?)")
        self.num_items = num_items
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def next_indices(self, count: int) -> list[int]:
        indices: list[int] = []
        while len(indices) < count:
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(indices), self.num_items - self.position)
            indices.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
        return indices

    def state_dict(self) -> dict:
        return {"num_items": self.num_items, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["num_items"] != self.num_items or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state was saved for {state['num_items']} items with seed {state['seed']}, but this "
                f"sampler has {self.num_items} items and seed {self.seed}; resume with the same data and seed"
            )
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._permutation(self.epoch)

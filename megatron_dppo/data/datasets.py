"""Prompt data: the built-in sets, a user's files and Hugging Face hub data sets, all read by the `datasets` library.

    SOURCE ──► resolve_source ──► built-in name (math, gsm8k, math500, ...) ──► <data dir>/<its file>.jsonl
                              ──► a local .jsonl / .json / .parquet file, or a directory of them
                              ──► anything else: a Hugging Face hub data set name (needs the network), in
                                  its configuration where it has several (--prompt-data-config: openai/gsm8k main),
                                  or with --prompt-data-config a folder holding such a data set, downloaded whole
           ──► datasets.load_dataset, one table per file (or per hub split)
           ──► row parser: the built-in set's own fields, or --input-key / --label-key checked for --reward-type
           ──► parse_tables: ParsedRows(examples, skipped) ──► Example(prompt, answer, source, row)
           ──► encode_examples (templates) ──► PromptSampler (seeded epochs)

Invariants
- Every Example has a non-empty prompt (text, or chat messages [{"role", "content"}]) and a non-empty answer string
  that its reward can read (a number for gsm8k, an integer for synthetic).
- A bad row raises DataFormatError naming the file, the row and the fix; with skip_bad_rows it is counted, reported
  in one warning per source (how many of how many, and the first), and left out. More than MAX_BAD_ROW_FRACTION of
  a source's rows bad, or no usable row at all, is refused in one line naming the source, the count and the fix:
  rows that bad mean the source's layout is not the one read (a changed field type would otherwise be skipped into
  an empty or thinned set). A source that cannot be read at all raises PromptDataError naming it.
- A built-in prompt is its problem followed by BOXED_INSTRUCTION, and tools/prepare_data.py writes exactly these
  rows (and MATH's difficulty), so `--prompt-data math` and `--prompt-data <prepared>/math_train.parquet
  --difficulty-key difficulty` train on the same prompts.
- Nothing here imports torch or, until a table is read, the `datasets` library: argument checks use it.
"""

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_dppo.answers import find_last_boxed, reference_number
from megatron_dppo.data.paths import DATA_DIR_VARIABLE, data_dir, where_data_is
from megatron_dppo.data.templates import Messages, encode_prompt, require_chat_template, with_instruction
from megatron_dppo.errors import UserInputError

logger = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".parquet")
REWARD_TYPES = ("math", "gsm8k", "synthetic")
_MATH_DELIMITER = re.compile(r"(?<!\\)\$")  # an unescaped $ (\$ is a dollar sign)
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")
_SKIP_FIX = "fix the row, or leave bad rows out with --skip-bad-rows"
# --skip-bad-rows leaves out at most this share of a source's rows: MATH train's 2 of 7,500 pass, a source whose
# field changed type (every row bad) does not
MAX_BAD_ROW_FRACTION = 0.01


class PromptDataError(UserInputError):
    """A prompt source that cannot be found, read or used; the message names it and the fix."""


class DataFormatError(PromptDataError):
    """A row of a prompt source does not have the fields its parser expects."""


@dataclass(frozen=True)
class Example:
    prompt: str | Messages  # what the policy is asked: text, or chat messages
    answer: str  # the reference final answer passed to the reward function
    source: str  # the file (or built-in / hub data set) it came from
    row: int  # 1-based row in that file: for JSON lines, the n-th JSON object
    solution: str | None = None  # worked solution, where the data has one
    difficulty: str = ""  # a stratum known before rollout (MATH: "Level 3/Algebra"); DPPO's prior for unseen prompts
    fields: dict = dataclasses.field(default_factory=dict, compare=False)  # the row as read (a custom reward's)

    @property
    def location(self) -> str:
        return row_location(self.source, self.row)


def row_location(source: str, row: int) -> str:
    return f"{source}, row {row}"


# ------------------------------------------------------------------------------------------------ fields of a row
def _require_string(row: dict, field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(f"field {field!r} must be a non-empty string, got {value!r:.100}")
    return value


def _require_prompt(row: dict, field: str) -> str | Messages:
    """A non-empty text, or a non-empty list of chat messages {"role": str, "content": str}."""
    value = row.get(field)
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(
        isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
        for message in value
    ) and any(message["content"].strip() for message in value):
        return value
    state = "missing or null" if value is None else f"empty or malformed: {value!r:.100}"
    raise DataFormatError(f"field {field!r} is {state}; a prompt is a non-empty string or a list of chat messages "
                          "[{'role': ..., 'content': ...}]")


def read_label(value: object, field: str, reward_type: str) -> str:
    """The reference answer as the reward takes it: a string, with integral floats written as integers (27.0 → 27),
    checked to be readable by `reward_type` (gsm8k: holds a number; synthetic: an integer)."""
    if value is None:
        raise DataFormatError(f"field {field!r} is missing or null")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise DataFormatError(f"field {field!r} must be a string or a number, got {value!r:.100}")
    label = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value).strip()
    if not label:
        raise DataFormatError(f"field {field!r} is empty")
    try:
        if reward_type == "gsm8k":
            reference_number(label)
        elif reward_type == "synthetic":
            int(label)
    except ValueError as error:
        raise DataFormatError(f"field {field!r} = {label!r} cannot be read by the {reward_type} reward ({error})") \
            from error
    return label


# ------------------------------------------------------------------------------------------------ built-in sets
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


def _parse_math_row(row: dict, source: str, number: int) -> Example:
    """MATH and Minerva: 'problem', and the last \\boxed{} of 'solution'; MATH's level and type as its difficulty."""
    solution = _require_string(row, "solution")
    return Example(with_instruction(_require_string(row, "problem")), _boxed_answer(solution), source, number,
                   solution, math_difficulty(row))


def math_difficulty(row: dict) -> str:
    """'Level 3/Algebra' from MATH's `level` and `type` fields ('' where a row has neither)."""
    return "/".join(str(row[key]) for key in ("level", "type") if row.get(key))


def _parse_gsm8k_row(row: dict, source: str, number: int) -> Example:
    answer_text = _require_string(row, "answer")
    return Example(with_instruction(_require_string(row, "question")), _gsm8k_final_answer(answer_text), source,
                   number, answer_text)


def _parse_math500_row(row: dict, source: str, number: int) -> Example:
    return Example(with_instruction(_require_string(row, "problem")), _require_string(row, "answer").strip(), source,
                   number, row.get("solution"))


def _parse_competition_row(row: dict, source: str, number: int) -> Example:
    """AIME24 and AMC23: 'problem' and an 'answer' that is a string (AIME, '025') or a float (AMC, 27.0)."""
    return Example(with_instruction(_require_string(row, "problem")), read_label(row.get("answer"), "answer", "math"),
                   source, number)


def _parse_olympiadbench_row(row: dict, source: str, number: int) -> Example:
    """'question' (after an optional 'context'), and 'final_answer': a list of strings in $...$ ('$69$,$84$')."""
    question = _require_string(row, "question")
    context = row.get("context")
    if isinstance(context, str) and context.strip():
        question = f"{context.strip()}\n\n{question}"
    final_answers = row.get("final_answer")
    if not isinstance(final_answers, list) or not final_answers or not all(isinstance(a, str) for a in final_answers):
        raise DataFormatError(f"field 'final_answer' must be a non-empty list of strings, got {final_answers!r:.100}")
    answer = ", ".join(_MATH_DELIMITER.sub("", a).strip() for a in final_answers)
    if not answer:
        raise DataFormatError("field 'final_answer' holds only empty strings")
    solutions = row.get("solution")
    solution = solutions[0] if isinstance(solutions, list) and solutions else None
    return Example(with_instruction(question), answer, source, number, solution)


@dataclass(frozen=True)
class DatasetSpec:
    relative_path: str
    parse_row: Callable[[dict, str, int], Example]
    reward_type: str  # the reward that scores it


DATASETS: dict[str, DatasetSpec] = {
    "math_train": DatasetSpec("math/train.jsonl", _parse_math_row, "math"),
    "math_test": DatasetSpec("math/test.jsonl", _parse_math_row, "math"),
    "gsm8k_train": DatasetSpec("gsm8k/train.jsonl", _parse_gsm8k_row, "gsm8k"),
    "gsm8k_test": DatasetSpec("gsm8k/test.jsonl", _parse_gsm8k_row, "gsm8k"),
    "math500": DatasetSpec("bench/math500.jsonl", _parse_math500_row, "math"),
    "gsm8k": DatasetSpec("bench/gsm8k.jsonl", _parse_gsm8k_row, "gsm8k"),
    "aime24": DatasetSpec("bench/aime24.jsonl", _parse_competition_row, "math"),
    "amc23": DatasetSpec("bench/amc23.jsonl", _parse_competition_row, "math"),
    "minerva_math": DatasetSpec("bench/minerva_math.jsonl", _parse_math_row, "math"),
    "olympiadbench": DatasetSpec("bench/olympiadbench.jsonl", _parse_olympiadbench_row, "math"),
}
BENCHMARKS = ("math500", "gsm8k", "aime24", "amc23", "minerva_math", "olympiadbench")
# --prompt-data math / gsm8k mean the training splits; elsewhere a name is one of DATASETS ("gsm8k": the benchmark).
TRAINING_SETS = {"math": "math_train", "gsm8k": "gsm8k_train"}
# The held-out set of each reward when --eval-prompt-data is not given.
HELDOUT_SETS = {"math": "math500", "gsm8k": "gsm8k_test"}


def missing_data_files(directory: Path | None = None) -> list[Path]:
    """The files of DATASETS that the data directory lacks (all of them when it does not exist)."""
    root = directory or data_dir()
    return [root / spec.relative_path for spec in DATASETS.values() if not (root / spec.relative_path).is_file()]


# ------------------------------------------------------------------------------------------------ sources
@dataclass(frozen=True)
class Source:
    kind: str  # "builtin" (name is a key of DATASETS), "files" (files, sorted) or "hub" (name is a hub data set)
    name: str
    files: tuple[Path, ...] = ()
    config: str | None = None  # a hub data set's configuration (openai/gsm8k: main); None: its only (or default) one


def resolve_source(source: str, flag: str = "--prompt-data", directory: str | Path | None = None,
                   training: bool = False, config: str | None = None) -> Source:
    """What `source` names, checked without reading it: a built-in set whose file exists, local files with a
    supported suffix, or (anything else) a hub data set name. With `config` (`flag`-config) a hub data set is read in
    that configuration, and so is a folder holding one (a data set downloaded whole: `hf download REPO --repo-type
    dataset --local-dir DIR`); other sources take none (config_error). `training` maps math/gsm8k to their training
    splits."""
    name = TRAINING_SETS.get(source, source) if training else source
    if name in DATASETS:
        root = Path(directory) if directory else data_dir()
        path = root / DATASETS[name].relative_path
        if not path.is_file():
            where = f"--data-dir {directory}" if directory else where_data_is()
            raise PromptDataError(
                f"{flag} {source}: the built-in set is read from {path}, which does not exist ({where}). Put the "
                f"data files there (docs/data_and_rewards.md lists them and their public sources) or set "
                f"{DATA_DIR_VARIABLE} to the folder holding them; or pass your own prompts as a .parquet or .jsonl "
                "file or a directory of them (tools/prepare_data.py writes that layout, and writes the built-in sets "
                "in it, downloaded from their public sources)")
        return Source("builtin", name, (path,))
    path = Path(source).expanduser()
    if path.is_dir() and config is not None:  # a Hugging Face data set saved whole (hf download --local-dir)
        return Source("hub", source, config=config)
    if path.is_dir():
        files = tuple(sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES))
        if not files:
            raise PromptDataError(f"{flag} {source}: the directory holds no {', '.join(SUFFIXES)} files")
        return Source("files", source, files)
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise PromptDataError(f"{flag} {source}: unsupported file type {path.suffix!r}; use .jsonl (one JSON "
                                  "object per line), .json (a list of objects) or .parquet")
        return Source("files", source, (path,))
    if source.startswith((".", "/", "~")) or source.endswith(SUFFIXES) or not _HUB_NAME.fullmatch(source):
        raise PromptDataError(f"{flag} {source}: no such file or directory; pass a .jsonl, .json or .parquet file, a "
                              f"directory of them, a Hugging Face data set name, or a built-in set: {sorted(DATASETS)}")
    return Source("hub", source, config=config)


def config_error(source: Source, flag: str, config: str | None) -> str | None:
    """`flag`-config names a Hugging Face data set's configuration: one line when it is given for a source of
    another kind, which has none."""
    if config is None or source.kind == "hub":
        return None
    return (f"{flag}-config {config} names a configuration of a Hugging Face data set; {source.name} is a "
            f"{'built-in set' if source.kind == 'builtin' else 'local source'} read whole: drop it")


# ------------------------------------------------------------------------------------------------ reading tables
def read_table(path: Path):
    """One local file as a datasets.Dataset; an unreadable file names itself (and, for JSON, the bad line)."""
    import datasets as hf_datasets

    builder = "parquet" if path.suffix == ".parquet" else "json"
    try:
        return _quietly(lambda: hf_datasets.load_dataset(builder, data_files=str(path), split="train"))
    except Exception as error:  # pyarrow, datasets and the OS raise many types for one cause: the file is unreadable
        if builder == "json":
            _raise_on_bad_json(path)
        raise PromptDataError(f"{path}: cannot be read as {builder} ({type(error).__name__}: {error}); check that it "
                              f"is a {path.suffix} file of one object per row and that it is readable") from error


def _raise_on_bad_json(path: Path) -> None:
    """Name the line of a JSON file that does not parse (as JSON lines, or as one JSON document)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PromptDataError(f"{path}: cannot be read as UTF-8 text ({error})") from error
    try:
        json.loads(text)
        return  # one valid JSON document: the problem lies elsewhere
    except json.JSONDecodeError:
        pass
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as error:
            raise DataFormatError(f"{path}:{line_number}: not valid JSON ({error.msg}): fix or delete the line "
                                  "(--skip-bad-rows skips rows that parse, not text that is not JSON)") from error


def _read_hub(name: str, split: str, flag: str, config: str | None = None):
    import datasets as hf_datasets

    try:
        return _quietly(lambda: hf_datasets.load_dataset(name, config, split=split))
    except ConnectionError as error:
        offline = [variable for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
                   if os.environ.get(variable, "").lower() in ("1", "true", "yes", "on")]
        reason = f"{' and '.join(offline)} forbid downloads here" if offline else "the hub could not be reached"
        raise PromptDataError(
            f"{flag} {name}: no local file or directory has that name, so it was taken as a Hugging Face hub data set, "
            f"which needs network access, and {reason} ({error}). Pass a local .jsonl, .json or .parquet file or a "
            "directory of them instead (tools/prepare_data.py shows the layout), or run where the hub is reachable"
        ) from error
    except Exception as error:  # an unknown data set, split or config: datasets raises several types
        chosen = f"split {split!r}" + (f", configuration {config!r}" if config else "")
        hint = "" if config or "config" not in str(error).lower() else (
            f"; a data set with several configurations needs {flag}-config NAME")
        raise PromptDataError(f"{flag} {name} ({chosen}): the Hugging Face data set could not be loaded: "
                              f"{type(error).__name__}: {error}{hint}") from error


def _quietly(load):
    """Run `load` without datasets' progress bars (one per file and rank would flood a training log)."""
    from datasets import disable_progress_bars, enable_progress_bars, is_progress_bar_enabled

    enabled = is_progress_bar_enabled()
    disable_progress_bars()
    try:
        return load()
    finally:
        if enabled:
            enable_progress_bars()


def _tables(source: Source, split: str, flag: str) -> Iterator[tuple[str, object]]:
    """(name for messages, datasets.Dataset) per file, or the one hub split."""
    if source.kind == "hub":
        yield f"{source.name} [{source.config + ', ' if source.config else ''}{split}]", _read_hub(
            source.name, split, flag, source.config)
        return
    for path in source.files:
        yield str(path), read_table(path)


@dataclass(frozen=True)
class ParsedRows:
    examples: list[Example]
    skipped: int  # bad rows left out (--skip-bad-rows)
    read: int  # rows read, good and bad


def parse_tables(tables: Iterator[tuple[str, object]], parse_row: Callable[[dict, str, int], Example],
                 required_fields: Sequence[tuple[str, str]], skip_bad_rows: bool, limit: int | None,
                 what: str, fix: str) -> ParsedRows:
    """Parse rows of each table in order; a bad row raises (file, row, fix) or, when skipped, is counted. `what`
    names the source (a set, a flag's value) and `fix` says what to do when its rows are too bad to use: more than
    MAX_BAD_ROW_FRACTION of them, or none usable."""
    examples: list[Example] = []
    skipped: list[str] = []
    read = 0
    for name, table in tables:
        if limit is not None and len(examples) >= limit:
            break
        for field, flag in required_fields:
            if field not in table.column_names:
                raise PromptDataError(f"{name}: has no field {field!r} (its fields: {table.column_names}): pass "
                                      f"{flag} with the name of the field that holds it")
        for number, row in enumerate(table, start=1):
            if limit is not None and len(examples) >= limit:
                break
            read += 1
            try:
                examples.append(dataclasses.replace(parse_row(row, name, number), fields=row))
            except DataFormatError as error:
                message = f"{row_location(name, number)}: {error}"
                if not skip_bad_rows:
                    raise DataFormatError(f"{message} ({_SKIP_FIX})") from error
                skipped.append(message)
    if not examples:
        raise PromptDataError(f"{what}: no usable rows" + (f" (all {read} bad and skipped; first: {skipped[0]})"
                                                            if skipped else " (it holds none)") + f": {fix}")
    if len(skipped) > MAX_BAD_ROW_FRACTION * read:
        raise PromptDataError(
            f"{what}: {len(skipped)} of {read} rows are bad ({len(skipped) / read:.1%}; --skip-bad-rows leaves out at "
            f"most {MAX_BAD_ROW_FRACTION:.0%}), so its rows are not laid out as read here (first: {skipped[0]}): {fix}")
    if skipped:
        logger.warning("%s: skipped %d of %d rows, malformed (--skip-bad-rows); first: %s", what, len(skipped), read,
                       skipped[0])
    return ParsedRows(examples, len(skipped), read)


# ------------------------------------------------------------------------------------------------ loading
def load_dataset(name: str, data_dir: str | Path | None = None, skip_bad_rows: bool = False,
                 limit: int | None = None) -> list[Example]:
    """One of DATASETS, read from the data directory (DPPO_DATA_DIR or ../shared/data, or `data_dir`)."""
    return load_local_builtin(name, data_dir, skip_bad_rows, limit).examples


def load_local_builtin(name: str, data_dir: str | Path | None = None, skip_bad_rows: bool = False,
                       limit: int | None = None) -> ParsedRows:
    """load_dataset's rows and how many bad ones --skip-bad-rows left out."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of {sorted(DATASETS)}")
    resolved = resolve_source(name, "data set", data_dir)
    return parse_tables(_tables(resolved, "train", "data set"), DATASETS[name].parse_row, (), skip_bad_rows, limit,
                        f"{name} ({resolved.files[0]})", "the local copy is not the set's file: replace it (without "
                        "it, tools/prepare_data.py fetches the set's public source)")


def load_prompt_data(source: str, input_key: str = "prompt", label_key: str = "label", reward_type: str = "math",
                     split: str = "train", skip_bad_rows: bool = False, limit: int | None = None,
                     flag: str = "--prompt-data", data_dir: str | Path | None = None,
                     training: bool = False, difficulty_key: str | None = None,
                     config: str | None = None) -> list[Example]:
    """Prompts and reference answers from a built-in set, a local file or directory, or a hub data set (in its
    configuration `config`).

    Built-in sets have their own fields; other sources take the prompt from `input_key` and the answer from
    `label_key`, which must be readable by `reward_type`, and their difficulty (optional, any value) from
    `difficulty_key`. `flag` names the source in error messages.
    """
    if reward_type not in REWARD_TYPES:
        raise ValueError(f"unknown reward type {reward_type!r}; choose one of {REWARD_TYPES}")
    resolved = resolve_source(source, flag, data_dir, training, config)
    if problem := config_error(resolved, flag, config):
        raise PromptDataError(problem)
    if resolved.kind == "builtin":
        return load_local_builtin(resolved.name, data_dir, skip_bad_rows, limit).examples

    def parse_row(row: dict, name: str, number: int) -> Example:
        difficulty = "" if difficulty_key is None or row.get(difficulty_key) is None else str(row[difficulty_key])
        return Example(_require_prompt(row, input_key), read_label(row.get(label_key), label_key, reward_type), name,
                       number, difficulty=difficulty)

    required = ((input_key, "--input-key"), (label_key, "--label-key"))
    fix = (f"check {input_key!r} (--input-key) and {label_key!r} (--label-key) against the rows, and that "
           f"--reward-type {reward_type} can read the labels; or fix the rows")
    return parse_tables(_tables(resolved, split, flag), parse_row, required, skip_bad_rows, limit,
                        f"{flag} {source}", fix).examples


def encode_examples(examples: Sequence[Example], apply_chat_template: bool, tokenizer) -> list[list[int]]:
    """Token ids of each example's prompt; an error names the row it comes from."""
    if apply_chat_template:
        require_chat_template(tokenizer)
    encoded = []
    for example in examples:
        try:
            encoded.append(encode_prompt(example.prompt, apply_chat_template, tokenizer))
        except ValueError as error:
            raise PromptDataError(f"{example.location}: {error}") from error
    return encoded


def filter_by_prompt_length(
    examples: Sequence[Example],
    render: Callable[[str | Messages], str],
    encode: Callable[[str], list[int]],
    max_prompt_tokens: int,
) -> list[Example]:
    """Keep the examples whose rendered prompt has at most `max_prompt_tokens` tokens."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be at least 1, got {max_prompt_tokens}")
    kept = [example for example in examples if len(encode(render(example.prompt))) <= max_prompt_tokens]
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

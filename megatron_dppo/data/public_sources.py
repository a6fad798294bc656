"""Where each built-in set comes from on the Hugging Face Hub, and its download where no local copy exists.

    load_builtin(name) ─► its local copy (<data dir>/<file>, datasets.load_local_builtin), where there is one
                       ─► else download_builtin(name):
    built-in name ─► PUBLIC_SOURCES[name]: a Hub data set, the files of it that hold the set, the fields read and
                     their types
        ─► megatron_dppo.hub.download (the Hugging Face cache; HF_HUB_OFFLINE=1: the cache only) ─► Snapshot
        ─► its files, sorted by path ─► each field present with its type (field_type_error)
        ─► the set's own row parser (datasets.DATASETS) ─► ParsedRows: the Examples the local copy's rows give, and
           the rows --skip-bad-rows left out ─► LoadedSet(rows, where they came from)

The sources are public copies of the files docs/data_and_rewards.md lists: MATH's seven subject configurations
(whose path order, algebra first, is the local file's), GSM8K's `main` configuration, MATH-500, and copies of the
Qwen2.5-Math evaluation files (GSM8K test is the same 1,319 problems as openai/gsm8k's; amc23's card declares the
local file's fields and types, 40 rows; OlympiadBench's English, text-only, open-ended math configuration from its
authors' upload). Invariant: a source whose files, fields or field types changed is refused by name, never parsed
into empty or thinned rows (and the row parsers' 1% limit on bad rows, datasets.parse_tables, holds for every set).
"""

from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from megatron_dppo.data.datasets import (
    DATASETS,
    ParsedRows,
    PromptDataError,
    load_local_builtin,
    parse_tables,
    read_table,
)
from megatron_dppo.data.paths import DATA_DIR_VARIABLE, data_dir
from megatron_dppo.hub import Snapshot, download

# What a field holds, by the `datasets` feature types a file may declare for it
TEXT, NUMBER_OR_TEXT, TEXT_LIST = "text", "a number or text", "a list of text"
_TEXT_DTYPES = ("string", "large_string")
_NUMBER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
                  "float64")


def field_type_error(feature, kind: str) -> str | None:
    """Why a column of `datasets` feature type `feature` cannot hold `kind`, or None if it can (an all-null column,
    dtype null, cannot)."""
    dtype = getattr(feature, "dtype", None)
    if kind == TEXT_LIST:
        inner = getattr(feature, "feature", None)
        fits = inner is not None and getattr(inner, "dtype", None) in _TEXT_DTYPES
    else:
        fits = dtype in _TEXT_DTYPES or (kind == NUMBER_OR_TEXT and dtype in _NUMBER_DTYPES)
    return None if fits else f"holds {feature}, where {kind} was expected"


@dataclass(frozen=True)
class HubSource:
    repo_id: str
    files: tuple[str, ...]  # the files of the repository that hold the set (glob patterns, relative paths)
    fields: dict[str, str]  # the fields the set's row parser reads, and what each holds (TEXT, ...)

    @property
    def url(self) -> str:
        return f"https://huggingface.co/datasets/{self.repo_id}"


@dataclass(frozen=True)
class LoadedSet:
    rows: ParsedRows
    origin: str  # where the rows came from, in words: the local file, or the data set's page and commit


_MATH = {"problem": TEXT, "solution": TEXT}
_GSM8K = {"question": TEXT, "answer": TEXT}
_COMPETITION = {"problem": TEXT, "answer": NUMBER_OR_TEXT}
PUBLIC_SOURCES: dict[str, HubSource] = {
    "math_train": HubSource("EleutherAI/hendrycks_math", ("*/train-*.parquet",), _MATH),
    "math_test": HubSource("EleutherAI/hendrycks_math", ("*/test-*.parquet",), _MATH),
    "gsm8k_train": HubSource("openai/gsm8k", ("main/train-*.parquet",), _GSM8K),
    "gsm8k_test": HubSource("openai/gsm8k", ("main/test-*.parquet",), _GSM8K),
    "math500": HubSource("HuggingFaceH4/MATH-500", ("test.jsonl",), {"problem": TEXT, "answer": TEXT}),
    "gsm8k": HubSource("openai/gsm8k", ("main/test-*.parquet",), _GSM8K),
    "aime24": HubSource("HuggingFaceH4/aime_2024", ("data/train-*.parquet",), _COMPETITION),
    # its card (README.md, dataset_info) declares id int64, problem string, answer float64, url, question; 40 rows
    "amc23": HubSource("FlippyDora/amc23", ("data/train-*.parquet",), _COMPETITION),
    "minerva_math": HubSource("knoveleng/Minerva-Math", ("data/train-*.parquet",), _MATH),
    "olympiadbench": HubSource("Hothan/OlympiadBench", ("OlympiadBench/OE_TO_maths_en_COMP/*.parquet",),
                               {"question": TEXT, "final_answer": TEXT_LIST}),
}


def download_builtin(name: str, skip_bad_rows: bool = False) -> tuple[ParsedRows, Snapshot]:
    """The rows of built-in set `name` from its public Hub source (downloaded, or from the Hugging Face cache), parsed
    as the local copy is, and the snapshot (repo, commit) they came from."""
    source = PUBLIC_SOURCES[name]
    local_file = DATASETS[name].relative_path
    instead = f"put {local_file} under {DATA_DIR_VARIABLE} instead (docs/data_and_rewards.md lists the files)"
    snapshot = download(source.repo_id, "dataset", f"{name} (no local copy; its public source)", list(source.files),
                        f"or put {local_file} under {DATA_DIR_VARIABLE} (docs/data_and_rewards.md lists the files)")
    files = sorted(path for path in snapshot.folder.rglob("*") if path.is_file() and any(
        fnmatch(path.relative_to(snapshot.folder).as_posix(), pattern) for pattern in source.files))
    where = f"{source.repo_id}@{snapshot.revision[:12]}"
    if not files:
        raise PromptDataError(f"{name}: {where} holds no file matching {', '.join(source.files)}: the source has "
                              f"moved its files; {instead}")
    tables = [(f"{where}/{path.relative_to(snapshot.folder).as_posix()}", read_table(path)) for path in files]
    for label, table in tables:
        for field, kind in source.fields.items():
            if field not in table.column_names:
                raise PromptDataError(f"{name}: {label} has no field {field!r} (its fields: {table.column_names}): "
                                      f"the source has changed; {instead}")
            if problem := field_type_error(table.features[field], kind):
                raise PromptDataError(f"{name}: {label}'s field {field!r} {problem}: the source has changed; "
                                      f"{instead}")
    rows = parse_tables(iter(tables), DATASETS[name].parse_row, (), skip_bad_rows, None, f"{name} ({where})",
                        f"the source has changed; {instead}")
    return rows, snapshot


def load_builtin(name: str, directory: str | Path | None = None, skip_bad_rows: bool = False,
                 limit: int | None = None) -> LoadedSet:
    """Built-in set `name` from its local copy (in `directory`, else DPPO_DATA_DIR or ../shared/data) where there is
    one, else from its public source, and where the rows came from, in words (the file, or the data set's page and
    commit). tools/prepare_data.py and tools/evaluate.py read the built-in sets through it."""
    local = Path(directory or data_dir()) / DATASETS[name].relative_path
    if local.is_file():
        return LoadedSet(load_local_builtin(name, directory, skip_bad_rows, limit), str(local))
    rows, snapshot = download_builtin(name, skip_bad_rows)
    return LoadedSet(ParsedRows(rows.examples[:limit], rows.skipped, rows.read),
                     f"{PUBLIC_SOURCES[name].url} at commit {snapshot.revision}")

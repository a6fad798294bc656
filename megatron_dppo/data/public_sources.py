"""Where each built-in set comes from on the Hugging Face Hub, and its download where no local copy exists.

    load_builtin(name) ─► its local copy (<data dir>/<file>, datasets.load_dataset), where there is one
                       ─► else download_builtin(name):
    built-in name ─► PUBLIC_SOURCES[name]: a Hub data set, the files of it that hold the set, the fields read
        ─► megatron_dppo.hub.download (the Hugging Face cache; HF_HUB_OFFLINE=1: the cache only) ─► Snapshot
        ─► its files, sorted by path ─► the fields checked ─► the set's own row parser (datasets.DATASETS)
        ─► the same Examples the local copy gives, and the Snapshot (repo, commit) they came from

The sources are the public copies of the files docs/data_and_rewards.md lists: MATH's seven subject configurations
(whose path order, algebra first, is the local file's), GSM8K's `main` configuration, MATH-500, and mirrors of the
Qwen2.5-Math evaluation files (GSM8K test is the same 1,319 problems as openai/gsm8k's; OlympiadBench's English,
text-only, open-ended math configuration from its authors' upload). A source whose fields changed is refused by name,
never parsed into empty rows.
"""

from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from megatron_dppo.data.datasets import DATASETS, Example, PromptDataError, load_dataset, parse_tables, read_table
from megatron_dppo.data.paths import DATA_DIR_VARIABLE, data_dir
from megatron_dppo.hub import Snapshot, download


@dataclass(frozen=True)
class HubSource:
    repo_id: str
    files: tuple[str, ...]  # the files of the repository that hold the set (glob patterns, relative paths)
    fields: tuple[str, ...]  # the fields the set's row parser reads

    @property
    def url(self) -> str:
        return f"https://huggingface.co/datasets/{self.repo_id}"


_MATH = ("problem", "solution")
_COMPETITION = ("problem", "answer")
PUBLIC_SOURCES: dict[str, HubSource] = {
    "math_train": HubSource("EleutherAI/hendrycks_math", ("*/train-*.parquet",), _MATH),
    "math_test": HubSource("EleutherAI/hendrycks_math", ("*/test-*.parquet",), _MATH),
    "gsm8k_train": HubSource("openai/gsm8k", ("main/train-*.parquet",), ("question", "answer")),
    "gsm8k_test": HubSource("openai/gsm8k", ("main/test-*.parquet",), ("question", "answer")),
    "math500": HubSource("HuggingFaceH4/MATH-500", ("test.jsonl",), ("problem", "answer")),
    "gsm8k": HubSource("openai/gsm8k", ("main/test-*.parquet",), ("question", "answer")),
    "aime24": HubSource("HuggingFaceH4/aime_2024", ("data/train-*.parquet",), _COMPETITION),
    "amc23": HubSource("FlippyDora/amc23", ("data/train-*.parquet",), _COMPETITION),
    "minerva_math": HubSource("knoveleng/Minerva-Math", ("data/train-*.parquet",), _MATH),
    "olympiadbench": HubSource("Hothan/OlympiadBench", ("OlympiadBench/OE_TO_maths_en_COMP/*.parquet",),
                               ("question", "final_answer")),
}


def download_builtin(name: str, skip_bad_rows: bool = False) -> tuple[list[Example], Snapshot]:
    """The rows of built-in set `name` from its public Hub source (downloaded, or from the Hugging Face cache), parsed
    as the local copy is, and the snapshot (repo, commit) they came from."""
    source = PUBLIC_SOURCES[name]
    local_file = DATASETS[name].relative_path
    snapshot = download(source.repo_id, "dataset", f"{name} (no local copy; its public source)", list(source.files),
                        f"or put {local_file} under {DATA_DIR_VARIABLE} (docs/data_and_rewards.md lists the files)")
    files = sorted(path for path in snapshot.folder.rglob("*") if path.is_file() and any(
        fnmatch(path.relative_to(snapshot.folder).as_posix(), pattern) for pattern in source.files))
    where = f"{source.repo_id}@{snapshot.revision[:12]}"
    if not files:
        raise PromptDataError(f"{name}: {where} holds no file matching {', '.join(source.files)}: the source has "
                              f"moved its files; put {local_file} under {DATA_DIR_VARIABLE} instead")
    tables = [(f"{where}/{path.relative_to(snapshot.folder).as_posix()}", read_table(path)) for path in files]
    for label, table in tables:
        missing = [field for field in source.fields if field not in table.column_names]
        if missing:
            raise PromptDataError(f"{name}: {label} has no field {missing[0]!r} (its fields: {table.column_names}): "
                                  f"the source has changed; put {local_file} under {DATA_DIR_VARIABLE} instead")
    return parse_tables(iter(tables), DATASETS[name].parse_row, (), skip_bad_rows, None), snapshot


def load_builtin(name: str, directory: str | Path | None = None, skip_bad_rows: bool = False,
                 limit: int | None = None) -> tuple[list[Example], str]:
    """Built-in set `name` from its local copy (in `directory`, else DPPO_DATA_DIR or ../shared/data) where there is
    one, else from its public source; and where the rows came from, in words (the file, or the data set's page and
    commit). tools/prepare_data.py and tools/evaluate.py read the built-in sets through it."""
    local = Path(directory or data_dir()) / DATASETS[name].relative_path
    if local.is_file():
        return load_dataset(name, data_dir=directory, skip_bad_rows=skip_bad_rows, limit=limit), str(local)
    examples, snapshot = download_builtin(name, skip_bad_rows)
    return examples[:limit], f"{PUBLIC_SOURCES[name].url} at commit {snapshot.revision}"

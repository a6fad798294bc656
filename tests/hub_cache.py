"""A Hugging Face cache built on disk as huggingface_hub lays it out, so Hub names resolve offline in tests:

    <HF_HOME>/hub/<models|datasets>--ORG--NAME/refs/main            the commit of main
                                              /snapshots/<commit>/...  the files

(huggingface_hub keeps blobs apart and links them from the snapshot; a snapshot of plain files reads the same.)
"""

import hashlib
import shutil
from pathlib import Path


def hub_cache_of(hf_home: Path) -> Path:
    return hf_home / "hub"


def place_in_hub_cache(hf_home: Path, repo_id: str, source: Path, repo_type: str = "model") -> Path:
    """Copy the folder `source` into the cache under HF_HOME as the main revision of `repo_id`; return the
    snapshot folder (whose name is the commit)."""
    commit = hashlib.sha1(f"{repo_type}:{repo_id}".encode()).hexdigest()
    storage = hub_cache_of(hf_home) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    shutil.copytree(source, snapshot, dirs_exist_ok=True)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


# Tiny copies of the built-in sets' public sources (data/public_sources.py), each file at its path in its repository
# and each row with the source's own fields and types: {repo: {path in the repository: rows}}.
def _math_rows(subject: str, split: str) -> list[dict]:
    return [{"problem": f"{subject} {split} problem {i}: what is {i} + {i}?", "level": f"Level {i + 1}",
             "type": subject.title(), "solution": f"It is $\\boxed{{{2 * i}}}$."} for i in range(2)]


def _gsm8k_rows(split: str) -> list[dict]:
    return [{"question": f"{split}: Ann has {i} apples and buys 1,00{i} more. How many now?",
             "answer": f"{i} + 100{i} = <<{i}+100{i}={1000 + 2 * i}>>.\n#### 1,{2 * i:03d}"} for i in range(1, 3)]


PUBLIC_SOURCE_FILES = {
    "EleutherAI/hendrycks_math": {
        f"{subject}/{split}-00000-of-00001.parquet": _math_rows(subject, split)
        for subject in ("algebra", "geometry") for split in ("train", "test")},
    "openai/gsm8k": {f"main/{split}-00000-of-00001.parquet": _gsm8k_rows(split) for split in ("train", "test")},
    "HuggingFaceH4/MATH-500": {"test.jsonl": [
        {"problem": "Compute $3 \\cdot 4$.", "solution": "$\\boxed{12}$", "answer": "12", "subject": "Prealgebra",
         "level": 1, "unique_id": "test/prealgebra/1.json"}]},
    "HuggingFaceH4/aime_2024": {"data/train-00000-of-00001.parquet": [
        {"id": 60, "problem": "Find the number of minutes.", "solution": "$\\boxed{204}$", "answer": "204",
         "url": "https://artofproblemsolving.com/", "year": "2024"}]},
    "FlippyDora/amc23": {"data/train-00000-of-00001.parquet": [
        {"id": 0, "problem": "How many miles from A?", "answer": 27.0, "url": "https://artofproblemsolving.com/",
         "question": "How many miles from A?"}]},
    "knoveleng/Minerva-Math": {"data/train-00000-of-00001.parquet": [
        {"problem": "Find the diameter in cm.", "solution": "So $s=\\boxed{1.6}$ cm.", "type": "Astronomy"}]},
    "Hothan/OlympiadBench": {"OlympiadBench/OE_TO_maths_en_COMP/OE_TO_maths_en_COMP.parquet": [
        {"id": 1606, "question": "How many moves?", "solution": ["Two moves."], "final_answer": ["$2$"],
         "context": None, "subfield": "Combinatorics", "is_multiple_answer": False, "unit": None,
         "answer_type": "Numerical", "error": None}]},
}


def write_rows(rows: list[dict], path: Path) -> None:
    """Rows as a .parquet or .jsonl file, as their source stores them."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def place_public_sources(hf_home: Path, staging: Path) -> None:
    """Every built-in set's public source, tiny, in the Hugging Face cache under `hf_home`."""
    for repo, files in PUBLIC_SOURCE_FILES.items():
        for relative, rows in files.items():
            write_rows(rows, staging / repo / relative)
        place_in_hub_cache(hf_home, repo, staging / repo, repo_type="dataset")


def write_local_copies(data_dir: Path) -> None:
    """The same rows as local copies in the data directory's layout (the sets' files as docs/data_and_rewards.md
    lists them): what tools/prepare_data.py reads where they exist."""
    from fnmatch import fnmatch

    from megatron_dppo.data.datasets import DATASETS
    from megatron_dppo.data.public_sources import PUBLIC_SOURCES

    for name, source in PUBLIC_SOURCES.items():
        rows = [row for path, file_rows in sorted(PUBLIC_SOURCE_FILES[source.repo_id].items())
                if any(fnmatch(path, pattern) for pattern in source.files) for row in file_rows]
        write_rows(rows, data_dir / DATASETS[name].relative_path)

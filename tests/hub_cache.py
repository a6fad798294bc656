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

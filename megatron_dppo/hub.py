"""Models and data sets by their Hugging Face Hub name: the one resolver every flag that names a model uses.

    --hf-checkpoint, converters' --hf-dir / --tokenizer-dir, evaluate's --model-dir / --tokenizer-dir: NAME
        ─► a local path of that name ─► that path, as given (its caller checks what it holds)
        ─► ORG/NAME ─► huggingface_hub.snapshot_download (config, tokenizer, safetensors; no other weight formats;
                       model_config_file, for --dry-run's memory plan: config.json alone)
                       ─► the snapshot folder in the Hugging Face cache (HF_HOME / HF_HUB_CACHE)
           HF_HUB_OFFLINE=1 (or no Hub reachable) ─► the cached snapshot (refs/main ─► snapshots/<commit>)
           not cached ─► HubError: one line naming the model, the cache, and how to fill it
    data/public_sources.py: a built-in set's public data set ─► download ─► Snapshot(folder, commit), the same way

Invariants:
- a name that exists on disk is never looked up on the Hub, so a local folder called Qwen/Qwen3-4B stays local;
- what is returned is a folder on disk with a commit (the snapshot's name), so every reader (the trainer, the rollout
  servers it starts, the converters) reads the same files and can say which revision it used;
- nothing here imports torch, and huggingface_hub only when a name is looked up (flag checks run before launch).
"""

import re
from dataclasses import dataclass
from pathlib import Path

from megatron_dppo.errors import UserInputError

# ORG/NAME as the Hub spells repositories (letters, digits, '-', '_', '.'; no leading '.' or '-')
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# The files of a model the trainer, the converters and the rollout servers read: config, generation config, tokenizer
# (tokenizer.json, vocab/merges, sentencepiece or tiktoken models, chat templates) and safetensors weights. Other
# weight formats (*.bin, *.pth, original/*) are left on the Hub: they would double the download.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


class HubError(UserInputError):
    """A Hub name that does not resolve to a local snapshot; the message names it, the cache and the fix."""


@dataclass(frozen=True)
class Snapshot:
    folder: Path  # the files, on disk
    repo_id: str
    revision: str  # the commit the files are from (the snapshot folder's name)


def is_repo_id(name: str) -> bool:
    """ORG/NAME, and no such path on disk."""
    return bool(_REPO_ID.fullmatch(name)) and not Path(name).expanduser().exists()


def hub_cache() -> str:
    """The folder huggingface_hub keeps snapshots in (HF_HUB_CACHE, or HF_HOME/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_model(name: str, flag: str) -> Path:
    """The local folder of a model named by `flag`: `name` itself when it is a path (or not a Hub name), else the
    snapshot of the Hub model ORG/NAME, downloaded into the Hugging Face cache unless it is there already."""
    if not is_repo_id(name):
        return Path(name).expanduser()
    return download(name, "model", flag, MODEL_FILES, "or pass a local folder").folder


def model_config_file(name: str, flag: str) -> Path:
    """config.json of the model `flag` names: in its folder, or of the Hub model ORG/NAME: the cached snapshot's, or
    downloaded alone (the memory plan of a dry run needs the config, not gigabytes of weights)."""
    if not is_repo_id(name):
        return Path(name).expanduser() / "config.json"
    return download(name, "model", flag, ["config.json"], "or pass a local folder").folder / "config.json"


def download(repo_id: str, repo_type: str, what: str, allow_patterns: list[str], other_way: str,
             revision: str | None = None) -> Snapshot:
    """The files of the Hub `repo_type` ("model" or "dataset") `repo_id` matching `allow_patterns`, downloaded or
    found in the cache. Errors start with `what` (the flag or the set asking) and end with `other_way` to get
    the files ("or pass a local folder")."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    command = f"hf download {repo_id}" + (" --repo-type dataset" if repo_type == "dataset" else "")
    try:
        folder = snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns)
    except LocalEntryNotFoundError as error:  # offline, or the Hub unreachable, and not (fully) in the cache
        reason = ("HF_HUB_OFFLINE=1 forbids downloading it" if constants.HF_HUB_OFFLINE
                  else f"the Hub could not be reached ({type(error.__cause__ or error).__name__})")
        raise HubError(f"{what} {repo_id}: the Hugging Face {repo_type} is not in the cache {hub_cache()} and "
                       f"{reason}: run `{command}` where the Hub is reachable, with the same HF_HOME (or copy its "
                       f"{repo_type}s--{repo_id.replace('/', '--')} folder into that cache), {other_way}") from None
    except GatedRepoError:
        raise HubError(f"{what} {repo_id}: the Hugging Face {repo_type} is gated: accept its terms on the Hub and "
                       f"log in (`hf auth login`, or HF_TOKEN), {other_way}") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} {repo_id}: no such Hugging Face {repo_type} (or it is private: log in with "
                       f"`hf auth login` or HF_TOKEN); check the name, {other_way}") from None
    return Snapshot(Path(folder), repo_id, Path(folder).name)

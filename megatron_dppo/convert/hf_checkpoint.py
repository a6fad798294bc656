"""Read an HF safetensors directory (one file or shards with an index) slice by slice.

A TP/PP rank reads only the rows or columns it holds: `safe_open(...).get_slice(name)[start:stop]` maps just those
bytes of the file. Every problem with the directory is reported with the path and the fix.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_dppo.convert.mapping import ModelShape, expected_hf_names, model_shape

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: point --hf-dir at a Hugging Face model directory with config.json")
    with open(path) as f:
        return json.load(f)


class HFCheckpoint:
    """Lazy, slice-wise access to the tensors of an HF model directory."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.config = read_config(self.dir)
        self.shape: ModelShape = model_shape(self.config)
        self._file_of = self._index_tensors()
        self._handles = {}

    def _index_tensors(self) -> dict:
        index_path = self.dir / INDEX_FILE
        if index_path.is_file():
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            for name, file_name in weight_map.items():
                if not (self.dir / file_name).is_file():
                    raise FileNotFoundError(
                        f"shard {file_name} (holding {name}) is named in {index_path} but missing from {self.dir}: "
                        "copy the complete checkpoint (all shards listed in the index)"
                    )
            return dict(weight_map)
        single = self.dir / SINGLE_FILE
        if not single.is_file():
            raise FileNotFoundError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {self.dir}: save the model with save_pretrained "
                "(safetensors format)"
            )
        with safe_open(single, framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"tensor {name} is missing from the checkpoint in {self.dir}")
        file_name = self._file_of[name]
        if file_name not in self._handles:
            self._handles[file_name] = safe_open(self.dir / file_name, framework="pt")
        return self._handles[file_name]

    def names(self) -> list[str]:
        return list(self._file_of)

    def tensor_shape(self, name: str) -> tuple:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None):
        """Tensor `name`, or only its slice [start:stop) along `dim` (0 or 1)."""
        tensor_slice = self._handle(name).get_slice(name)
        if dim is None:
            return tensor_slice[:]
        if dim == 0:
            return tensor_slice[start:stop]
        return tensor_slice[:, start:stop]

    def check_complete(self) -> None:
        """Raise naming every tensor the config implies but the checkpoint lacks."""
        missing = [name for name in expected_hf_names(self.shape) if name not in self._file_of]
        if missing:
            raise KeyError(
                f"checkpoint {self.dir} lacks {len(missing)} tensors its config.json implies, e.g. {missing[:3]}: "
                "the directory is incomplete or its config does not match the weights"
            )

    def close(self) -> None:
        self._handles.clear()

    def dtype(self) -> torch.dtype:
        first = next(iter(self._file_of))
        return self.read(first, 0, 0, 1).dtype

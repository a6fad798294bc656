"""Offline checkpoint conversion between HF safetensors directories and the trainer's Megatron dist checkpoints.

    HF → Megatron:  validate the HF dir (architecture, shapes against config.json, TP/PP divisibility)
                    → spawn tp x pp gloo ranks on the CPU → each builds its stage on the meta device (shapes and
                    sharding only) → megatron's dist_checkpointing.save with the torch_dist strategy's planning and
                    file layout, whose writer produces each chunk from its HF slices only when it is written
    Megatron → HF:  read the dist checkpoint's metadata → plan every HF tensor and its output shard from meta shapes
                    → per layer: read that layer's slice of each stacked global tensor (torch.distributed.checkpoint,
                    no process group, no model) → merge with the convert/ table → write into the pre-planned shard

Invariants:
- one name/layout table (convert/mapping.py) serves both directions, as it serves load_hf_weights and weight sync;
- the output appears under its final name only when complete: everything is written to a hidden sibling directory
  that is renamed at the end, and removed on any failure;
- both directions stream: HF → Megatron holds one stored chunk (one layer's slice of a parameter, or the
  embedding shard) per rank; Megatron → HF holds about one layer, written straight into its place in a shard file
  whose header was written first, so no shard is ever buffered whole;
- HF → Megatron writes what Megatron's own dist_checkpointing.save writes for a real model of that TP/PP (same
  .distcp bytes, common.pt, metadata.json and .metadata plans; tested), so the trainer loads and reshards it.

Public names (the rest is private to this module):
- the tools (tools/convert_*.py): hf_to_megatron, megatron_to_hf, run_tool (their main), DTYPES (the --dtype names);
- bench/convert_memory.py, which measures one rank and the largest unit: convert_rank (one HF → Megatron rank, as
  hf_to_megatron spawns it), DistCheckpointReader, plan_parameters and its PlannedParameter units, tensor_bytes,
  and ShardedSafetensorsWriter (which also writes its random HF model).

It lives in actor/ because it builds the trainer's model on CPU ranks and reads and writes the actor's checkpoints
(actor/checkpoint.py); convert/ stays a leaf that imports nothing of actor/.
"""

import contextlib
import dataclasses
import inspect
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync, _split_by_size_and_type
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _write_item
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from tqdm import tqdm

from megatron_dppo.actor.model import DTYPES
from megatron_dppo.convert.hf_checkpoint import INDEX_FILE, HFCheckpoint
from megatron_dppo.convert.mapping import (
    COLUMN,
    GATED,
    ModelShape,
    expected_hf_names,
    find_row,
    hf_names_of,
    model_shape,
    padded_vocab_size,
)
from megatron_dppo.platform.network import free_port

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
LAYER_PREFIX = "decoder.layers."
GENERATION_CONFIG = "generation_config.json"


def run_tool(convert: Callable[[], Path]) -> int:
    """The tools' main: run the conversion, print where it wrote, or print the error and return 1."""
    try:
        out = convert()
    except (FileNotFoundError, FileExistsError, KeyError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, flag: str) -> Iterator[Path]:
    """Yield a hidden staging directory next to `out`; rename it to `out` on success, delete it on failure."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{flag} {out} already exists: choose a new directory or remove the old one")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---- HF → Megatron ------------------------------------------------------------------------------------------


def check_hf_shapes(checkpoint: HFCheckpoint) -> None:
    """Every tensor the config implies exists and has the shape transformers would give it (a vocabulary or size
    mismatch between config.json and the weights is caught here, before any rank starts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint.check_complete()
    config = AutoConfig.for_model(**checkpoint.config)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    for name in expected_hf_names(checkpoint.shape):
        found = checkpoint.tensor_shape(name)
        if found != expected[name]:
            raise ValueError(
                f"{checkpoint.dir}: tensor {name} has shape {found}, but config.json implies {expected[name]} "
                "(e.g. vocab_size or hidden sizes do not match the weights): fix config.json or the weights"
            )


class _StreamingWriter(FileSystemWriterAsync):
    """Megatron's torch_dist file writer, minus its preloading: the same files (`__<rank>_<bucket>.distcp`, items
    split over `thread_count` buckets by megatron's own rule, each item serialised by torch's `_write_item` exactly as
    megatron does), but a tensor item is produced by `produce(item, meta)` only when its turn to be written comes and
    is dropped right after, so one item is in memory at a time. `progress` counts the tensors written."""

    def __init__(self, path: Path, produce: Callable, thread_count: int, progress: tqdm):
        super().__init__(path, thread_count=thread_count)
        self.produce, self.progress = produce, progress
        self.results = None

    def prepare_write_data(self, plan, planner) -> None:
        self.write_buckets = []
        for bucket in _split_by_size_and_type(self.thread_count, plan.items):
            if bucket:
                name = f"{plan.storage_data.prefix}{len(self.write_buckets)}{DEFAULT_SUFFIX}"
                byte_items = [(item, planner.resolve_data(item)) for item in bucket
                              if item.type == WriteItemType.BYTE_IO]
                tensor_items = [(item, planner.lookup_object(item.index)) for item in bucket
                                if item.type != WriteItemType.BYTE_IO]
                self.write_buckets.append((os.path.join(self.checkpoint_dir, name), name, (byte_items, tensor_items)))
        self.progress.reset(total=sum(len(tensor_items) for *_, (_, tensor_items) in self.write_buckets))

    def write_streamed(self) -> None:
        transforms = [self.transforms] if hasattr(self, "transforms") else []
        serialization = ({"serialization_format": SerializationFormat.TORCH_SAVE}
                         if "serialization_format" in inspect.signature(_write_item).parameters else {})
        self.results = []
        for path, storage_key, (byte_items, tensor_items) in self.write_buckets:
            with open(path, "wb") as stream:
                for item, data in byte_items:
                    self.results.append(_write_item(*transforms, stream, data, item, storage_key, **serialization))
                for item, meta in tensor_items:
                    tensor = self.produce(item, meta)
                    self.results.append(_write_item(*transforms, stream, tensor, item, storage_key, **serialization))
                    del tensor
                    self.progress.update()
                os.fsync(stream.fileno())

    def retrieve_write_results(self):
        return self.results


class _StreamingSaveStrategy(TorchDistSaveShardedStrategy):
    """The default torch_dist save strategy (same backend, version, replica handling, planner and global plan),
    writing through `_StreamingWriter`; `dist_checkpointing.save` does everything else (common.pt, metadata.json)."""

    def __init__(self, produce: Callable, progress: tqdm):
        super().__init__("torch_dist", 1)
        self.produce, self.progress = produce, progress

    def save(self, sharded_state_dict, checkpoint_dir: Path) -> None:
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                             self.keep_only_main_replica)
        writer = _StreamingWriter(checkpoint_dir, self.produce, self.thread_count, self.progress)
        planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False)
        planned, *_ = save_state_dict_async_plan(mcore_to_pyt_state_dict(sharded_state_dict, False), writer, None, 0,
                                                 planner=planner)
        writer.write_streamed()
        save_state_dict_async_finalize(*planned)


def unstacked_name(key: str, layer: int | None) -> str:
    """The per-layer Megatron name of a checkpoint key: layer parameters are stored stacked over layers under
    LAYER_PREFIX, so `layer` (the global layer index) goes back in after the prefix; other keys are unchanged."""
    return key if layer is None else f"{LAYER_PREFIX}{layer}.{key[len(LAYER_PREFIX):]}"


class _HFChunks:
    """Produces one stored chunk of the checkpoint (a key and its offsets in the global tensor) from the HF
    slices it is made of, with the convert/ table, in the model's dtype."""

    def __init__(self, checkpoint: HFCheckpoint, tp_rank: int, tp_size: int):
        self.checkpoint, self.tp_rank, self.tp_size = checkpoint, tp_rank, tp_size
        self.padded_vocab = padded_vocab_size(checkpoint.shape.vocab_size, tp_size)

    def __call__(self, item, meta: torch.Tensor) -> torch.Tensor:
        key, offsets = item.index.fqn, item.index.offset
        # layer parameters are stored stacked: the leading offset is the global layer index
        name = unstacked_name(key, offsets[0] if key.startswith(LAYER_PREFIX) else None)
        shape = self.checkpoint.shape
        row, layer = find_row(name, shape)
        hf_names, layout = hf_names_of(row, layer), row.layout
        if layout is GATED:
            # megatron stores a rank's [gate; up] as two chunks: gate rows at [0, ffn), up rows at [ffn, 2 ffn)
            hf_names, layout = (hf_names[offsets[1] // shape.ffn_hidden_size],), COLUMN
        chunk = layout.shard(hf_names, self.checkpoint.read, shape, self.tp_rank, self.tp_size, self.padded_vocab,
                             self.checkpoint.tensor_shape)
        self.checkpoint.close()  # drop the file mappings: their pages would otherwise stay in this process's memory
        if chunk.numel() != meta.numel():
            raise ValueError(f"{self.checkpoint.dir}: the HF tensors {hf_names} give {name} the shape "
                             f"{tuple(chunk.shape)}, but the model expects {tuple(meta.shape)}: config.json does not "
                             "match the weights")
        chunk = chunk.to(meta.dtype).reshape(meta.shape)
        if not chunk.is_contiguous() or chunk.untyped_storage().nbytes() != chunk.numel() * chunk.itemsize:
            chunk = chunk.contiguous().clone()  # torch.save writes a view's whole storage
        return chunk


def convert_rank(rank: int, world: int, port: int, hf_dir: str, staging: str, tp: int, pp: int, dtype: str):
    """One TP/PP rank: declare its stage on the meta device (shapes and sharding, no weights), then write its part of
    the checkpoint chunk by chunk, each read from its HF slices just before it is written."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from megatron.core import parallel_state

    from megatron_dppo.actor.checkpoint import save_checkpoint
    from megatron_dppo.actor.model import build_gpt_model, build_transformer_config, place_model
    from megatron_dppo.actor.parallel import destroy_parallel, init_parallel

    init_parallel(tp, pp)
    checkpoint = HFCheckpoint(hf_dir)
    config = build_transformer_config(checkpoint.shape, tp, pp, dtype=dtype)
    config.perform_initialization = False  # meta tensors: nothing to initialise
    with torch.device("meta"):
        # RoPE frequencies are not part of the checkpoint; llama3 scaling computes them with host-side values
        model = build_gpt_model(dataclasses.replace(checkpoint.shape, rope_scaling=None), config)
    # placed as the trainer places it, so every tensor is written in the dtype the trainer trains and saves it in
    model = place_model(model, "meta")
    chunks = _HFChunks(checkpoint, parallel_state.get_tensor_model_parallel_rank(), tp)
    with tqdm(desc=f"HF → Megatron tp={tp} pp={pp} (rank 0)", unit="tensor", disable=rank != 0) as progress:
        save_checkpoint(staging, 0, {"model": model.sharded_state_dict()}, checkpoint.config,
                        sharded_strategy=_StreamingSaveStrategy(chunks, progress))
    destroy_parallel()


def hf_to_megatron(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, dtype: str | None = None) -> Path:
    """Convert an HF safetensors directory into a Megatron dist checkpoint save directory for `tp` x `pp`
    (`out/iter_0000000` and `out/latest`, loadable by the trainer's --load). `dtype` defaults to the HF weights'.

    Streams: each of the tp x pp ranks (CPU processes) holds one stored chunk (a layer's slice of one parameter, or
    its shard of the embedding) at a time."""
    import torch.multiprocessing as mp

    checkpoint = HFCheckpoint(hf_dir)
    check_hf_shapes(checkpoint)
    try:
        checkpoint.shape.check_parallel(tp, pp)
    except ValueError as error:
        raise ValueError(f"cannot convert {hf_dir} with --tp {tp} --pp {pp}: {error}") from None
    if dtype is None:
        dtype = DTYPE_NAMES.get(checkpoint.dtype(), "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    checkpoint.close()
    world = tp * pp
    with atomic_output_dir(out, "--out") as staging:
        # The converter is a CPU tool: hide GPUs from the ranks so they take megatron_dppo's gloo CPU mode.
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            # Ranks fork from a server process that imported this module once (no threads, no CUDA state), so a
            # conversion does not pay megatron's import per rank.
            mp.get_context("forkserver").set_forkserver_preload([__name__])
            mp.start_processes(convert_rank, args=(world, free_port(), str(hf_dir), str(staging), tp, pp, dtype),
                               nprocs=world, start_method="forkserver")
        except mp.ProcessRaisedException as error:
            raise RuntimeError(f"converting {hf_dir} failed on a rank:\n{error}") from None
        finally:
            if hidden is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES")
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    return Path(out)


# ---- Megatron → HF ------------------------------------------------------------------------------------------


class _SliceLoadPlanner(DefaultLoadPlanner):
    """Copies each read chunk into the matching part of a caller-owned buffer (the requested slice)."""

    def __init__(self, buffers: dict[str, torch.Tensor]):
        super().__init__()
        self.buffers = buffers

    def resolve_tensor(self, read_item):
        view = self.buffers[read_item.dest_index.fqn]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor):
        pass


class DistCheckpointReader:
    """Slices of the global tensors of a torch_dist checkpoint, read without a process group or a model."""

    def __init__(self, path: Path):
        self.path = path
        self.storage = FileSystemReader(str(path))
        self.metadata = self.storage.read_metadata()
        files = sorted({info.relative_path for info in self.metadata.storage_data.values()})
        missing = [name for name in files if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint {path} lacks the shard files {missing} named in its .metadata: copy "
                                    "the complete checkpoint directory")
        self.storage.set_up_storage_reader(self.metadata, is_coordinator=True)
        self.tensors = {key: md for key, md in self.metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}

    def read(self, requests: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """{key: (offsets, sizes)} → {key: that box of the global tensor}, in one pass over the files."""
        buffers, items = {}, []
        for key, (offsets, sizes) in requests.items():
            md = self.tensors[key]
            buffers[key] = torch.empty(sizes, dtype=md.properties.dtype)
            box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(key, md, [box])
        planner = _SliceLoadPlanner(buffers)
        plan = self.storage.prepare_local_plan(LoadPlan(items))
        plan = self.storage.prepare_global_plan([plan])[0]
        try:
            self.storage.read_data(plan, planner).wait()
        except Exception as error:  # torch raises several types for a truncated or corrupted data file
            raise RuntimeError(f"checkpoint {self.path}: reading {sorted(requests)} failed ({type(error).__name__}: "
                               f"{error}); its shard files are damaged or incomplete") from error
        return buffers


@dataclass(frozen=True)
class PlannedParameter:
    """One Megatron parameter of the checkpoint: its stored key, its layer (None: not a layer) and the HF tensors
    (name, shape) it becomes."""

    key: str
    layer: int | None
    hf_tensors: tuple[tuple[str, tuple[int, ...]], ...]


def _model_keys(reader: DistCheckpointReader, shape: ModelShape) -> list[str]:
    keys = []
    for key in reader.tensors:
        if not key.startswith(MODEL_PREFIXES) or "._extra_state" in key:
            continue  # optimizer state, scheduler, Transformer Engine extra state
        if key == "output_layer.weight" and shape.tie_word_embeddings:
            continue  # a PP last stage's copy of the tied embedding
        keys.append(key)
    return keys


def plan_parameters(reader: DistCheckpointReader, shape: ModelShape) -> list[list[PlannedParameter]]:
    """Units of work in HF order: [embedding], layer 0 .. L-1, [final norm, output layer]; HF shapes from a merge of
    meta tensors, so the whole output is known before a byte is read."""
    before, layers, after = [], [[] for _ in range(shape.num_layers)], []
    for key in _model_keys(reader, shape):
        global_shape = tuple(reader.tensors[key].size)
        stacked = key.startswith(LAYER_PREFIX)
        if stacked and global_shape[0] != shape.num_layers:
            raise ValueError(f"checkpoint {reader.path}: {key} stacks {global_shape[0]} layers, but hf_config.json "
                             f"has num_hidden_layers={shape.num_layers}: the checkpoint does not match its config")
        for layer in range(shape.num_layers) if stacked else [None]:
            name = unstacked_name(key, layer)
            row, _ = find_row(name, shape)
            if row.layout.kind == "vocab" and global_shape[0] < shape.vocab_size:
                raise ValueError(f"checkpoint {reader.path}: {key} has {global_shape[0]} vocabulary rows, fewer than "
                                 f"vocab_size={shape.vocab_size} in its hf_config.json: the config does not match")
            meta = torch.empty(global_shape[1:] if stacked else global_shape, device="meta")
            merged = row.layout.merge(hf_names_of(row, layer), [meta], shape)
            parameter = PlannedParameter(key, layer, tuple((hf_name, tuple(t.shape)) for hf_name, t in merged))
            if layer is not None:
                layers[layer].append(parameter)
            elif key.startswith("embedding."):
                before.append(parameter)
            else:
                after.append(parameter)
    units = [before, *layers, after]
    written = {hf_name for unit in units for p in unit for hf_name, _ in p.hf_tensors}
    missing = [name for name in expected_hf_names(shape) if name not in written]
    if missing:
        raise KeyError(f"checkpoint {reader.path} lacks the Megatron tensors of {len(missing)} HF tensors, e.g. "
                       f"{missing[:3]}: it is incomplete or does not match its hf_config.json")
    return units


def _read_unit(reader: DistCheckpointReader, unit: list[PlannedParameter], shape: ModelShape) -> Iterator[tuple]:
    """(hf_name, tensor) of one unit: the layer's slice of each stacked tensor (real vocabulary rows only)."""
    requests = {}
    for p in unit:
        global_shape = tuple(reader.tensors[p.key].size)
        if p.layer is not None:
            requests[p.key] = ((p.layer,) + (0,) * (len(global_shape) - 1), (1, *global_shape[1:]))
        else:
            row, _ = find_row(p.key, shape)
            rows = shape.vocab_size if row.layout.kind == "vocab" else global_shape[0]
            requests[p.key] = ((0,) * len(global_shape), (rows, *global_shape[1:]))
    tensors = reader.read(requests)
    for p in unit:
        name = unstacked_name(p.key, p.layer)
        row, layer = find_row(name, shape)
        tensor = tensors.pop(p.key)
        yield from row.layout.merge(hf_names_of(row, layer), [tensor[0] if p.layer is not None else tensor], shape)


class ShardedSafetensorsWriter:
    """Writes planned tensors into safetensors shards in a fixed order, each straight to its place in its file.

    The safetensors format is an 8-byte little-endian header length, a JSON header {name: dtype, shape,
    data_offsets}, then the raw bytes; with every name and shape planned in advance the header goes first and each
    tensor is appended as it arrives, so no shard is held in memory."""

    def __init__(self, out_dir: Path, planned: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 max_shard_bytes: int):
        self.out_dir, self.dtype = out_dir, dtype
        self.shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
        shard_bytes = 0
        for name, tensor_shape in planned:
            size = tensor_bytes(tensor_shape, dtype)
            if self.shards[-1] and shard_bytes + size > max_shard_bytes:
                self.shards.append([])
                shard_bytes = 0
            self.shards[-1].append((name, tensor_shape))
            shard_bytes += size
        count = len(self.shards)
        self.file_names = ([f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)] if count > 1
                           else ["model.safetensors"])
        self.order = [(shard, name, tensor_shape) for shard, entries in enumerate(self.shards)
                      for name, tensor_shape in entries]
        self.position = 0
        self.file = None

    def _open(self, shard: int) -> None:
        if self.file is not None:
            self.file.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, tensor_shape in self.shards[shard]:
            size = tensor_bytes(tensor_shape, self.dtype)
            header[name] = {"dtype": SAFETENSORS_DTYPES[self.dtype], "shape": list(tensor_shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self.file = open(self.out_dir / self.file_names[shard], "wb")
        self.file.write(struct.pack("<Q", len(encoded)))
        self.file.write(encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard, planned_name, planned_shape = self.order[self.position]
        if (name, tuple(tensor.shape)) != (planned_name, planned_shape):
            raise RuntimeError(f"internal error: got {name} {tuple(tensor.shape)}, planned {planned_name} "
                               f"{planned_shape}")
        if self.file is None or self.position == 0 or self.order[self.position - 1][0] != shard:
            self._open(shard)
        self.file.write(tensor.to(self.dtype).contiguous().view(torch.uint8).numpy())
        self.position += 1

    def close(self) -> None:
        if self.position != len(self.order):
            raise RuntimeError(f"internal error: {len(self.order) - self.position} planned tensors were not written")
        if self.file is not None:
            self.file.close()
        if len(self.shards) > 1:
            weight_map = {name: self.file_names[shard] for shard, name, _ in self.order}
            total = sum(tensor_bytes(tensor_shape, self.dtype) for _, _, tensor_shape in self.order)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))


def tensor_bytes(tensor_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of a tensor of `tensor_shape` and `dtype`, known from its plan before it exists."""
    return int(torch.Size(tensor_shape).numel()) * dtype.itemsize


def _write_configs(out_dir: Path, hf_config: dict, dtype: torch.dtype, tokenizer_dir: Path | None) -> None:
    """config.json with the output dtype; generation_config.json from the tokenizer (base model) directory when it
    has one (it carries e.g. Qwen's list of end-of-turn ids, which the rollout engine stops on), else from the
    config's token ids."""
    from transformers import GenerationConfig

    config = {key: value for key, value in hf_config.items() if key != "torch_dtype"}
    config["dtype"] = HF_DTYPE_NAMES[dtype]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_dir is not None and (tokenizer_dir / GENERATION_CONFIG).is_file():
        shutil.copy2(tokenizer_dir / GENERATION_CONFIG, out_dir / GENERATION_CONFIG)
        return
    token_ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                 if config.get(key) is not None}
    GenerationConfig(**token_ids).save_pretrained(out_dir)


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    found = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not {"tokenizer.json", "tokenizer.model", "vocab.json"} & set(found):
        raise FileNotFoundError(f"--tokenizer-dir {tokenizer_dir} holds no tokenizer.json, tokenizer.model or "
                                "vocab.json: point it at a Hugging Face tokenizer directory")
    for name in found:
        shutil.copy2(tokenizer_dir / name, out_dir / name)


def megatron_to_hf(megatron_dir: str | Path, out: str | Path, dtype: str | None = None,
                   tokenizer_dir: str | Path | None = None, max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Export a Megatron dist checkpoint (a save dir, following `latest`, or an iter_* dir; any TP/PP; from the
    converter or the trainer) to an HF directory that transformers loads. `dtype` defaults to the stored one."""
    from megatron_dppo.actor.checkpoint import read_hf_config, resolve_checkpoint

    path = resolve_checkpoint(megatron_dir)
    hf_config = read_hf_config(path)
    try:
        shape = model_shape(hf_config)
    except ValueError as error:
        raise ValueError(f"checkpoint {path}: hf_config.json: {error}") from None
    reader = DistCheckpointReader(path)
    units = plan_parameters(reader, shape)
    stored_dtype = reader.tensors[units[0][0].key].properties.dtype
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    out_dtype = DTYPES[dtype] if dtype else stored_dtype
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else None
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"--tokenizer-dir {tokenizer_dir} does not exist")
    planned = [hf_tensor for unit in units for p in unit for hf_tensor in p.hf_tensors]
    with atomic_output_dir(out, "--out") as staging:
        writer = ShardedSafetensorsWriter(staging, planned, out_dtype, max_shard_bytes)
        for unit in tqdm(units, desc="Megatron → HF", unit="layer"):
            for hf_name, tensor in _read_unit(reader, unit, shape):
                writer.write(hf_name, tensor)
        writer.close()
        _write_configs(staging, hf_config, out_dtype, tokenizer_dir)
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, staging)
    return Path(out)

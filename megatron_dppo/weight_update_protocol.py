"""The wire protocol of SGLang's update_weights_from_distributed, as the trainer and every server speak it.

    group:  trainer (rank 0) and each server (at its rank offset) ─► init_weight_update_group: a TCPStore hosted
            by rank 0, PrefixStore(group_name), torch's process-group helper (gloo or NCCL)
            ─► ... ─► destroy_weight_update_group (abort_weight_update_group while a send is pending)
    bucket: (hf_name, tensor) pairs ─► group_into_buckets (whole tensors, dtype-aligned, at most bucket_bytes)
            ─► pack_bucket: one flat uint8 buffer ("flattened_bucket")  |  tensor_bucket: each tensor (null)
            ─► broadcast_from_trainer ─► server: a buffer of tensor_nbytes summed ─► unpack_bucket: views by name

The trainer's side (pause, flush, begin/end session, prefetching, version check) is rollout/weight_sync.py; the
servers' are servers/embedded/weights.py and servers/vllm_extension.py.

Invariants:
- the group is created as SGLang creates its side, so the same code talks to SGLang (NCCL), the embedded engine
  (gloo) and vLLM's worker extension;
- a bucket holds whole tensors, at most `bucket_bytes` (a larger tensor travels alone), each starting at a byte
  offset aligned to its dtype (SGLang's FlattenedTensorBucket refuses unaligned offsets);
- unpack_bucket is pack_bucket's inverse: the metadata (names, dtypes, shapes) must describe the buffer's bytes
  exactly, or it raises;
- weight-sync ranks: the trainer is rank 0, then each server's ranks in order (sync_rank_offsets).

Imports nothing of megatron_dppo but platform, so the servers (one of which runs inside vLLM's own environment)
import it without the trainer's code; and not torch at import time (the functions that move tensors import it), as
the launch plan's --dry-run, which runs before every Slurm launch, reads sync_rank_offsets without paying for torch.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Growth of the bucket limit from first_bucket_bytes: packing a byte costs about 0.6 of broadcasting it over gloo
# on this CPU host, so bucket k+1 (RAMP x larger) is packed before bucket k has been sent.
RAMP = 1.5
DEFAULT_GROUP_NAME = "megatron_dppo_weight_sync"
FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for one packed buffer per bucket
# In an engine's /model_info (the embedded engine's; not SGLang's, which therefore only ever gets SGLang's calls): the
# engine takes the batched calls of a sync. /begin_weight_update with {"pause_generation": {"mode": m},
# "flush_cache": true} pauses, flushes and opens the session in one call; /end_weight_update with
# {"continue_generation": true} closes it and continues, also when closing fails; each update's answer carries the
# engine's weight_version; and an update posted while the one before is still being answered waits for it.
BATCHING_FIELD = "weight_update_batching"


def sync_rank_offsets(engine_ranks: list[int]) -> tuple[list[int], int]:
    """(first rank of each server, world size) of the weight-sync group: the trainer is rank 0, then each server's
    ranks in order. WeightSyncer.init_group forms the group this way; the launch plan prints it."""
    offsets = [1 + sum(engine_ranks[:i]) for i in range(len(engine_ranks))]
    return offsets, 1 + sum(engine_ranks)


def init_weight_update_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, timeout_s: float = 120.0):
    """Join (rank 0: host) a process group outside the default one; the same steps SGLang takes."""
    import torch.distributed
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    from megatron_dppo.platform.network import gloo_bound_to, sync_interface

    timeout = datetime.timedelta(seconds=timeout_s)
    # An explicit TCPStore (rank 0 hosts it), not `rendezvous("tcp://...")`: under torchrun, rendezvous would
    # look for torchelastic's agent store (TORCHELASTIC_USE_AGENT_STORE) and every member would wait as a client.
    store = torch.distributed.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                       timeout=timeout)
    # gloo binds the interface that routes to the master (on rank 0: the master address's own), not the address the
    # host's name resolves to, which may be loopback or on another network (platform/network.py)
    with gloo_bound_to(sync_interface(master_address) if backend == "gloo" else None):
        group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                             group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_update_group(group) -> None:
    import torch.distributed

    torch.distributed.destroy_process_group(group)


def abort_weight_update_group(group) -> None:
    """End the group with work still pending (NCCL: the broadcast kernel is aborted, where a destroy would wait)."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group(group)


def broadcast_from_trainer(group, tensor: torch.Tensor, what: str = "weights") -> None:
    """Group rank 0 sends `tensor` to every engine; engines receive into it."""
    from megatron_dppo.platform import collectives

    collectives.broadcast(group, tensor, 0, what).wait()


@dataclass
class Bucket:
    names: list[str]
    dtypes: list[str]  # torch dtype names without "torch.", as SGLang parses them with getattr(torch, dtype)
    shapes: list[list[int]]
    flat: torch.Tensor | None  # [sum of tensor bytes] uint8, tensors back to back in `names` order (flattened_bucket)
    staging: torch.Tensor | None = None  # the reusable buffer `flat` lies in, if any (rollout/weight_sync.py)
    tensors: list[torch.Tensor] | None = None  # the per-tensor format: each tensor, contiguous, in `names` order

    @property
    def broadcasts(self) -> list[torch.Tensor]:
        """What is broadcast for this bucket, in order: the flat buffer, or each tensor."""
        return [self.flat] if self.flat is not None else self.tensors

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.broadcasts)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_nbytes(dtype: str, shape) -> int:
    """Bytes of a tensor of dtype name `dtype` (torch attribute name, e.g. "bfloat16") and `shape` in a bucket."""
    import torch

    return torch.Size(shape).numel() * getattr(torch, dtype).itemsize


def bucket_needs_copy(named_tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Only a bucket of one contiguous tensor is sent as its own bytes; any other is copied into one buffer."""
    return len(named_tensors) > 1 or not named_tensors[0][1].is_contiguous()


def pack_bucket(named_tensors: list[tuple[str, torch.Tensor]], staging: torch.Tensor | None = None) -> Bucket:
    """Flatten whole tensors into one contiguous byte buffer (SGLang's flattened_bucket layout).

    A bucket of one contiguous tensor is sent as that tensor's own bytes (no copy). Otherwise the tensors are
    written with one `torch.cat` into `staging[:nbytes]` when a large enough staging buffer (uint8, same device)
    is given, else into a new buffer."""
    import torch

    offset = 0
    for name, tensor in named_tensors:
        if offset % tensor.element_size():
            raise ValueError(f"tensor {name} would start at unaligned byte offset {offset} in its bucket")
        offset += tensor.numel() * tensor.element_size()
    first = named_tensors[0][1]
    if not bucket_needs_copy(named_tensors):
        flat = first.detach().reshape(-1).view(torch.uint8)
    else:
        fits = staging is not None and staging.numel() >= offset and staging.device == first.device
        flat = staging[:offset] if fits else torch.empty(offset, dtype=torch.uint8, device=first.device)
        torch.cat([tensor.detach().reshape(-1).view(torch.uint8) for _, tensor in named_tensors], out=flat)
    return Bucket(names=[name for name, _ in named_tensors],
                  dtypes=[dtype_name(tensor.dtype) for _, tensor in named_tensors],
                  shapes=[list(tensor.shape) for _, tensor in named_tensors], flat=flat)


def tensor_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> Bucket:
    """A bucket in the per-tensor format (SGLang's load_format=null): each tensor is broadcast as it is (a copy only if
    it is not contiguous), so nothing is packed."""
    return Bucket(names=[name for name, _ in named_tensors],
                  dtypes=[dtype_name(tensor.dtype) for _, tensor in named_tensors],
                  shapes=[list(tensor.shape) for _, tensor in named_tensors], flat=None,
                  tensors=[tensor.detach().contiguous() for _, tensor in named_tensors])


def unpack_bucket(flat: torch.Tensor, names: list[str], dtypes: list[str],
                  shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat` (uint8) for each tensor; inverse of pack_bucket."""
    import torch

    tensors, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"tensor {name}: unknown dtype {dtype!r}")
        size = tensor_nbytes(dtype, shape)
        tensors.append((name, flat[offset:offset + size].view(torch_dtype).reshape(shape)))
        offset += size
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes but its metadata describes {offset}")
    return tensors


def group_into_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                       first_bucket_bytes: int | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Whole tensors, in order, at most bucket_bytes per bucket, each aligned to its dtype.

    first_bucket_bytes < bucket_bytes ramps the limit up: the first bucket holds at most first_bucket_bytes, each
    next one RAMP times more, until bucket_bytes. Nothing can be sent before the first bucket is packed; a small
    one starts the broadcast early, and each next bucket is packed while the smaller one before it is sent."""
    limit = min(first_bucket_bytes or bucket_bytes, bucket_bytes)
    bucket, used = [], 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket and (used + size > limit or used % tensor.element_size()):
            yield bucket
            bucket, used = [], 0
            limit = min(int(limit * RAMP), bucket_bytes)
        bucket.append((name, tensor))
        used += size
    if bucket:
        yield bucket

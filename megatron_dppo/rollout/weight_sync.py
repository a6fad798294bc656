"""Trainer side (group rank 0) of the weight sync to the rollout servers, SGLang's distributed update protocol.

init (once): every engine leaves a group of this name it still holds → POST /init_weights_update_group to every
             engine ‖ trainer joins as group rank 0
sync:        pause → flush → begin (/begin_weight_update) → for each bucket: POST /update_weights_from_distributed
             (names, dtypes, shapes, load_format) to every engine ‖ broadcast(one flat uint8 buffer for
             "flattened_bucket"; each tensor for null, the per-tensor format) → end (/end_weight_update, always)
             → continue → check /model_info weight_version on every engine
batched:     engines whose /model_info offers weight_update_batching (the embedded engine; never SGLang) get, from
             the sync after the one that read it: begin+pause+flush in one call → the updates pipelined (bucket k+1
             posted once bucket k is sent, k's answer, with the weight version, collected while k+1 travels) →
             end+continue in one call; the answers' versions are the version check
Every phase is timed (SyncStats.phases, PHASES; bench/weight_sync.py prints them).

The protocol both sides speak (the group, the bucket layout, packing and unpacking) is
megatron_dppo/weight_update_protocol.py; this module adds the trainer's order of operations, its staging buffers and
the thread that packs the next bucket while the current one is sent. The syncer holds an EngineCalls
(rollout/engine_calls.py), which makes the calls to the engines (control calls, flushes, bucket updates one at a time
or pipelined, broadcast on the group the syncer hands it, torn down by the syncer's _abort_group); that module also
times the phases.

Invariants:
- SGLang 0.5.23 refuses a distributed update outside a begin/end session, before receiving anything; the syncer opens
  one per sync and closes it in a `finally`, also when a bucket failed (an engine left with an open session would
  refuse the next begin);
- a failed update leaves no broadcast pending: an engine that refused never joins the broadcast, so the syncer
  tears the group down (engines leave first, closing their ends, then this side aborts its communicator, which
  ends the pending send) and the next sync builds a new one;
- packed buckets' limits ramp up from first_bucket_bytes to bucket_bytes, so the broadcast starts after a small
  pack; consecutive buckets sent per tensor (nothing to pack) are merged up to bucket_bytes, each bucket costing a
  request;
- while bucket k is broadcast, a producer thread gathers bucket k+1 and (flattened_bucket) packs it into one of two
  reusable staging buffers (at most two packed buckets in memory; a one-tensor bucket is sent without a copy);
- after a sync every engine reports the new weight version, or the sync raises;
- pipelined updates reach each engine in order: bucket k+1 is posted only once this side has sent bucket k, so the
  engine is inside bucket k's update (it holds its model lock, which hands over in arrival order) when k+1 arrives;
  a refusal of bucket k tears the group down with k+1's sends pending too;
- every tensor is moved to the device the group's backend carries (NCCL: this GPU, gloo: the host) and broadcast
  through platform.collectives, which checks it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_dppo.platform import collectives
from megatron_dppo.platform.network import ANY_PORT, PortRange, free_port_in
from megatron_dppo.rollout.client import RolloutServerError, control_request
from megatron_dppo.rollout.engine_calls import EngineCalls, PhaseClock
from megatron_dppo.weight_update_protocol import (
    BATCHING_FIELD,
    DEFAULT_GROUP_NAME,
    FLATTENED_BUCKET,
    Bucket,
    abort_weight_update_group,
    bucket_needs_copy,
    destroy_weight_update_group,
    group_into_buckets,
    init_weight_update_group,
    pack_bucket,
    sync_rank_offsets,
    tensor_bucket,
)

DEFAULT_BUCKET_BYTES = 512 * 1024**2
DEFAULT_FIRST_BUCKET_BYTES = 32 * 1024**2
# WeightSyncer's per-bucket choice: a bucket whose tensors average under PACK_BELOW_BYTES is packed (one broadcast),
# else each tensor is broadcast alone (no copy). Over gloo on this host a broadcast costs ~0.2 ms before its first
# byte and packing runs at ~9 GB/s, so packing a tensor is the cheaper way to send it below ~1.8 MB (measured).
AUTO_FORMAT = "auto"
PACK_BELOW_BYTES = 2**20


def bucket_nbytes(named_tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in named_tensors)


class StagingBuffers:
    """Two reusable byte buffers to pack buckets into: a bucket takes a free one and gives it back once sent, so at
    most two packed buckets exist, and a buffer kept across syncs skips fresh-page costs on the host."""

    def __init__(self, count: int = 2):
        self.free: queue.Queue = queue.Queue()
        for _ in range(count):
            self.free.put(None)  # not allocated yet: the first bucket that needs it sizes it

    def take(self, nbytes: int, device: torch.device, stop: threading.Event) -> torch.Tensor | None:
        """A buffer of at least nbytes on device (None if `stop` is set while waiting for one)."""
        while not stop.is_set():
            try:
                buffer = self.free.get(timeout=0.1)
            except queue.Empty:
                continue
            if buffer is None or buffer.numel() < nbytes or buffer.device != device:
                buffer = None  # drop the old one before allocating its replacement
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return buffer
        return None

    def give(self, buffer: torch.Tensor) -> None:
        self.free.put(buffer)

    def release_device_memory(self) -> None:
        """Keep host buffers for the next sync; free accelerator ones (their allocator caches memory anyway)."""
        kept = [self.free.get_nowait() for _ in range(self.free.qsize())]
        for buffer in kept:
            self.free.put(buffer if buffer is not None and buffer.device.type == "cpu" else None)


class BucketPrefetcher:
    """Packed buckets, the next one prepared in a thread while the caller sends the current one.

    The thread starts at construction, so the first bucket is packed while the caller does other work (pause,
    flush). A multi-tensor bucket is packed into a buffer of `staging` (new ones if not given), which goes back to
    the pool when the caller asks for the following bucket; the caller must be done with a bucket by then.
    Iterate once; `close()` (or leaving the `with` block, or the end of iteration) stops the thread."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, timeout_s: float,
                 staging: StagingBuffers | None = None, first_bucket_bytes: int | None = None,
                 pack: bool | Callable[[list[tuple[str, torch.Tensor]]], bool] = True):
        self.staging = staging or StagingBuffers()
        self.pack = pack if callable(pack) else lambda group: pack
        self.timeout_s = timeout_s
        self.ready: queue.Queue = queue.Queue(maxsize=1)
        self.done = object()
        self.stop = threading.Event()
        self.producer = threading.Thread(target=self._produce, args=(named_tensors, bucket_bytes, first_bucket_bytes),
                                         name="weight-sync-pack", daemon=True)
        self.producer.start()

    def _produce(self, named_tensors, bucket_bytes: int, first_bucket_bytes: int | None) -> None:
        try:
            # consecutive groups sent per tensor are merged up to bucket_bytes: with nothing to pack there is no
            # first pack to wait for, and every bucket costs a request (the ramp is for packed buckets)
            per_tensor: list[tuple[str, torch.Tensor]] = []
            for group in group_into_buckets(named_tensors, bucket_bytes, first_bucket_bytes):
                if not self.pack(group):
                    if per_tensor and bucket_nbytes(per_tensor) + bucket_nbytes(group) > bucket_bytes:
                        if not self._put(tensor_bucket(per_tensor)):
                            return
                        per_tensor = []
                    per_tensor += group
                    continue
                if per_tensor:
                    if not self._put(tensor_bucket(per_tensor)):
                        return
                    per_tensor = []
                buffer = None
                if bucket_needs_copy(group):
                    buffer = self.staging.take(bucket_nbytes(group), group[0][1].device, self.stop)
                    if buffer is None:
                        return
                bucket = pack_bucket(group, buffer)
                bucket.staging = buffer
                if not self._put(bucket):
                    return
            if per_tensor and not self._put(tensor_bucket(per_tensor)):
                return
            self._put(self.done)
        except BaseException as error:  # re-raised in the consumer
            self._put(error)

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Bucket]:
        try:
            while True:
                try:
                    item = self.ready.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise TimeoutError(f"preparing the next weight bucket took longer than {self.timeout_s} s") \
                        from None
                if item is self.done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.staging is not None:
                    self.staging.give(item.staging)
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        self.producer.join(timeout=self.timeout_s)

    def __enter__(self) -> BucketPrefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prefetch_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, timeout_s: float,
                     staging: StagingBuffers | None = None, first_bucket_bytes: int | None = None,
                     pack: bool | Callable[[list[tuple[str, torch.Tensor]]], bool] = True) -> BucketPrefetcher:
    """Iterable of buckets, prepared ahead in a thread (see BucketPrefetcher and group_into_buckets); a bucket that
    `pack` (a bool, or a predicate of the bucket's tensors) refuses is a per-tensor bucket (tensor_bucket)."""
    return BucketPrefetcher(named_tensors, bucket_bytes, timeout_s, staging, first_bucket_bytes, pack)


@dataclass
class SyncStats:
    seconds: float  # the whole sync, pause to version check
    bytes: int
    buckets: int
    tensors: int
    weight_version: str
    phases: dict[str, float] = field(default_factory=dict)  # PHASES -> seconds

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")


class WeightSyncer:
    """Trainer side (group rank 0) of the sync; see the module docstring for the order of operations."""

    def __init__(self, urls: list[str], master_address: str = "127.0.0.1", master_ports: PortRange = ANY_PORT,
                 backend: str = "gloo", group_name: str = DEFAULT_GROUP_NAME,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 120.0, api_key: str | None = None,
                 pause_mode: str = "retract", engine_ranks: list[int] | None = None,
                 keep_host_copy: bool = False, first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                 control: Callable[..., Any] = control_request, load_format: str | None = FLATTENED_BUCKET):
        """first_bucket_bytes: the first bucket's limit, growing to bucket_bytes (see group_into_buckets).
        load_format: FLATTENED_BUCKET (one packed buffer per bucket: one collective each, as NCCL wants), None
        (SGLang's per-tensor format: one broadcast per tensor, nothing packed) or AUTO_FORMAT (per bucket: packed when
        its tensors average under PACK_BELOW_BYTES, else per tensor: over gloo a large tensor costs a second full
        copy to pack, a small one costs a broadcast's fixed latency to send alone).
        keep_host_copy: remember the last synced tensors (host memory, one model copy) so that `resend()` can
        restore a restarted engine without the trainer ranks' help (they may be busy in a collective).
        master_ports: where this side's store listens (--weight-sync-port): the range's first free port, or any.
        control: how each SGLang control route reaches a server, `control(url, path, payload, method, timeout_s,
        api_key)`; the default posts it as is, rollout/vllm.VLLMControl carries it out on vLLM."""
        if not urls:
            raise ValueError("WeightSyncer needs at least one rollout server URL")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight sync backend {backend!r} must be 'gloo' (CPU) or 'nccl' (GPU)")
        if bucket_bytes < 1 or first_bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} and first_bucket_bytes={first_bucket_bytes} must be "
                             f"positive (defaults {DEFAULT_BUCKET_BYTES}, {DEFAULT_FIRST_BUCKET_BYTES})")
        if load_format not in (FLATTENED_BUCKET, AUTO_FORMAT, None):
            raise ValueError(f"load_format={load_format!r} must be {FLATTENED_BUCKET!r}, {AUTO_FORMAT!r} or None "
                             "(per tensor)")
        if pause_mode not in ("abort", "retract"):
            # SGLang's third mode, in_place, keeps the running batch, and its scheduler refuses /flush_cache while it
            # holds one: every sync would wait out its timeout at the flush.
            raise ValueError(f"pause_mode={pause_mode!r} must be abort or retract (SGLang refuses to flush the cache "
                             "of an in_place pause that holds running requests)")
        self.urls = [url.rstrip("/") for url in urls]
        # Ranks per engine: 1 for the embedded engine, tp*dp GPUs for an SGLang server.
        self.engine_ranks = engine_ranks or [1] * len(self.urls)
        if len(self.engine_ranks) != len(self.urls):
            raise ValueError(f"engine_ranks has {len(self.engine_ranks)} entries for {len(self.urls)} servers")
        self.master_address = master_address
        self.master_ports = master_ports
        self.backend = backend
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.first_bucket_bytes = first_bucket_bytes
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        self.group = None
        self.last_version: str | None = None
        self.keep_host_copy = keep_host_copy
        self.host_copy: list[tuple[str, torch.Tensor]] = []
        self.staging = StagingBuffers()
        self.load_format = load_format
        self.engines = EngineCalls(self.urls, control, timeout_s, api_key)  # its calls to the engines
        # whether every engine offers weight_update_batching, as the last /model_info said (none read yet: no)
        self.batching = False

    # Request bodies, one builder per SGLang request dataclass (checked by tests/test_rollout_contract.py).
    def init_group_payload(self, master_port: int, rank_offset: int, world_size: int) -> dict:
        return {"master_address": self.master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": self.group_name, "backend": self.backend}

    def destroy_group_payload(self) -> dict:
        return {"group_name": self.group_name}

    def pause_payload(self) -> dict:
        return {"mode": self.pause_mode}

    def begin_payload(self) -> dict:
        return {"selector": "all"}

    # The batched calls of engines that offer weight_update_batching (the embedded engine; never sent to SGLang).
    def batched_begin_payload(self) -> dict:
        return {**self.begin_payload(), "pause_generation": self.pause_payload(), "flush_cache": True}

    def batched_end_payload(self) -> dict:
        return {"continue_generation": True}

    def update_payload(self, bucket: Bucket, version: str) -> dict:
        return {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                "group_name": self.group_name, "flush_cache": False, "weight_version": version,
                "load_format": FLATTENED_BUCKET if bucket.flat is not None else None}

    def _packs(self, group: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether a bucket goes packed (flattened_bucket) or per tensor, by `load_format`."""
        if self.load_format != AUTO_FORMAT:
            return self.load_format == FLATTENED_BUCKET
        return bucket_nbytes(group) < PACK_BELOW_BYTES * len(group)

    def init_group(self) -> None:
        """Every engine joins at its rank offset while this process joins as rank 0 (all concurrently); first any
        group of this name is left on both sides, and any weight-update session left open is closed: servers started
        elsewhere outlive a killed trainer (one killed mid-sync leaves its session open, which would refuse the next
        begin), this side's group lost a member when an engine restarted, and torch (so SGLang, as the embedded
        engine) refuses a group name that exists."""
        self.destroy_group()
        self._end_update(raise_errors=False)  # an engine without an open session refuses: nothing to close
        port = free_port_in(self.master_ports, "--weight-sync-port")
        offsets, world_size = sync_rank_offsets(self.engine_ranks)
        joining_error = None
        futures = self.engines.submit_each("/init_weights_update_group",
                                           [self.init_group_payload(port, offset, world_size) for offset in offsets])
        try:
            self.group = init_weight_update_group(self.backend, self.master_address, port, 0, world_size,
                                                  self.group_name, self.timeout_s)
        except Exception as error:  # a store timeout says only that someone did not join: the servers say why
            joining_error = error
        failures = self.engines.failures(futures)
        if failures:
            raise RolloutServerError("init_weights_update_group failed on " + "; ".join(failures)) from joining_error
        if joining_error is not None:
            raise joining_error

    def destroy_group(self, tell_engines: bool = True, abort: bool = False) -> None:
        """Leave the group; engines that cannot be reached (e.g. dead ones) are skipped. `abort`: work of this side
        is still pending (a failed update), so its communicator is aborted instead of destroyed."""
        if tell_engines:
            self.engines.leave_group(self.destroy_group_payload())
        if self.group is not None:
            (abort_weight_update_group if abort else destroy_weight_update_group)(self.group)
            self.group = None

    def _abort_group(self) -> None:
        """The tear-down after a refused update: the engines leave the group, then this side aborts its end."""
        self.destroy_group(abort=True)

    def _send_bucket(self, bucket: Bucket, version: str, clock: PhaseClock | None = None) -> None:
        """One bucket's update, posted, broadcast and answered before this returns (EngineCalls.send_bucket)."""
        self.engines.send_bucket(bucket, self.update_payload(bucket, version), self.group, self._abort_group, clock)

    def resend(self) -> SyncStats:
        """Sync the last synced weights again (after an engine restart); needs keep_host_copy=True."""
        if not self.keep_host_copy or self.last_version is None:
            raise RolloutServerError("resend() needs a WeightSyncer(keep_host_copy=True) that has synced once")
        return self.sync(list(self.host_copy), self.last_version)

    def _begin_update(self) -> None:
        self.engines.call_all("/begin_weight_update", self.begin_payload())

    def _end_update(self, raise_errors: bool) -> None:
        """Close the session on every engine; after a failure, an engine without one (its begin failed) is fine."""
        failures = self.engines.failures(self.engines.submit_all("/end_weight_update", {}))
        if failures and raise_errors:
            raise RolloutServerError("end_weight_update failed on " + "; ".join(failures))

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str) -> SyncStats:
        """pause → flush → begin → bucketed broadcast → end → continue → version check; returns timing (the whole
        sync and each phase, PHASES) and size. Engines that all offer weight_update_batching (learned from the
        version check's /model_info) get the batched sequence instead (_batched_sequence)."""
        if self.group is None:
            self.init_group()
        version = str(version)
        clock = PhaseClock()
        start = time.perf_counter()
        # the group's device (NCCL: this GPU; gloo: the host), wherever the tensors come from: a CUDA actor syncing
        # over gloo (the embedded engine, colocated SGLang), or resend()'s host copies over NCCL
        device = collectives.collective_device(self.backend)
        named_tensors = ((name, tensor.to(device)) for name, tensor in named_tensors)
        if self.keep_host_copy:
            kept: list[tuple[str, torch.Tensor]] = []
            named_tensors = ((name, kept.append((name, t.detach().to("cpu", copy=True))) or t)
                             for name, t in named_tensors)
        prefetcher = prefetch_buckets(named_tensors, self.bucket_bytes, self.timeout_s, self.staging,
                                      self.first_bucket_bytes, pack=self._packs)
        batched = self.batching
        try:
            with prefetcher:  # the first bucket is packed while the engines pause and flush
                sent = (self._batched_sequence if batched else self._sglang_sequence)(iter(prefetcher), version,
                                                                                       clock)
            self.staging.release_device_memory()
        except BaseException:
            self.staging = StagingBuffers()  # a bucket may not have come back to the pool
            raise
        with clock("version check"):
            reported = self.engines.reported_versions
            if not batched or len(reported) != len(self.urls) or None in reported:
                infos = self.engines.call_all("/model_info", None, "GET")
                reported = [info.get("weight_version") for info in infos]
                self.batching = all(info.get(BATCHING_FIELD) is True for info in infos)
        seconds = time.perf_counter() - start
        stale = [f"{url} reports {got!r}" for url, got in zip(self.urls, reported) if got != version]
        if stale:
            raise RolloutServerError(f"weight version {version!r} not reached after sync: " + "; ".join(stale))
        self.last_version = version
        if self.keep_host_copy:
            self.host_copy = kept
        return SyncStats(seconds=seconds, bytes=sum(bucket.nbytes for bucket in sent), buckets=len(sent),
                         tensors=sum(len(bucket.names) for bucket in sent), weight_version=version,
                         phases=clock.seconds)

    def _sglang_sequence(self, buckets: Iterator[Bucket], version: str, clock: PhaseClock) -> list[Bucket]:
        """SGLang's calls, one per step: pause → flush → begin → one update per bucket, each answered before the
        next → end (always) → continue (always, once paused). Returns the buckets sent."""
        with clock("pause"):
            self.engines.call_all("/pause_generation", self.pause_payload())
        try:
            with clock("flush"):
                self.engines.flush_all()
            sent, updated = [], False
            try:
                with clock("begin"):
                    self._begin_update()
                while True:
                    with clock("next bucket"):
                        bucket = next(buckets, None)
                    if bucket is None:
                        break
                    self._send_bucket(bucket, version, clock)
                    sent.append(bucket)
                updated = True
            finally:
                with clock("end"):
                    self._end_update(raise_errors=updated)
        finally:
            with clock("continue"):
                self.engines.call_all("/continue_generation", {})
        return sent

    def _batched_sequence(self, buckets: Iterator[Bucket], version: str, clock: PhaseClock) -> list[Bucket]:
        """The embedded engine's batched calls (weight_update_batching): one /begin_weight_update that also pauses
        and flushes (phase pause), the updates pipelined (EngineCalls.send_pipelined), whose answers carry the weight
        version, and one /end_weight_update that also continues (always; phase end). Returns the buckets sent."""
        updated = False
        try:
            with clock("pause"):
                self.engines.call_all("/begin_weight_update", self.batched_begin_payload())
            sent = self.engines.send_pipelined(buckets, lambda bucket: self.update_payload(bucket, version), self.group,
                                               self._abort_group, clock)
            updated = True
        finally:
            with clock("end"):
                failures = self.engines.failures(self.engines.submit_all("/end_weight_update",
                                                                         self.batched_end_payload()))
                if failures and updated:
                    raise RolloutServerError("end_weight_update failed on " + "; ".join(failures))
        return sent

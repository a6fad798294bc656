"""The engine calls of the trainer's weight sync (rollout/weight_sync.py's WeightSyncer), and the clock of its phases.

    control call ─► every engine at once (a thread each, kept for the syncer's life) ─► answers in url order
    bucket k:  POST /update_weights_from_distributed to every engine ‖ broadcast its tensors (Works, at once)
               ─► sent (this side's last byte out) ─► every engine's answer (its load by name; with
               weight_update_batching, its weight version)
    pipelined: bucket k+1 posted once k is sent; k's answers collected while k+1 travels

Invariants:
- the engines handle the buckets in order: a bucket is posted only once this side has sent the one before;
- a refusal of any bucket tears the group down (engines leave first, then this side aborts) with every later
  bucket's sends pending too, and raises naming each engine that refused;
- PhaseClock's phases are PHASES, in the order a sync runs them.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from megatron_dppo.platform import collectives
from megatron_dppo.rollout.client import RolloutServerError
from megatron_dppo.weight_update_protocol import Bucket

# The phases of a sync, in order, as SyncStats.phases times them (seconds, summed over buckets where per bucket):
# buckets: from posting a bucket's update until this side's last byte of it is sent; loads: from there until every
# engine has answered (its load by name, then its reply); next bucket: waiting for the prefetcher to have packed it.
PHASES = ("pause", "flush", "begin", "next bucket", "buckets", "loads", "end", "continue", "version check")


class PhaseClock:
    """Seconds per phase (PHASES), accumulated by `with clock("phase"): ...` or add()."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds


class InFlightUpdate:
    """One bucket's update on its way: every engine's answer (futures, in url order) and this side's broadcasts."""

    def __init__(self, payload: dict, futures: list[Future]):
        self.payload = payload
        self.futures = futures
        self.pending: list = []  # this side's broadcast Works, in order
        self.start = time.perf_counter()
        self.sent_at: list[float] = []  # when the last broadcast completed, once it has
        self.progress = threading.Event()  # set when the sends complete or an engine answers

    def mark_sent(self, _) -> None:
        self.sent_at.append(time.perf_counter())
        self.progress.set()


class EngineCalls:
    """WeightSyncer's calls to its engines: control calls to all at once, and bucket updates posted and broadcast
    (one at a time, or pipelined). Uses the syncer's urls, control, timeout_s, api_key, pool, group, update_payload
    and destroy_group, and records reported_versions (each engine's weight version from the last update's answers)."""

    def _submit_each(self, path: str, payloads: list[dict | None], method: str = "POST") -> list[Future]:
        """The control call to every engine, each with its payload, concurrently, on threads kept for the syncer's
        life (a pool per call would start a thread per engine per call)."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(len(self.urls), thread_name_prefix="weight-sync-control")
        return [self.pool.submit(self.control, url, path, payload, method, self.timeout_s, self.api_key)
                for url, payload in zip(self.urls, payloads)]

    def _submit_all(self, path: str, payload: dict | None = None, method: str = "POST") -> list[Future]:
        """The same control call to every engine, concurrently (see _submit_each)."""
        return self._submit_each(path, [payload] * len(self.urls), method)

    def _failures(self, futures: list[Future]) -> list[str]:
        """'url: error' of each engine whose call (one future per engine, in url order) raised; waits for all."""
        return [f"{url}: {error}" for url, future in zip(self.urls, futures)
                if (error := future.exception()) is not None]

    def _call_all(self, path: str, payload: dict | None = None, method: str = "POST") -> list:
        if len(self.urls) == 1:  # in this thread: nothing to wait for but the answer
            return [self.control(self.urls[0], path, payload, method, self.timeout_s, self.api_key)]
        return [future.result() for future in self._submit_all(path, payload, method)]

    def _send_bucket(self, bucket: Bucket, version: str, clock: PhaseClock | None = None) -> None:
        """One bucket, not pipelined: post its update and broadcast it (phase buckets), then wait for every engine's
        answer (phase loads)."""
        clock = clock or PhaseClock()
        with clock("buckets"):
            update = self._start_update(self.update_payload(bucket, version), bucket.broadcasts)
            self._wait_sent(update, [])
        with clock("loads"):
            self._finish_update(update)

    def _send_pipelined(self, buckets: Iterator[Bucket], version: str, clock: PhaseClock) -> list[Bucket]:
        """Every bucket, each posted once this side has sent the one before (whose engines are handling it by then,
        so the engines handle the buckets in order), and the answer to the one before collected while it travels:
        an engine's load of bucket k and its reply overlap the post and broadcast of bucket k + 1. Returns the
        buckets sent."""
        sent, previous = [], None
        while True:
            with clock("next bucket"):
                bucket = next(buckets, None)
            if bucket is None:
                break
            with clock("buckets"):
                update = self._start_update(self.update_payload(bucket, version), bucket.broadcasts)
            if previous is not None:
                with clock("loads"):
                    self._finish_update(previous, [update])
            with clock("buckets"):
                self._wait_sent(update, [])
            sent.append(bucket)
            previous = update
        if previous is not None:
            with clock("loads"):
                self._finish_update(previous)
        return sent

    def _start_update(self, payload: dict, tensors: list[torch.Tensor]) -> InFlightUpdate:
        """POST /update_weights_from_distributed to every engine and broadcast `tensors` in order (Works, at once)."""
        update = InFlightUpdate(payload, self._submit_all("/update_weights_from_distributed", payload))
        what = f"weight bucket {payload['names'][0]} .. {payload['names'][-1]}"
        update.pending = [collectives.broadcast(self.group, tensor, 0, what) for tensor in tensors]
        if update.pending:
            update.pending[-1].get_future().add_done_callback(update.mark_sent)
        else:
            update.mark_sent(None)
        for future in update.futures:  # an engine that refuses answers without receiving: wake the sender too
            future.add_done_callback(lambda _: update.progress.set())
        return update

    def _wait_sent(self, update: InFlightUpdate, later: list[InFlightUpdate]) -> None:
        """Until this side has sent every byte of `update` (its engines are then handling it, so a request posted
        next is handled after it), or an engine has refused it (which fails the sync: _finish_update raises)."""
        while True:
            update.progress.clear()
            if update.sent_at:
                return
            if any(future.done() and future.exception() is not None for future in update.futures):
                self._finish_update(update, later)
            update.progress.wait(0.1)

    def _finish_update(self, update: InFlightUpdate, later: list[InFlightUpdate] = ()) -> None:
        """Wait for every engine's answer to `update`; if any refuses, tear the group down (see the module docstring;
        `later`: updates posted after it, whose sends are pending too) and raise. Records each engine's reported
        weight version where its answer gives one (an engine with weight_update_batching)."""
        refusals = self._failures(update.futures)
        if refusals:
            self._tear_down_after_failed_update([work for u in (update, *later) for work in u.pending])
            for other in later:  # their requests fail once the engines left the group; let them end
                self._failures(other.futures)
            raise RolloutServerError(
                "update_weights_from_distributed failed on " + "; ".join(refusals) + "; the weight update group "
                "was torn down and the next sync builds a new one")
        for work in update.pending:
            work.wait()
        self.reported_versions = [answer.get("weight_version") if isinstance(answer, dict) else None
                                  for answer in (future.result() for future in update.futures)]

    def _tear_down_after_failed_update(self, pending: list) -> None:
        """The engines leave the group first (an engine's end closes, so this side's pending sends fail instead of
        waiting for a receive that never comes), then this side aborts; the sends' errors are the expected ones."""
        self.destroy_group(abort=True)
        for work in pending:
            try:
                work.wait(datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError:
                pass  # "connection closed by peer" (gloo) or the abort (NCCL): the send ended

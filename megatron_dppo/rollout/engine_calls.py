"""The engine calls of the trainer's weight sync (rollout/weight_sync.py's WeightSyncer holds an EngineCalls), and
the clock of its phases.

    EngineCalls(urls, control, timeout_s, api_key): the syncer's engines and how a control route reaches one
    control call ─► every engine at once (a thread each, kept for the EngineCalls' life) ─► answers in url order
    bucket k (the syncer hands over its payload, the group, and how to tear the group down):
               POST /update_weights_from_distributed to every engine ‖ broadcast its tensors on the group (Works)
               ─► sent (this side's last byte out) ─► every engine's answer (its load by name; with
               weight_update_batching, its weight version)
    pipelined: bucket k+1 posted once k is sent; k's answers collected while k+1 travels

Invariants:
- the engines handle the buckets in order: a bucket is posted only once this side has sent the one before;
- a refusal of any bucket tears the group down (the send's tear_down: engines leave first, then this side aborts)
  with every later bucket's sends pending too, and raises naming each engine that refused;
- PhaseClock's phases are PHASES, in the order a sync runs them.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

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
    """A weight syncer's calls to its engines: control calls to all at once (the flush and the group leave one engine
    after another), and bucket updates posted and broadcast (one at a time, or pipelined). It owns the threads the
    calls run on; the group a bucket is broadcast on and how to tear it down come with each send. reported_versions:
    each engine's weight version from the last update's answers (a pipelined send starts with none)."""

    def __init__(self, urls: list[str], control: Callable[..., Any], timeout_s: float, api_key: str | None):
        """control: how a control route reaches a server, `control(url, path, payload, method, timeout_s, api_key)`."""
        self.urls = urls
        self.control = control
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.pool: ThreadPoolExecutor | None = None  # started by the first concurrent call
        self.reported_versions: list[str | None] = []

    def submit_each(self, path: str, payloads: list[dict | None], method: str = "POST") -> list[Future]:
        """The control call to every engine, each with its payload, concurrently, on threads kept for this object's
        life (a pool per call would start a thread per engine per call)."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(len(self.urls), thread_name_prefix="weight-sync-control")
        return [self.pool.submit(self.control, url, path, payload, method, self.timeout_s, self.api_key)
                for url, payload in zip(self.urls, payloads)]

    def submit_all(self, path: str, payload: dict | None = None, method: str = "POST") -> list[Future]:
        """The same control call to every engine, concurrently (see submit_each)."""
        return self.submit_each(path, [payload] * len(self.urls), method)

    def failures(self, futures: list[Future]) -> list[str]:
        """'url: error' of each engine whose call (one future per engine, in url order) raised; waits for all."""
        return [f"{url}: {error}" for url, future in zip(self.urls, futures)
                if (error := future.exception()) is not None]

    def call_all(self, path: str, payload: dict | None = None, method: str = "POST") -> list:
        """The same control call to every engine; their answers in url order, or the first engine's error."""
        if len(self.urls) == 1:  # in this thread: nothing to wait for but the answer
            return [self.control(self.urls[0], path, payload, method, self.timeout_s, self.api_key)]
        return [future.result() for future in self.submit_all(path, payload, method)]

    def flush_all(self) -> None:
        """GET /flush_cache on each engine in turn, retried until the timeout while it refuses."""
        deadline = time.monotonic() + self.timeout_s
        for url in self.urls:
            while True:
                try:
                    self.control(url, "/flush_cache", None, "GET", self.timeout_s, self.api_key)
                    break
                except RolloutServerError:
                    if time.monotonic() > deadline:  # SGLang refuses to flush while requests are running
                        raise
                    time.sleep(0.2)

    def leave_group(self, payload: dict) -> None:
        """/destroy_weights_update_group (`payload` names the group) on each engine in turn; engines that refuse or
        cannot be reached (e.g. dead ones) are skipped."""
        for url in self.urls:
            try:
                # the whole timeout: an engine still receiving a dead trainer's broadcast holds its model lock until
                # its group times out, and a group it still holds would refuse the new one
                self.control(url, "/destroy_weights_update_group", payload, timeout_s=self.timeout_s,
                             api_key=self.api_key)
            except RolloutServerError:
                pass  # an engine without the group (a new or restarted one) refuses; a dead one cannot answer

    def send_bucket(self, bucket: Bucket, payload: dict, group, tear_down: Callable[[], None],
                    clock: PhaseClock | None = None) -> None:
        """One bucket, not pipelined: post its update (`payload`) and broadcast it on `group` (phase buckets), then
        wait for every engine's answer (phase loads). `tear_down()`: the group's tear-down, once an engine refused."""
        clock = clock or PhaseClock()
        with clock("buckets"):
            update = self._start_update(payload, bucket.broadcasts, group)
            self._wait_sent(update, [], tear_down)
        with clock("loads"):
            self._finish_update(update, [], tear_down)

    def send_pipelined(self, buckets: Iterator[Bucket], payload: Callable[[Bucket], dict], group,
                       tear_down: Callable[[], None], clock: PhaseClock) -> list[Bucket]:
        """Every bucket, each posted (`payload(bucket)`) once this side has sent the one before (whose engines are
        handling it by then, so the engines handle the buckets in order), and the answer to the one before collected
        while it travels: an engine's load of bucket k and its reply overlap the post and broadcast of bucket k + 1.
        `group` and `tear_down` as in send_bucket. Returns the buckets sent."""
        self.reported_versions = []
        sent, previous = [], None
        while True:
            with clock("next bucket"):
                bucket = next(buckets, None)
            if bucket is None:
                break
            with clock("buckets"):
                update = self._start_update(payload(bucket), bucket.broadcasts, group)
            if previous is not None:
                with clock("loads"):
                    self._finish_update(previous, [update], tear_down)
            with clock("buckets"):
                self._wait_sent(update, [], tear_down)
            sent.append(bucket)
            previous = update
        if previous is not None:
            with clock("loads"):
                self._finish_update(previous, [], tear_down)
        return sent

    def _start_update(self, payload: dict, tensors: list[torch.Tensor], group) -> InFlightUpdate:
        """POST /update_weights_from_distributed to every engine and broadcast `tensors` in order (Works, at once)."""
        update = InFlightUpdate(payload, self.submit_all("/update_weights_from_distributed", payload))
        what = f"weight bucket {payload['names'][0]} .. {payload['names'][-1]}"
        update.pending = [collectives.broadcast(group, tensor, 0, what) for tensor in tensors]
        if update.pending:
            update.pending[-1].get_future().add_done_callback(update.mark_sent)
        else:
            update.mark_sent(None)
        for future in update.futures:  # an engine that refuses answers without receiving: wake the sender too
            future.add_done_callback(lambda _: update.progress.set())
        return update

    def _wait_sent(self, update: InFlightUpdate, later: list[InFlightUpdate], tear_down: Callable[[], None]) -> None:
        """Until this side has sent every byte of `update` (its engines are then handling it, so a request posted
        next is handled after it), or an engine has refused it (which fails the sync: _finish_update raises)."""
        while True:
            update.progress.clear()
            if update.sent_at:
                return
            if any(future.done() and future.exception() is not None for future in update.futures):
                self._finish_update(update, later, tear_down)
            update.progress.wait(0.1)

    def _finish_update(self, update: InFlightUpdate, later: list[InFlightUpdate],
                       tear_down: Callable[[], None]) -> None:
        """Wait for every engine's answer to `update`; if any refuses, tear the group down (see the module docstring;
        `later`: updates posted after it, whose sends are pending too) and raise. Records each engine's reported
        weight version where its answer gives one (an engine with weight_update_batching)."""
        refusals = self.failures(update.futures)
        if refusals:
            self._tear_down_after_failed_update(tear_down, [work for u in (update, *later) for work in u.pending])
            for other in later:  # their requests fail once the engines left the group; let them end
                self.failures(other.futures)
            raise RolloutServerError(
                "update_weights_from_distributed failed on " + "; ".join(refusals) + "; the weight update group "
                "was torn down and the next sync builds a new one")
        for work in update.pending:
            work.wait()
        self.reported_versions = [answer.get("weight_version") if isinstance(answer, dict) else None
                                  for answer in (future.result() for future in update.futures)]

    def _tear_down_after_failed_update(self, tear_down: Callable[[], None], pending: list) -> None:
        """`tear_down()`: the engines leave the group first (an engine's end closes, so this side's pending sends fail
        instead of waiting for a receive that never comes), then this side aborts; the sends' errors are expected."""
        tear_down()
        for work in pending:
            try:
                work.wait(datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError:
                pass  # "connection closed by peer" (gloo) or the abort (NCCL): the send ended

"""Math reward: final-answer extraction → exact match → math-verify equivalence, under a hard deadline.

    response ──► extract_final_answer ──► normalised strings equal? ──yes──► 1
                 (last \\boxed{}/\\fbox{},            │ no
                  "the answer is", ####,             ▼
                  last number)               VerifierPool worker: math-verify parse + verify
                                             (killed and replaced when it overruns its deadline) ──► 1 / 0

Invariants
- A score is 1 only when an answer was extracted and it equals the reference (string match after a mild
  normalisation, or math-verify equivalence); everything else, timeouts and crashes included, scores 0 (or the
  optional `format_reward` when a wrong answer was at least given in \\boxed{}).
- No check can stall the caller: math-verify runs in worker processes, where its own signal-based timeout works
  (the worker's main thread), and the parent kills a worker that overruns `ceil(timeout_s) + HARD_DEADLINE_GRACE_S`
  (C-level big-integer arithmetic ignores signals). The parent never uses signals, so the pool can be driven from
  any thread or process.
- The workers are `python -m megatron_dppo.rewards.verifier_worker` processes: they never import the caller's main
  module, so compute_score works from a script on standard input or one without a main guard; a worker that dies
  at start is reported with its own output.
"""

import atexit
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from megatron_dppo.answers import extract_final_answer

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
# Extra seconds the parent waits past math-verify's own timeout before it kills the worker.
HARD_DEADLINE_GRACE_S = 2.0
WORKER_STARTUP_TIMEOUT_S = 120.0

_WHOLE_TEXT = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{(.*)\}$", re.DOTALL)
_SIZED_DELIMITER = re.compile(r"\\(?:left|right)(?![A-Za-z])")  # \left( but not \leftarrow
_NORMALISE_DROP = ("\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\%", "%", "\\$")


@dataclass(frozen=True)
class ScoreResult:
    """A reward with what was parsed and why, for logs."""

    score: float
    answer: str | None  # the extracted final answer, None when nothing was found
    source: str  # where the answer came from: boxed | answer-is | #### | last-number | none
    reason: str  # exact-match | math-verify-equal | math-verify-different | math-verify-unparsable | no-answer
    #              | timeout | error: <what>


def normalize_answer(answer: str) -> str:
    """A mild canonical form used for exact matching and for majority voting; never decides inequality."""
    text = answer.strip().strip("$").strip()
    whole_text = _WHOLE_TEXT.match(text)
    if whole_text:
        text = whole_text.group(1)
    text = _SIZED_DELIMITER.sub("", text)
    for token in _NORMALISE_DROP:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return "".join(text.split()).rstrip(".")


class _Worker:
    """A verifier_worker process and the two pipe ends the parent keeps; its output goes to a temporary file that
    is read back when it dies, so its own error can be reported."""

    def __init__(self, timeout_seconds: int):
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        self.output = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", "megatron_dppo.rewards.verifier_worker", str(request_read), str(reply_write),
             str(timeout_seconds)],
            pass_fds=(request_read, reply_write), stdin=subprocess.DEVNULL, stdout=self.output,
            stderr=subprocess.STDOUT, env=_worker_environment())
        os.close(request_read)
        os.close(reply_write)
        self.requests = Connection(request_write, readable=False)
        self.replies = Connection(reply_read, writable=False)

    def wait_ready(self) -> None:
        if not self.replies.poll(WORKER_STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(
                f"a math-verify worker process did not start within {WORKER_STARTUP_TIMEOUT_S:.0f} s; check that "
                "the machine is not out of memory or overloaded")
        try:
            if self.replies.recv() == "ready":
                return
        except EOFError:
            pass
        exit_code = self.process.wait()
        output = self.last_output()
        self.kill()
        raise RuntimeError(f"a math-verify worker process exited at start (exit code {exit_code}); its output ends "
                           f"with:\n{output}")

    def last_output(self, characters: int = 4000) -> str:
        self.output.seek(0)
        return self.output.read().decode(errors="replace")[-characters:]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.requests.close()
        self.replies.close()
        self.output.close()


def _worker_environment() -> dict[str, str]:
    """The caller's environment, with this package importable in the worker however the caller found it (an
    installed package, PYTHONPATH, or a sys.path entry added by the calling script)."""
    package_parent = str(Path(__file__).resolve().parents[2])
    inherited = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([package_parent, inherited] if inherited else [package_parent])}


class VerifierPool:
    """Worker processes that run math-verify, one pair each at a time, each under a hard deadline.

    `verify(pairs)` is thread-safe (calls are serialised); a worker that overruns its deadline or dies is
    killed and replaced, and its pair is reported as a timeout or error instead of blocking the batch.
    """

    def __init__(self, num_workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.num_workers = num_workers or min(4, os.cpu_count() or 1)
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {self.num_workers}")
        self.timeout_s = timeout_s
        self._soft_timeout_seconds = max(1, math.ceil(timeout_s))  # math-verify takes whole seconds
        self._hard_deadline_s = self._soft_timeout_seconds + HARD_DEADLINE_GRACE_S
        self._workers = [_Worker(self._soft_timeout_seconds) for _ in range(self.num_workers)]
        for worker in self._workers:  # started together, waited on in turn
            worker.wait_ready()
        self._lock = threading.Lock()

    def worker_pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers]

    def verify(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[bool | None, str]]:
        """(equal, reason) per (answer, reference) pair; equal is None on timeout."""
        with self._lock:
            if not self._workers:
                raise RuntimeError("VerifierPool.verify called after close(); create a new pool")
            return self._run(pairs)

    def _run(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[bool | None, str]]:
        results: list[tuple[bool | None, str] | None] = [None] * len(pairs)
        pending = deque(range(len(pairs)))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (pair index, deadline)
        while pending or busy:
            for slot in range(len(self._workers)):
                if slot not in busy and pending:
                    if self._workers[slot].process.poll() is not None:
                        self._replace(slot)
                    index = pending.popleft()
                    self._workers[slot].requests.send(pairs[index])
                    busy[slot] = (index, time.monotonic() + self._hard_deadline_s)
            nearest_deadline = min(deadline for _, deadline in busy.values())
            wait([self._workers[slot].replies for slot in busy], max(0.0, nearest_deadline - time.monotonic()))
            for slot in list(busy):
                index, deadline = busy.pop(slot)
                replies = self._workers[slot].replies
                # poll() again rather than trusting wait(): a replacement below may take seconds.
                if replies.poll():
                    try:
                        results[index] = replies.recv()
                    except (EOFError, OSError):
                        results[index] = (False, "error: verifier worker died")
                        logger.warning("math reward: a verifier worker died during a check; its output ends with:\n%s",
                                       self._workers[slot].last_output())
                        self._replace(slot)
                elif time.monotonic() >= deadline:
                    results[index] = (None, "timeout")
                    self._replace(slot)
                else:
                    busy[slot] = (index, deadline)
        return results  # type: ignore[return-value]

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self._soft_timeout_seconds)
        self._workers[slot].wait_ready()

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                worker.kill()
            self._workers = []

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


_default_pool: VerifierPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> VerifierPool:
    """The process-wide pool used when no pool is passed; started on first use, closed at exit."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = VerifierPool()
            atexit.register(_default_pool.close)
        return _default_pool


def score_batch(
    responses: Sequence[str],
    references: Sequence[str],
    pool: VerifierPool | None = None,
    format_reward: float = 0.0,
) -> list[ScoreResult]:
    """Score many responses; pairs that need math-verify go to the pool in one batch."""
    if len(responses) != len(references):
        raise ValueError(f"got {len(responses)} responses but {len(references)} references; pass one reference each")
    results: list[ScoreResult | None] = [None] * len(responses)
    to_verify: list[int] = []
    extracted: list[tuple[str | None, str]] = []
    for index, (response, reference) in enumerate(zip(responses, references)):
        answer, source = extract_final_answer(response)
        extracted.append((answer, source))
        if answer is None:
            results[index] = ScoreResult(0.0, None, source, "no-answer")
        elif normalize_answer(answer) == normalize_answer(str(reference)):
            results[index] = ScoreResult(1.0, answer, source, "exact-match")
        else:
            to_verify.append(index)
    if to_verify:
        pool = pool or default_pool()
        verdicts = pool.verify([(extracted[i][0], str(references[i])) for i in to_verify])
        for index, (equal, reason) in zip(to_verify, verdicts):
            answer, source = extracted[index]
            if equal:
                score = 1.0
            else:
                score = format_reward if source == "boxed" else 0.0
            if equal is None:
                logger.warning(
                    "math reward: verification of answer %.80r against %.80r timed out after %.1f s; scored 0",
                    answer,
                    references[index],
                    pool.timeout_s,
                )
            results[index] = ScoreResult(score, answer, source, reason)
    return results  # type: ignore[return-value]


def score_with_details(
    response: str, reference: str, pool: VerifierPool | None = None, format_reward: float = 0.0
) -> ScoreResult:
    """compute_score with the parsed answer, where it came from, and the reason."""
    return score_batch([response], [reference], pool=pool, format_reward=format_reward)[0]


def compute_score(response: str, reference: str, pool: VerifierPool | None = None, format_reward: float = 0.0) -> float:
    """1.0 when the response's final answer is equivalent to `reference` (an answer, not a solution), else 0.0.

    `format_reward` (default 0) is given instead of 0 to a wrong answer that was written in \\boxed{}.
    """
    return score_with_details(response, reference, pool=pool, format_reward=format_reward).score

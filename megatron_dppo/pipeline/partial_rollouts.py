"""Partial rollouts (--partial-rollout): a step's rollout no longer waits for its longest response.

    each step: admit drawn batches ("cohorts": one draw, the prompt level's decision, G samples per kept prompt) until
    --partial-rollout-max-staleness + 1 are open, oldest first
    ─► chunks: every unfinished sample of every open cohort adds at most --partial-rollout-chunk-tokens tokens,
       continued from its prompt + the tokens it has, carrying the seed it was drawn with (one request per chunk;
       the vLLM backend derives each chunk's own seed from it)
    ─► after each chunk, and before the first: is the oldest cohort whole (every sample finished)? then the step
       closes its rollout, the oldest cohort is rewarded and trains as this step's Rollouts (experience.make); the
       others stay open, their tokens carried into the next step, which continues them under the new weights

Why cohorts: a cohort is trained whole, so its advantages (full groups), its DPPO full-batch counts (fixed at its
draw), the DAPO filter and the completion level see exactly what a synchronous step sees, and nothing is selected by
length: a long response is trained with its own cohort, only later. Steady state: each step trains one cohort and
admits one, and a cohort's decode iterations are spread over the S + 1 steps it is open, so a step runs about
1 / (S + 1) of the iterations its longest response needs (the fixed share of a synchronous step, docs/results.md).

Invariants:
- every started sample is trained exactly once, with its cohort, or counted as discarded: restarted (its tokens
  dropped) when a carried sample is past the staleness bound, or still open when the run ends;
- every generated token keeps the log-prob the engine gave it and the weight version that sampled it; the loss
  corrects the older ones with the rollout correction (--rollout-correction, token TIS by default);
- staleness: a token is at most S = --partial-rollout-max-staleness versions older than the weights that train on
  it (a cohort drawn at step t trains at step t + S at the latest); a carried sample past it (a run resumed with a
  smaller S) is restarted, never trained stale;
- deterministic: the close is decided between chunks from the tokens alone (no wall-clock abort) and each sample's
  seed is fixed at its draw, so the same weights give the same tokens, and a resumed run (the open cohorts are in
  the checkpoint) continues exactly as the straight one.
"""

import time
from dataclasses import dataclass, field

from megatron_dppo.algo.pruning import PromptDecision
from megatron_dppo.rollout.client import SamplingParams, SequenceRequest


@dataclass
class PartialSample:
    """One sample in flight: its response so far, each token's log-prob and the weight version that sampled it."""

    prompt_ids: list[int]
    seed: int
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    finished: bool = False
    restarts: int = 0
    finish_reason: str = ""  # its last chunk's: once finished, how the sample ended ("stop", "length")

    def request(self, chunk_tokens: int, max_response_len: int) -> SequenceRequest:
        remaining = max_response_len - len(self.output_ids)
        return SequenceRequest(self.prompt_ids + self.output_ids, self.seed, min(chunk_tokens, remaining))

    def extend(self, output_ids: list[int], output_logprobs: list[float], version: int, asked: int,
               finish_reason: str, max_response_len: int) -> None:
        """Append one chunk. Finished: it stopped (a stop token), reached the response limit, or the server gave
        fewer tokens than asked for a length reason (the model's context); an aborted chunk keeps its tokens and
        the sample continues."""
        self.output_ids += output_ids
        self.output_logprobs += output_logprobs
        self.output_versions += [version] * len(output_ids)
        self.finish_reason = finish_reason
        self.finished = (finish_reason == "stop" or len(self.output_ids) >= max_response_len
                         or (finish_reason == "length" and len(output_ids) < asked))

    def restart(self) -> int:
        """Drop its tokens (generated again from the prompt, with the same seed); returns how many were dropped."""
        dropped = len(self.output_ids)
        self.output_ids, self.output_logprobs, self.output_versions = [], [], []
        self.finished, self.restarts, self.finish_reason = False, self.restarts + 1, ""
        return dropped


@dataclass
class Cohort:
    """One step's draw: the prompts the prompt level kept, its decision, and their samples in (prompt, sample)
    order."""

    cohort_id: int  # its draw's index (a synchronous run's step): its pruning coins and sampling seeds
    version: int  # the weight version when it was admitted (it trains at most max_staleness versions later)
    prompts: list
    decision: PromptDecision
    num_drawn: int
    capacity: int
    samples: list[PartialSample]

    @property
    def whole(self) -> bool:
        return all(sample.finished for sample in self.samples)


@dataclass
class PartialConfig:
    chunk_tokens: int = 64
    max_staleness: int = 1
    max_response_len: int = 1024

    def __post_init__(self):
        if self.chunk_tokens < 1 or self.max_staleness < 0 or self.max_response_len < 1:
            raise ValueError(f"partial rollouts need chunk_tokens >= 1 ({self.chunk_tokens}), max_staleness >= 0 "
                             f"({self.max_staleness}) and max_response_len >= 1 ({self.max_response_len})")


class PartialRollouts:
    """rank 0: the open cohorts, carried from step to step (module docstring)."""

    def __init__(self, config: PartialConfig, client):
        self.config, self.client = config, client
        self.open: list[Cohort] = []
        self.next_id: int | None = None  # the next cohort's draw index; set from the first step it runs at
        self.counts = {"samples_started": 0, "samples_trained": 0, "samples_restarted": 0,
                       "tokens_discarded": 0}

    def cohort_to_admit(self, step: int) -> int | None:
        """The draw index of the next cohort to open at `step`, or None while S + 1 are open. Draw indices count
        on from the first step, so with S = 0 a cohort's index is its step, as in a synchronous run."""
        if len(self.open) >= self.config.max_staleness + 1:
            return None
        if self.next_id is None:
            self.next_id = step
        return self.next_id

    def admit(self, cohort_id: int, version: int, prompts: list, decision: PromptDecision, num_drawn: int,
              capacity: int, sampling: SamplingParams, group: int) -> None:
        """Open a cohort for draw `cohort_id`; sample j of kept prompt i gets the seed a synchronous step would give
        it (sampling: that draw's)."""
        if cohort_id != self.next_id:
            raise RuntimeError(f"cohort {cohort_id} admitted where {self.next_id} was next (cohort_to_admit)")
        samples = [PartialSample(list(prompt.input_ids), sampling.sample_seed(index, sample_index, group))
                   for index, prompt in enumerate(prompts) for sample_index in range(group)]
        self.open.append(Cohort(cohort_id, version, prompts, decision, num_drawn, capacity, samples))
        self.next_id = cohort_id + 1
        self.counts["samples_started"] += len(samples)

    def enforce_staleness(self, version: int) -> dict:
        """Restart every sample holding a token older than `version` - S (the weights about to train or continue
        it), finished or not. In a run that keeps its bound none is: a cohort trains S versions after it opened."""
        restarted = dropped = 0
        for cohort in self.open:
            for sample in cohort.samples:
                if sample.output_versions and min(sample.output_versions) < version - self.config.max_staleness:
                    dropped += sample.restart()
                    restarted += 1
        self.counts["samples_restarted"] += restarted
        self.counts["tokens_discarded"] += dropped
        return {"partial_samples_restarted": float(restarted), "partial_tokens_discarded": float(dropped)}

    def run_until_oldest_whole(self, sampling: SamplingParams, version: int) -> tuple[Cohort, dict]:
        """Generate chunks for every unfinished sample until the oldest cohort is whole; pop and return it."""
        if not self.open:
            raise RuntimeError("no open cohort: admit one before generating")
        start = time.perf_counter()
        chunks = tokens = iterations = 0
        carried = sum(not s.finished and len(s.output_ids) > 0 for cohort in self.open for s in cohort.samples)
        while not self.open[0].whole:
            pending = [s for cohort in self.open for s in cohort.samples if not s.finished]
            requests = [s.request(self.config.chunk_tokens, self.config.max_response_len) for s in pending]
            completions = self.client.generate_requests(requests, sampling)
            if len(completions) != len(pending):
                raise RuntimeError(f"the rollout servers returned {len(completions)} samples for {len(pending)} "
                                   "requests: a server dropped requests")
            for sample, request, completion in zip(pending, requests, completions):
                sample.extend(completion.output_ids, completion.output_logprobs, version, request.max_new_tokens,
                              completion.finish_reason, self.config.max_response_len)
                tokens += len(completion.output_ids)
            chunks += 1
            iterations += max((len(completion.output_ids) for completion in completions), default=0)
        cohort = self.open.pop(0)
        self.counts["samples_trained"] += len(cohort.samples)
        in_flight = [s for c in self.open for s in c.samples if not s.finished]
        stats = {"partial_chunks": float(chunks), "decode_iterations": float(iterations),
                 "partial_open_cohorts": float(len(self.open)),
                 "partial_samples_resumed": float(carried),
                 "partial_samples_carried": float(len(in_flight)),
                 "partial_tokens_carried": float(sum(len(s.output_ids) for s in in_flight)),
                 "partial_cohort_age": float(version - cohort.version)}
        return cohort, {"seconds": time.perf_counter() - start, "tokens": tokens, **stats}

    def samples_in_flight(self) -> int:
        """Samples started and not trained: discarded if the run ends now."""
        return sum(len(cohort.samples) for cohort in self.open)

    def state_dict(self) -> dict:
        return {"open": self.open, "counts": dict(self.counts), "next_id": self.next_id}

    def load_state_dict(self, state: dict) -> None:
        """The open cohorts of a checkpoint; a run resumed with a smaller bound restarts, at its next step, the
        carried samples that bound refuses (enforce_staleness)."""
        self.open, self.counts, self.next_id = list(state["open"]), dict(state["counts"]), state["next_id"]

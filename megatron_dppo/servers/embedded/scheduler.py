"""The embedded engine's scheduler: a queue of sequences, batched and generated on decode workers.

    requests ──► run(sequences): queue ──► batch loop (until a quiet millisecond, at most `batch_window_s`; at most
                 max_batch_size rows whose cache fits max_total_tokens) ──► split over the decode workers ──► each:
                 BatchGenerator.generate: prefill (what the prefix cache holds is copied, not computed), then one
                 position per step from its KV cache (decoder.py), every row sampled at once (sampling.py)
    pause    ──► the running batch stops at its next step ──► abort: its unfinished sequences and the queue end with
                 finish_reason "abort" | retract: they go back to the front of the queue with their tokens, resumed
                 on continue

Invariants:
- one batch at a time holds the model lock, which the weight routes take to load weights: generation and weight
  loading never overlap;
- a batch is split over the workers as a function of the batch alone, and a seeded sample's randomness depends on
  its seed and position only (sampling.py): the same request gives the same samples;
- a row that stops at its token budget leaves the K/V of its tokens in the prefix cache, for the request that
  continues it; a row that scores its prompt takes nothing from the cache (it needs every position's hidden state).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_dppo.servers.embedded.decoder import KVCacheDecoder
from megatron_dppo.servers.embedded.prefix_cache import PrefixCache
from megatron_dppo.servers.embedded.request_parser import RequestError, Sequence
from megatron_dppo.servers.embedded.sampling import sample_next_tokens, sample_uniforms, seed_words

# Below this many sequences per worker, splitting a batch costs more (smaller matmuls, a second prefill of shared
# prompts) than a second core gives back.
MIN_ROWS_PER_WORKER = 16
# The rows one batch decodes at most (--max-batch-size's default): rows beyond wait, in order, for the next batch.
MAX_BATCH_SIZE = 256


class BatchGenerator:
    """Generates one batch on the calling thread: prefill, then the sampling loop, one position per step."""

    def __init__(self, decoder: KVCacheDecoder, prefix_cache: PrefixCache, eos_token_ids: set[int],
                 max_positions: int | None, seed: int):
        """seed: the generator of unseeded samples (a seeded one draws from its own seed and position only)."""
        self.decoder = decoder
        self.prefix_cache = prefix_cache
        self.eos_token_ids = eos_token_ids
        self.max_positions = max_positions
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def generate(self, batch: list[Sequence], interrupt: threading.Event) -> None:
        """Run the sampling loop for `batch` until each sequence finishes or `interrupt` (a pause) is set.

        The batch's tokens and log-probs are kept in tensors and handed to the sequences once, at the end (also when
        a pause interrupts it: a retracted sequence resumes after the tokens it has)."""
        for seq in batch:  # nothing left to generate (e.g. max_new_tokens 0 for prompt scoring)
            if seq.finish_reason is None and len(seq.output_ids) >= seq.params.max_new_tokens:
                seq.finish_reason = {"type": "length", "length": seq.params.max_new_tokens}
        contexts = [seq.prompt_ids + seq.output_ids for seq in batch]
        budgets = torch.tensor([0 if seq.finish_reason else seq.token_budget(self.max_positions) for seq in batch])
        # a row that scores its prompt needs every prompt position's hidden state: it takes nothing from the cache
        prefixes = [None if self._scores_prompt(seq) else self.prefix_cache.lookup(context)
                    for seq, context in zip(batch, contexts)]
        state, hidden = self.decoder.prefill(contexts, prefixes=prefixes)
        for row, seq in enumerate(batch):
            if self._scores_prompt(seq):
                context_logits = self.decoder.logits(hidden[row, hidden.shape[1] - len(contexts[row]):])
                seq.input_logprobs = self._prompt_logprobs(context_logits, seq)
        rows = (budgets > 0).nonzero().squeeze(1)  # batch index of each row of the cache
        if len(rows) == 0:
            return
        if len(rows) < len(batch):
            self.decoder.keep(state, rows)
        next_logits = self.decoder.logits(hidden[rows, -1])  # [rows, V]
        del hidden

        max_budget = int(budgets.max())
        temperature, top_p, top_k, uniforms, stop_table = self._row_settings(batch, contexts, max_budget)
        tokens_out = torch.zeros(len(batch), max_budget, dtype=torch.long)  # [B, budget]
        logprobs_out = torch.zeros(tokens_out.shape, dtype=torch.float32)
        produced = torch.zeros(len(batch), dtype=torch.long)
        stopped = torch.zeros(len(batch), dtype=torch.bool)
        running = torch.ones(len(rows), dtype=torch.bool)  # per cache row: still generating
        try:
            while True:
                if interrupt.is_set():
                    return  # the pause handler decides what happens to unfinished sequences
                # a finished row still in the cache has produced its budget: it reads the last uniform, unused
                step_uniforms = uniforms[rows, produced[rows].clamp(max=max_budget - 1)]
                tokens, token_logprobs = sample_next_tokens(next_logits, temperature[rows], top_p[rows], top_k[rows],
                                                            step_uniforms)
                live = running.nonzero().squeeze(1)
                batch_rows = rows[live]
                tokens_out[batch_rows, produced[batch_rows]] = tokens[live]
                logprobs_out[batch_rows, produced[batch_rows]] = token_logprobs[live]
                produced[batch_rows] += 1
                hit_stop = (tokens[live, None] == stop_table[batch_rows]).any(dim=1)
                stopped[batch_rows] = hit_stop
                finished = hit_stop | (produced[batch_rows] >= budgets[batch_rows])
                if finished.any():
                    self._cache_prefixes(state, live[finished & ~hit_stop], rows, contexts, tokens_out, produced)
                    running[live[finished]] = False
                    if not running.any():
                        return
                    if 4 * int(running.sum()) <= 3 * len(rows):  # a quarter of the cache is finished rows: drop them
                        kept = running.nonzero().squeeze(1)
                        self.decoder.keep(state, kept)
                        rows, tokens, running = rows[kept], tokens[kept], running[kept]
                next_logits = self.decoder.logits(self.decoder.step(state, tokens))
        finally:
            self._hand_over(batch, tokens_out, logprobs_out, produced, stopped, budgets)

    @staticmethod
    def _scores_prompt(seq: Sequence) -> bool:
        return seq.return_logprob and seq.logprob_start_len >= 0 and seq.input_logprobs is None

    def _cache_prefixes(self, state, cache_rows: torch.Tensor, rows: torch.Tensor, contexts: list[list[int]],
                        tokens_out: torch.Tensor, produced: torch.Tensor) -> None:
        """Keep, for rows that stopped at their token budget (a chunk a later request may continue), the K/V of what
        the cache holds for them: the context and every generated token but the last (sampled, not yet fed)."""
        for cache_row in cache_rows.tolist():
            batch_row = int(rows[cache_row])
            fed = tokens_out[batch_row, :int(produced[batch_row]) - 1].tolist()
            tokens = contexts[batch_row] + fed
            keys, values = self.decoder.processed(state, cache_row, len(tokens))
            self.prefix_cache.insert(tokens, keys, values)

    def _row_settings(self, batch: list[Sequence], contexts: list[list[int]], max_budget: int):
        """Per row of `batch`: temperature [B], top_p [B], top_k [B], the uniform of each token it may generate
        [B, max_budget] (sampling.py), and its stop ids [B, S] (-1 pads)."""
        temperature = torch.tensor([seq.params.temperature for seq in batch], dtype=torch.float32)
        top_p = torch.tensor([seq.params.top_p for seq in batch], dtype=torch.float32)
        top_k = torch.tensor([seq.params.top_k for seq in batch], dtype=torch.long)
        seeds = [seed_words(seq.seed) if seq.seed is not None else (0, 0) for seq in batch]
        seed_low, seed_high = torch.tensor(seeds, dtype=torch.long).reshape(-1, 2).unbind(1)
        seeded = torch.tensor([seq.seed is not None for seq in batch])
        first_position = torch.tensor([len(context) for context in contexts])  # of each row's next token
        uniforms = sample_uniforms(seed_low, seed_high, seeded, first_position, max_budget, self.generator)
        stop_sets = [seq.params.stop_token_ids | (set() if seq.params.ignore_eos else self.eos_token_ids)
                     for seq in batch]
        stop_table = torch.full((len(batch), max(1, *map(len, stop_sets))), -1, dtype=torch.long)
        for row, stops in enumerate(stop_sets):
            stop_table[row, :len(stops)] = torch.tensor(sorted(stops), dtype=torch.long)
        return temperature, top_p, top_k, uniforms, stop_table

    def _hand_over(self, batch: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor,
                   produced: torch.Tensor, stopped: torch.Tensor, budgets: torch.Tensor) -> None:
        """Append each row's new tokens and log-probs to its sequence and set the finish reason of those that ended:
        a stop token (SGLang's {"type": "stop", "matched": id}, the token kept in the output) or the length."""
        for seq, row_tokens, row_logprobs, count, stop, budget in zip(
                batch, tokens.tolist(), logprobs.tolist(), produced.tolist(), stopped.tolist(), budgets.tolist()):
            if count == 0:
                continue
            seq.output_ids.extend(row_tokens[:count])
            seq.output_logprobs.extend(row_logprobs[:count])
            if stop:
                seq.finish_reason = {"type": "stop", "matched": row_tokens[count - 1]}
            elif count >= budget:
                seq.finish_reason = {"type": "length", "length": len(seq.output_ids)}

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, seq: Sequence) -> list:
        """SGLang's input_token_logprobs: position i scores token i given tokens < i; position 0 has None."""
        scale = seq.params.temperature if seq.params.temperature > 0 else 1.0
        logprobs = torch.log_softmax(logits[: len(seq.prompt_ids) - 1] / scale, dim=-1)  # [P-1, V]
        targets = torch.tensor(seq.prompt_ids[1:], dtype=torch.long)
        values = [None] + logprobs.gather(-1, targets[:, None]).squeeze(-1).tolist()
        return values[seq.logprob_start_len:]


class BatchScheduler:
    """The engine's generation side: the queue, the batch loop, the decode workers, pause and continue.

    Its model lock is the engine's: the batch loop holds it while a batch decodes, and the weight routes take it to
    load weights, so the two never overlap. The lock and the wake-up event belong to the server's event loop:
    start() creates them there."""

    def __init__(self, batch_generator: BatchGenerator, max_positions: int | None, max_batch_size: int,
                 max_total_tokens: int, workers: int, batch_window_s: float):
        """workers: a batch of at least MIN_ROWS_PER_WORKER sequences per worker is split into that many contiguous
        parts, generated concurrently by as many threads. max_total_tokens: the cache slots one batch may take."""
        self.batch_generator = batch_generator
        self.max_positions = max_positions
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens
        self.workers = ThreadPoolExecutor(workers, thread_name_prefix="decode") if workers > 1 else None
        self.num_workers = workers
        self.batch_window_s = batch_window_s
        self.waiting: list[Sequence] = []
        self.running = False
        self.paused = False
        self.interrupt = threading.Event()  # set by pause: the running batch stops at its next step
        self.interrupt_mode = "abort"
        self.model_lock: asyncio.Lock | None = None
        self.wakeup: asyncio.Event | None = None

    def start(self) -> asyncio.Task:
        """In the server's event loop: create the model lock and the wake-up event, and run the batch loop."""
        self.model_lock = asyncio.Lock()
        self.wakeup = asyncio.Event()
        return asyncio.create_task(self.batch_loop())

    def decode(self, batch: list[Sequence]) -> None:
        """Decode `batch`, split over the workers (contiguous parts, so the same batch is always split alike)."""
        parts = min(self.num_workers, len(batch) // MIN_ROWS_PER_WORKER)
        if parts <= 1:
            self.batch_generator.generate(batch, self.interrupt)
            return
        bounds = [len(batch) * part // parts for part in range(parts + 1)]
        futures = [self.workers.submit(self.batch_generator.generate, batch[start:end], self.interrupt)
                   for start, end in zip(bounds, bounds[1:])]
        errors = [error for future in futures if (error := future.exception()) is not None]
        if errors:
            raise errors[0]

    async def batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wakeup.wait()
            await self._gather_arrivals()
            self.wakeup.clear()
            if self.paused or not self.waiting:
                continue
            async with self.model_lock:
                batch = self._next_batch()
                self.running = True
                try:
                    await loop.run_in_executor(None, self.decode, batch)
                except Exception as error:  # a broken batch must not kill the server
                    for seq in batch:
                        if not seq.done.done():
                            seq.done.set_exception(error)
                    continue
                finally:
                    self.running = False
            interrupted = [seq for seq in batch if seq.finish_reason is None]
            if interrupted and self.interrupt_mode == "retract":
                self.waiting = interrupted + self.waiting
            for seq in interrupted if self.interrupt_mode == "abort" else []:
                seq.finish_reason = {"type": "abort", "message": "aborted by /pause_generation"}
            for seq in batch:
                if seq.finish_reason is not None and not seq.done.done():
                    seq.done.set_result(None)
            if self.waiting:
                self.wakeup.set()

    async def _gather_arrivals(self) -> None:
        """Let concurrent requests join the batch: wait while requests keep arriving (a quiet period of a fifth of
        the window), at most batch_window_s. One batched request (the trainer's) starts after the quiet period."""
        deadline = time.monotonic() + self.batch_window_s
        waiting = -1
        while len(self.waiting) != waiting and time.monotonic() < deadline:
            waiting = len(self.waiting)
            await asyncio.sleep(min(self.batch_window_s / 5, max(deadline - time.monotonic(), 0.0)))

    def _next_batch(self) -> list[Sequence]:
        """The waiting sequences that run next, in order: at most max_batch_size, and as many as keep the batch's
        cache (rows x (longest context + largest budget)) within max_total_tokens; always at least one."""
        batch, width, budget = [], 0, 0
        for seq in self.waiting:
            row_width = max(width, len(seq.prompt_ids) + len(seq.output_ids))
            row_budget = max(budget, seq.token_budget(self.max_positions))
            if batch and (len(batch) == self.max_batch_size
                          or (len(batch) + 1) * (row_width + row_budget) > self.max_total_tokens):
                break
            batch.append(seq)
            width, budget = row_width, row_budget
        self.waiting = self.waiting[len(batch):]
        return batch

    async def run(self, sequences: list[Sequence]) -> None:
        """Queue `sequences` and wait until each has finished (or a pause aborted it)."""
        loop = asyncio.get_running_loop()
        for seq in sequences:
            seq.done = loop.create_future()
        self.waiting.extend(sequences)
        self.wakeup.set()
        await asyncio.gather(*(seq.done for seq in sequences))

    def fully_idle(self) -> bool:
        """SGLang's is_fully_idle(ignore_waiting=paused): no batch runs, and no request waits on an unpaused engine
        (a paused engine's queue, retracted requests, does not count)."""
        return not self.running and (self.paused or not self.waiting)

    async def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract"):
            raise RequestError(f"pause mode {mode!r} is not supported by the embedded engine; use abort or retract")
        self.paused = True
        self.interrupt_mode = mode
        self.interrupt.set()
        async with self.model_lock:  # wait until the running batch has stopped
            pass
        if mode == "abort":
            for seq in self.waiting:
                seq.finish_reason = {"type": "abort", "message": "aborted by /pause_generation"}
                seq.done.set_result(None)
            self.waiting = []

    def resume(self) -> None:
        self.paused = False
        self.interrupt.clear()
        self.wakeup.set()

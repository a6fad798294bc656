"""The DPPO trainer: one RL step per call, each phase one method.

    rank 0 (experience.py): prompts ─► DPPO prompt level (history, BEFORE rollout) ─► rollout (G samples each)
            ─► reward ─► advantages on the full group ─► full-batch counts ─► DAPO filter ─► completion pruning
            ─► normaliser; broadcast to every rank
            ─► Dense Prompt Packing (THD micro-batches, balanced over DP ranks)
            ─► old / reference log-probs (when needed; D3S selects tokens over all DP ranks here)
            ─► update (Megatron schedule, optimizer, LR step)
            ─► weight sync (pause → flush → bucketed broadcast → continue)

Roles: global rank 0 drives the rollout servers and computes rewards and pruning decisions (pure torch, cheap),
then broadcasts the kept samples to every rank; every rank packs the same bins and runs its data-parallel share.
With --async, generation of step t+1 runs in a thread on rank 0 while step t trains; it finishes before the weight
sync, so step t+1 trains on samples one policy version old, corrected by the truncated importance weight. With
--partial-rollout (partial_rollouts.py) a step's draw is continued over up to S + 1 steps and trains once whole, its
older tokens corrected the same way.

On-policy with one update epoch, the old log-probs equal the current ones: the update uses the forward pass's own
log-probs (detached) as old log-probs and skips a forward pass; otherwise a forward-only pass computes them first.
Every log-prob the trainer computes (old, new, reference) is of logits / --rollout-temperature, the distribution the
engine samples from and reports (actor/logprobs.py).

Each phase method is marked `@phase(name)` (platform/watchdog.py): the watchdog reports it when a peer goes silent,
bounds the ones with deadlines (save), and an exception leaving it is said in one line naming rank, host and phase.
Phases: step ⊃ experience ⊃ rollouts (rank 0; the other ranks wait in experience), logprobs, update, sync; evaluate,
save, load.
"""

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dppo.actor.checkpoint import (
    load_trainer_state,
    optimizer_layout,
    optimizer_layout_error,
    resolve_checkpoint,
    save_checkpoint,
)
from megatron_dppo.actor.export import is_export_source
from megatron_dppo.actor.step import logprob_loss_fn, next_token_targets
from megatron_dppo.algo.losses import combine_metrics, loss_normalizer, packed_policy_loss
from megatron_dppo.errors import UserInputError
from megatron_dppo.pipeline.experience import Experience, ExperienceMaker, Rollouts, run_progress
from megatron_dppo.pipeline.packing import pack_micro_batches, padding_token_id, sequence_pad_multiple
from megatron_dppo.platform import collectives
from megatron_dppo.platform.watchdog import phase
from megatron_dppo.rollout.client import SamplingParams

T = TypeVar("T")


class Trainer:
    def __init__(self, args, actor, task, tokenizer, client, syncer, hf_config: dict, reference=None,
                 run_record: dict | None = None):
        """`run_record`: the run's fingerprint, model config and flags (launch/resume.py), saved with every
        checkpoint so that a later run knows whether it is this one."""
        self.args, self.actor, self.task, self.tokenizer, self.hf_config = args, actor, task, tokenizer, hf_config
        self.client, self.syncer, self.reference, self.run_record = client, syncer, reference, run_record
        self.rank0 = dist.get_rank() == 0
        self.step = 0
        # every rank holds the pruner (D3S selects tokens on every rank); only rank 0 generates and selects samples
        self.maker = ExperienceMaker(args, task, tokenizer, client)
        self.history, self.pruner, self.loss_config = self.maker.history, self.maker.pruner, self.maker.loss_config
        self.pad_multiple = sequence_pad_multiple(args.tensor_model_parallel_size, 1, args.sequence_parallel)
        self.rollouts = NextRollouts(self.maker, args.async_rollout and self.rank0)
        # the log-probs of the distribution the rollout samples from (actor/logprobs.py): the engine's log-probs are
        # those of logits / temperature, and the old, new and reference log-probs must be too
        self.temperature = args.rollout_temperature

    # ------------------------------------------------------------------------------------------- the loop
    @phase("step")
    def train_one_step(self, elapsed_s: float = 0.0) -> dict:
        """One RL step; `elapsed_s` is the RL wall time so far (rank 0's clock), for the run's progress."""
        self.step += 1
        start = time.perf_counter()
        experience = self.make_experience(elapsed_s)  # rank 0 → every rank: prompt level, generation, reward, ...
        if self.step < self.total_steps():
            self.rollouts.start(self.step + 1)                 # --async: step t+1 generates while t trains
        micro_batches, packing_stats = self.pack(experience)   # Dense Prompt Packing, this DP rank's bins
        logprob_seconds = self.compute_old_logprobs(micro_batches, experience)
        update = self.update(micro_batches, experience)
        self.rollouts.finish()                                 # before the weights change
        sync = self.sync_weights()
        return {**experience.stats, **packing_stats, **update, **sync, "seconds_logprobs": logprob_seconds,
                "seconds_step": time.perf_counter() - start, "lr": self.actor.lr}

    # ------------------------------------------------------------------------------------------- phases
    @phase("experience")
    def make_experience(self, elapsed_s: float) -> Experience:
        """rank 0 computes, every rank receives: the step's rollouts (prompt level, generation, rewards) → advantages
        (full groups) → history → DAPO → pruning."""
        progress = run_progress(self.step, elapsed_s, self.args.train_iters, self.args.time_budget_s)
        return from_rank0(lambda: self.maker.make(self.rollouts.take(self.step), self.step, progress), self.rank0)

    def pack(self, experience: Experience) -> tuple[list, dict]:
        """Dense Prompt Packing of the kept samples; this rank's micro-batches (the same on every TP/PP rank)."""
        return pack_micro_batches(experience.samples, self.args.max_tokens_per_gpu, self.args.packing_window,
                                  parallel_state.get_data_parallel_world_size(),
                                  parallel_state.get_data_parallel_rank(), pad_multiple=self.pad_multiple,
                                  pad_token_id=padding_token_id(self.tokenizer))

    def needs_old_logprob_pass(self) -> bool:
        return self.args.ppo_epochs > 1 or self.args.async_rollout or self.pruner.selects_tokens

    @phase("logprobs")
    def compute_old_logprobs(self, micro_batches, experience: Experience) -> float:
        """Forward-only passes: old log-probs (and entropy for D3S) and reference log-probs, into the batches."""
        start = time.perf_counter()
        with_entropy = self.pruner.selects_tokens
        if self.needs_old_logprob_pass():
            outputs = self.actor.forward(micro_batches, logprob_loss_fn(with_entropy, temperature=self.temperature)) \
                if micro_batches else []
            for batch, output in zip(micro_batches, self._per_micro_batch(outputs, micro_batches)):
                batch.old_logprobs = output["logprobs"]
                batch.old_entropy = output.get("entropy")
            if with_entropy and parallel_state.is_pipeline_last_stage():  # where the entropy and the loss are
                experience.normalizer_counts = select_step_tokens(self.pruner, micro_batches, experience.progress)
        if micro_batches and self.reference is not None:
            outputs = self.reference.forward(micro_batches, logprob_loss_fn(temperature=self.temperature))
            for batch, output in zip(micro_batches, self._per_micro_batch(outputs, micro_batches)):
                batch.ref_logprobs = output["logprobs"]
        return time.perf_counter() - start

    def _per_micro_batch(self, outputs: list[dict], micro_batches) -> list[dict]:
        """One output dict per micro-batch: the forward's on the last pipeline stage, where the loss runs;
        placeholders on the other stages, which never read them."""
        return outputs if outputs else [{"logprobs": None} for _ in micro_batches]

    @phase("update")
    def update(self, micro_batches, experience: Experience) -> dict:
        """ppo_epochs optimizer steps over the packed batches with the policy loss; returns metrics."""
        start = time.perf_counter()
        if not experience.samples:  # nothing kept: every rank skips alike
            return {"skipped_update": 1.0, "seconds_update": time.perf_counter() - start}
        collected: list[dict] = []
        grad_norm, skipped = 0.0, 0
        normalizer = loss_normalizer(self.loss_config, experience.normalizer_counts)
        for _ in range(self.args.ppo_epochs):
            norm, outputs = self.actor.train_step(micro_batches, self._policy_loss_fn(normalizer))
            grad_norm, skipped = (grad_norm, skipped + 1) if norm is None else (norm, skipped)  # None: fp16 overflow
            collected = outputs
        seconds = time.perf_counter() - start
        tokens = sum(b.num_valid_tokens for b in micro_batches) * self.args.ppo_epochs
        metrics = {"grad_norm": grad_norm, "seconds_update": seconds, "tokens_trained": tokens,
                   "tokens_per_second_update": tokens / max(seconds, 1e-9),
                   "skipped_update": skipped / self.args.ppo_epochs, "loss_scale": self.actor.loss_scale}
        return {**metrics, **combine_metrics(collected)}

    def _policy_loss_fn(self, normalizer: float):
        config, temperature = self.loss_config, self.temperature

        def loss_fn(micro_batch, output):  # output: the last hidden states and output weight (actor/logprobs.py)
            logprobs, entropy = output.logprobs(next_token_targets(micro_batch), temperature=temperature)
            return packed_policy_loss(config, micro_batch, logprobs, normalizer, entropy)

        return loss_fn

    @phase("sync")
    def sync_weights(self) -> dict:
        """Push the actor's weights to the rollout servers; every rank iterates (TP gathers, PP sends)."""
        start = time.perf_counter()
        tensors = self.actor.hf_tensors()
        if is_export_source():
            stats = self.syncer.sync(tensors, version=self.step)
            result = {"seconds_sync": stats.seconds, "sync_gb_per_s": stats.gb_per_s, "sync_bytes": stats.bytes,
                      "weight_version": int(stats.weight_version)}
        else:
            for _ in tensors:
                pass
            result = {}
        dist.barrier()
        self.maker.weight_version = self.step  # the version every token generated from now on is sampled with
        result.setdefault("seconds_sync", time.perf_counter() - start)
        return result

    # ------------------------------------------------------------------------------------------- evaluation
    @phase("evaluate")
    def evaluate(self, count: int) -> dict:
        """rank 0 computes, every rank receives: greedy accuracy on the first `count` prompts of each held-out set,
        generated in one batch through the rollout servers: {"accuracy", "count"} of the first set, and "sets":
        {name: {"accuracy", "count"}}."""

        def accuracies() -> dict:
            sets = {name: self.task.heldout(count, name) for name in self.task.heldout_sets}
            prompts = [prompt for chosen in sets.values() for prompt in chosen]
            greedy = SamplingParams(temperature=0.0, max_new_tokens=self.args.rollout_max_response_len,
                                    stop_token_ids=[self.tokenizer.eos_token_id])
            completions = self.client.generate([p.input_ids for p in prompts], greedy, n=1)
            scores = iter(self.task.score([self.tokenizer.decode(c.output_ids) for c in completions], prompts).scores)
            by_set = {}
            for name, chosen in sets.items():
                mine = [next(scores) for _ in chosen]
                by_set[name] = {"accuracy": float(np.mean(mine)) if mine else 0.0, "count": len(mine)}
            return {**next(iter(by_set.values())), "sets": by_set}

        return from_rank0(accuracies, self.rank0)

    # ------------------------------------------------------------------------------------------- checkpoints
    def total_steps(self) -> int:
        return self.args.train_iters if self.args.train_iters is not None else 10**9

    @phase("save")
    def save(self, extra: dict) -> None:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, rng)
        state = {"step": self.step, "task": self.task.state_dict() if self.rank0 else None,
                 "history": self.history.state_dict(), "scheduler": self.actor.scheduler.state_dict(),
                 "rng": rng_states, "pending_rollouts": self.rollouts.ready,
                 "partial_rollouts": self.maker.partial.state_dict() if self.maker.partial and self.rank0 else None,
                 "optimizer_layout": self.optimizer_layout(), **extra}
        save_checkpoint(self.args.save, self.step, self.actor.sharded_state_dict(), self.hf_config,
                        state if self.rank0 else None, self.args.keep_last_checkpoints, run_record=self.run_record)

    def optimizer_layout(self) -> dict:
        return optimizer_layout(self.args.tensor_model_parallel_size, self.args.pipeline_model_parallel_size,
                                self.args.use_distributed_optimizer)

    @phase("load")
    def load(self, checkpoint) -> dict:
        """Resume: model, optimizer, scheduler, step, data position, pruner history, RNG, pending rollouts. With
        --no-load-optim (Megatron-LM's flag) the optimizer and its LR schedule start afresh, the rest resumes."""
        path = resolve_checkpoint(checkpoint)
        state = load_trainer_state(path)
        with_optimizer = state is not None and not self.args.no_load_optim
        if with_optimizer:  # refused on every rank alike, before any collective of the load
            problem = optimizer_layout_error(path, state.get("optimizer_layout"), self.optimizer_layout())
            if problem:
                raise UserInputError(problem)
        self.actor.load_sharded(path, with_optimizer=with_optimizer)
        if state is None:  # a converter's (model-only) checkpoint: start training from these weights
            return {}
        self.step = state["step"]
        self.history.load_state_dict(state["history"])
        if with_optimizer:
            self.actor.scheduler.load_state_dict(state["scheduler"])
        if self.rank0:
            self.task.load_state_dict(state["task"])
            self.rollouts.ready = state["pending_rollouts"]
            if self.maker.partial is not None and state.get("partial_rollouts") is not None:
                self.maker.partial.load_state_dict(state["partial_rollouts"])
        rng = state["rng"][dist.get_rank()] if len(state["rng"]) == dist.get_world_size() else state["rng"][0]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        return state


class NextRollouts:
    """rank 0: where a step's rollouts come from. Synchronous: generated when the step takes them. --async: the next
    step's are generated in a thread while this step trains (start), finished before the weight sync (finish), so
    they are one version old; `ready` holds them between steps and goes into a checkpoint."""

    def __init__(self, maker: ExperienceMaker, overlap: bool):
        self.maker = maker
        self.executor = ThreadPoolExecutor(1) if overlap else None
        self.future = None  # the next step's rollouts being generated
        self.ready: Rollouts | None = None  # the next step's rollouts, generated (also after a resume)
        self.failed: UserInputError | None = None  # why generating the next step's failed (a reward that fails)

    @phase("rollouts")
    def take(self, step: int) -> Rollouts:
        if self.failed is not None:  # raised where the step's rollouts are taken, inside from_rank0
            raise self.failed
        if self.ready is not None:
            rollouts, self.ready = self.ready, None
            return rollouts
        return self.maker.generate(step)

    def start(self, step: int) -> None:
        if self.executor is not None:
            self.future = self.executor.submit(self.maker.generate, step)

    @phase("rollouts")
    def finish(self) -> None:
        if self.future is not None:
            try:
                self.ready = self.future.result()
            except UserInputError as error:  # said at the next step, by every rank alike (take)
                self.failed = error
            self.future = None


def from_rank0(compute: Callable[[], T], rank0: bool) -> T:
    """compute() on rank 0, its result broadcast to every rank. A UserInputError it raises (a custom reward that
    fails) is broadcast in its place and raised on every rank, so that every rank stops alike and rank 0 alone says
    it (platform.process.exit_saying_once), where the other ranks would otherwise die with a traceback in the
    collective that rank 0 left."""
    box = [None]
    if rank0:
        try:
            box = [compute()]
        except UserInputError as error:
            box = [error]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserInputError):
        raise box[0]
    return box[0]


def select_step_tokens(pruner, micro_batches, progress: float):
    """D3S's token level over the WHOLE step: every data-parallel rank's tokens are gathered, the pruner selects once,
    and each rank keeps its share in its batches' loss masks. Returns the counts the normaliser reads after it."""
    fields = ("advantages", "old_entropy", "loss_mask", "sample_index")
    mine = {name: torch.cat([getattr(b, name).reshape(-1).double() for b in micro_batches])
            if micro_batches else torch.zeros(0, dtype=torch.float64) for name in fields}
    gathered = {name: gather_data_parallel(mine[name]) for name in fields}
    offset = gathered["loss_mask"][1]
    selected, counts = pruner.select_tokens(gathered["advantages"][0], gathered["old_entropy"][0],
                                            gathered["loss_mask"][0], gathered["sample_index"][0].long(), progress)
    selected = selected[offset:offset + len(mine["loss_mask"])]
    for batch, mask in zip(micro_batches, selected.split([b.num_tokens for b in micro_batches])):
        batch.loss_mask = mask.to(batch.loss_mask.dtype)
    return counts


def gather_data_parallel(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """All data-parallel ranks' 1-D host `values` (of any lengths) concatenated in rank order, and where this rank's
    part starts in the concatenation. Host tensors go over Megatron's gloo data-parallel group (the other one is
    NCCL on GPUs, which carries CUDA tensors only), as megatron-core gathers its own host state."""
    if parallel_state.get_data_parallel_world_size() == 1:
        return values, 0
    group = parallel_state.get_data_parallel_group_gloo()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    collectives.all_gather(sizes, torch.tensor([len(values)], dtype=torch.int64), group, "D3S token counts")
    sizes = [int(size) for size in sizes]
    padded = torch.zeros(max(sizes), dtype=values.dtype)
    padded[:len(values)] = values
    parts = [torch.zeros_like(padded) for _ in sizes]
    collectives.all_gather(parts, padded, group, "D3S token values")
    offset = sum(sizes[:parallel_state.get_data_parallel_rank()])
    return torch.cat([part[:size] for part, size in zip(parts, sizes)]), offset

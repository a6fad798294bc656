"""The DPPO trainer: one RL step per call, each phase one method.

    prompts ─► DPPO prompt level (history, BEFORE rollout) ─► rollout (/generate, G samples each)
            ─► reward ─► advantages on the full group ─► DAPO filter ─► completion pruning (weights 1/p)
            ─► Dense Prompt Packing (THD micro-batches, balanced over DP ranks)
            ─► old / reference log-probs (when needed) ─► update (Megatron schedule, optimizer, LR step)
            ─► weight sync (pause → flush → bucketed broadcast → continue)

Roles: global rank 0 drives the rollout servers and computes rewards and pruning decisions (pure torch, cheap),
then broadcasts the kept samples to every rank; every rank packs the same bins and runs its data-parallel share.
With --async, generation of step t+1 runs in a thread on rank 0 while step t trains; it finishes before the weight
sync, so step t+1 trains on samples one policy version old, corrected by the truncated importance weight.

On-policy with one update epoch, the old log-probs equal the current ones: the update uses the forward pass's own
log-probs (detached) as old log-probs and skips a forward pass; otherwise a forward-only pass computes them first.
"""

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dppo.actor.checkpoint import load_trainer_state, resolve_checkpoint, save_checkpoint
from megatron_dppo.actor.logprobs import tensor_parallel_logprobs
from megatron_dppo.actor.step import logprob_loss_fn, next_token_targets
from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.history import PromptHistory, score_prompts
from megatron_dppo.algo.losses import FullBatchInfo, LossConfig, loss_normalizer, policy_loss
from megatron_dppo.algo.pruning import PromptDecision, build_pruner
from megatron_dppo.convert.export import is_export_source
from megatron_dppo.packing import TrainingSample, build_thd_batch, pack, packing_density, sequence_pad_multiple
from megatron_dppo.rollout.client import SamplingParams


@dataclass
class Rollouts:
    """rank 0: one step's generation result."""

    prompts: list  # [Prompt] kept by the prompt level, in order
    prompt_decision: PromptDecision
    output_ids: list[list[int]]  # [num_prompts * G]
    output_logprobs: list[list[float]]
    seconds: float
    num_drawn: int


@dataclass
class Experience:
    """The kept samples of one step, as every rank receives them."""

    samples: list[TrainingSample]
    normalizer: float
    stats: dict = field(default_factory=dict)


def pruner_options(args) -> tuple[str, dict]:
    if args.algorithm == "dppo":
        return "dppo", dict(
            prompt_prune_rate=args.dppo_prompt_prune_rate, completion_prune_rate=args.dppo_completion_prune_rate,
            mode=args.dppo_mode, keep_policy=args.dppo_keep_policy, prompt_p_min=args.dppo_prompt_p_min,
            completion_p_min=args.dppo_completion_p_min, candidates=args.dppo_candidates,
            prompt_score=args.dppo_prompt_score, seed=args.rl_seed)
    if args.algorithm == "cppo":
        return "cppo", dict(prune_rate=args.cppo_prune_rate, scope=args.cppo_scope, refill=args.cppo_refill)
    if args.algorithm == "d3s":
        return "d3s", dict(sample_fraction_init=args.d3s_sample_fraction[0],
                           sample_fraction_final=args.d3s_sample_fraction[1],
                           token_fraction_init=args.d3s_token_fraction[0],
                           token_fraction_final=args.d3s_token_fraction[1], total_steps=args.train_iters or 1000)
    return "none", {}


class Trainer:
    def __init__(self, args, actor, task, tokenizer, client, syncer, hf_config: dict, reference=None):
        self.args, self.actor, self.task, self.tokenizer, self.hf_config = args, actor, task, tokenizer, hf_config
        self.client, self.syncer, self.reference = client, syncer, reference
        self.rank0 = dist.get_rank() == 0
        self.step = 0
        self.elapsed_before = 0.0  # seconds spent in earlier runs of a resumed training
        self.history = PromptHistory(args.history_ema_decay)
        name, options = pruner_options(args)
        self.pruner = build_pruner(name, **options)
        self.dapo = build_pruner("dapo", oversample_factor=args.dapo_oversample) if args.dapo_filter else None
        self.loss_config = LossConfig(
            eps_low=args.eps_clip, eps_high=args.eps_clip_high, dual_clip_c=args.eps_clip_c, kl_coef=args.kl_coef,
            kl_type=args.kl_type, entropy_coef=args.entropy_coef, aggregation=args.loss_agg_mode,
            importance_level=args.importance_level, tis_cap=args.tis_cap,
            max_response_length=args.rollout_max_response_len)
        self.sampling = SamplingParams(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop_token_ids=[tokenizer.eos_token_id])
        self.pad_multiple = sequence_pad_multiple(args.tensor_model_parallel_size, 1, args.sequence_parallel)
        self.executor = ThreadPoolExecutor(1) if args.async_rollout and self.rank0 else None
        self.pending = None  # rank 0, --async: the future of the next step's rollouts
        self.pending_rollouts = None  # rank 0, --async after a resume: the saved next-step rollouts

    # ------------------------------------------------------------------------------------------- the loop
    def train_one_step(self) -> dict:
        self.step += 1
        start = time.perf_counter()
        rollouts = self.next_rollouts()                        # rank 0: prompt level + generation
        experience = self.score_and_prune(rollouts)            # rank 0 → every rank: reward, advantages, pruning
        self.start_next_rollouts()                             # --async: step t+1 generates while t trains
        micro_batches, packing_stats = self.pack(experience)   # Dense Prompt Packing, this DP rank's bins
        logprob_seconds = self.compute_old_logprobs(micro_batches)
        update = self.update(micro_batches, experience)
        self.wait_pending_rollouts()
        sync = self.sync_weights()
        return {**experience.stats, **packing_stats, **update, **sync, "seconds_logprobs": logprob_seconds,
                "seconds_step": time.perf_counter() - start, "lr": self.actor.lr}

    # ------------------------------------------------------------------------------------------- phases
    def generate_rollouts(self, step: int) -> Rollouts:
        """rank 0: draw prompts, prune at the prompt level from history, and generate G samples per kept prompt."""
        args = self.args
        batch = args.rollout_batch_size
        count = self.pruner.prompts_to_sample(batch)  # CPPO's refill draws batch / (1 - P)
        drawn = self.task.next_prompts(self.dapo.prompts_to_sample(count) if self.dapo else count)
        decision = self.pruner.select_prompts(torch.tensor([p.prompt_id for p in drawn]), self.history, step)
        kept = [drawn[i] for i in decision.kept.tolist()]
        start = time.perf_counter()
        group = args.n_samples_per_prompt
        completions = self.client.generate([p.input_ids for p in kept], self.sampling_for_step(step), n=group) \
            if kept else []
        if len(completions) != len(kept) * group:
            raise RuntimeError(f"the rollout servers returned {len(completions)} samples for {len(kept)} prompts x "
                               f"{group}: a server dropped requests")
        return Rollouts(kept, decision, [c.output_ids for c in completions], [c.output_logprobs for c in completions],
                        time.perf_counter() - start, len(drawn))

    def sampling_for_step(self, step: int) -> SamplingParams:
        """Sampling parameters with a seed fixed by (seed, step), so a resumed run draws the same samples."""
        return SamplingParams(**{**self.sampling.__dict__, "seed": self.args.rl_seed * 1_000_003 + step})

    def next_rollouts(self) -> Rollouts | None:
        if not self.rank0:
            return None
        if self.pending_rollouts is not None:
            rollouts, self.pending_rollouts = self.pending_rollouts, None
            return rollouts
        if self.pending is not None:
            rollouts, self.pending = self.pending.result(), None
            return rollouts
        return self.generate_rollouts(self.step)

    def start_next_rollouts(self) -> None:
        if self.executor is not None and self.step < self.total_steps():
            self.pending = self.executor.submit(self.generate_rollouts, self.step + 1)

    def wait_pending_rollouts(self) -> None:
        if self.pending is not None:
            self.pending_rollouts, self.pending = self.pending.result(), None

    def score_and_prune(self, rollouts: Rollouts | None) -> Experience:
        """rank 0 computes, every rank receives: rewards → advantages (full groups) → history → DAPO → pruning."""
        experience = [self._score_and_prune(rollouts) if self.rank0 else None]
        dist.broadcast_object_list(experience, src=0)
        return experience[0]

    def _score_and_prune(self, rollouts: Rollouts) -> Experience:
        args, group = self.args, self.args.n_samples_per_prompt
        start = time.perf_counter()
        responses = [self.tokenizer.decode(ids) for ids in rollouts.output_ids]
        references = [p.reference for p in rollouts.prompts for _ in range(group)]
        rewards = torch.tensor(self.task.score(responses, references), dtype=torch.float64).view(-1, group)
        reward_seconds = time.perf_counter() - start
        lengths = torch.tensor([len(ids) for ids in rollouts.output_ids], dtype=torch.float64).view(-1, group)
        advantages = compute_advantages(rewards, args.advantage_estimator)
        prompt_ids = [p.prompt_id for p in rollouts.prompts]
        if prompt_ids:
            self.history.update(prompt_ids, score_prompts(rewards, advantages, self.pruner.prompt_score),
                                lengths.mean(dim=1))
        decision = rollouts.prompt_decision
        groups = torch.arange(len(prompt_ids))
        if self.dapo is not None:  # drop zero-variance groups (refilled by over-sampling), before the pruner
            kept_flat = self.dapo.select_completions(rewards, advantages, lengths, decision, self.history,
                                                     self.step).kept
            groups = torch.unique(kept_flat // group)
            decision = PromptDecision(decision.kept[groups], decision.weights[groups], decision.keep_probs,
                                      decision.expected_response_lengths, decision.stats)
        completion = self.pruner.select_completions(rewards[groups], advantages[groups], lengths[groups], decision,
                                                    self.history, self.step)
        samples = []
        for flat, weight in zip(completion.kept.tolist(), completion.weights.tolist()):
            prompt_index, sample = int(groups[flat // group]), flat % group
            rollout_index = prompt_index * group + sample
            samples.append(TrainingSample(
                prompt_ids=rollouts.prompts[prompt_index].input_ids,
                response_ids=rollouts.output_ids[rollout_index],
                advantage=float(advantages[prompt_index, sample]), sample_weight=float(weight),
                rollout_logprobs=torch.tensor(rollouts.output_logprobs[rollout_index], dtype=torch.float32)))
        samples = [s for s in samples if len(s.response_ids) > 0]
        normalizer = loss_normalizer(self.loss_config, completion.full_batch) if samples else 0.0
        num_rollouts = max(rewards.numel(), 1)
        stats = {  # the pruner's own stats first: ours, over the whole step, take precedence on shared names
            **{k: float(v) for k, v in {**decision.stats, **completion.stats}.items()},
            "reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
            "accuracy": float((rewards == 1).double().mean()) if rewards.numel() else 0.0,
            "zero_variance_group_fraction": float((rewards.std(dim=1) == 0).double().mean()) if len(rewards) else 0.0,
            "kept_fraction_prompts": len(rollouts.prompts) / max(rollouts.num_drawn, 1),
            "kept_fraction_completions": len(samples) / num_rollouts,
            "kept_fraction": len(samples) / (max(rollouts.num_drawn, 1) * group),
            "tokens_generated": int(lengths.sum()),
            "tokens_per_second_rollout": float(lengths.sum()) / max(rollouts.seconds, 1e-9),
            "seconds_rollout": rollouts.seconds,
            "seconds_reward": reward_seconds,
            "response_length_mean": float(lengths.mean()) if lengths.numel() else 0.0,
            "sequences_trained": len(samples),
        }
        return Experience(samples, normalizer, stats)

    def pack(self, experience: Experience) -> tuple[list, dict]:
        """Dense Prompt Packing of the kept samples; this rank's micro-batches (the same on every TP/PP rank)."""
        if not experience.samples:
            return [], {"packing_density": 0.0, "micro_batches": 0}
        lengths = [s.num_tokens for s in experience.samples]
        dp_size = parallel_state.get_data_parallel_world_size()
        rank_bins = pack(lengths, self.args.max_tokens_per_gpu, self.args.packing_window, dp_size,
                         pad_multiple=self.pad_multiple)
        mine = rank_bins[parallel_state.get_data_parallel_rank()]
        micro_batches = [build_thd_batch(experience.samples, bin_, self.pad_multiple, self.tokenizer.pad_token_id)
                         for bin_ in mine]
        density = packing_density(rank_bins, lengths, self.args.max_tokens_per_gpu)
        return micro_batches, {"packing_density": density, "micro_batches": len(mine)}

    def needs_old_logprob_pass(self) -> bool:
        return self.args.ppo_epochs > 1 or self.args.async_rollout or self.args.algorithm == "d3s"

    def compute_old_logprobs(self, micro_batches) -> float:
        """Forward-only passes: old log-probs (and entropy for D3S) and reference log-probs, into the batches."""
        start = time.perf_counter()
        vocab, d3s = self.actor.shape.vocab_size, self.args.algorithm == "d3s"
        if micro_batches and self.needs_old_logprob_pass():
            outputs = self.actor.forward(micro_batches, logprob_loss_fn(vocab, with_entropy=d3s))
            for batch, output in zip(micro_batches, self._per_micro_batch(outputs, micro_batches)):
                batch.old_logprobs = output["logprobs"]
                batch.old_entropy = output.get("entropy")
            if d3s:
                self._select_d3s_tokens(micro_batches)
        if micro_batches and self.reference is not None:
            outputs = self.reference.forward(micro_batches, logprob_loss_fn(vocab))
            for batch, output in zip(micro_batches, self._per_micro_batch(outputs, micro_batches)):
                batch.ref_logprobs = output["logprobs"]
        return time.perf_counter() - start

    def _per_micro_batch(self, outputs: list[dict], micro_batches) -> list[dict]:
        """One output dict per micro-batch: the forward's on the last pipeline stage, where the loss runs;
        placeholders on the other stages, which never read them."""
        return outputs if outputs else [{"logprobs": None} for _ in micro_batches]

    def _select_d3s_tokens(self, micro_batches) -> None:
        """D3S token level: keep the top-K% tokens by |A|·H of this rank's batches (exact at DP=1)."""
        if micro_batches[0].old_entropy is None:
            return
        flat = {name: torch.cat([getattr(b, name) for b in micro_batches])
                for name in ("advantages", "old_entropy", "loss_mask")}
        selected, _ = self.pruner.select_tokens(flat["advantages"], flat["old_entropy"], flat["loss_mask"],
                                                FullBatchInfo(1.0, float(flat["loss_mask"].sum())), self.step)
        for batch, mask in zip(micro_batches, selected.split([b.num_tokens for b in micro_batches])):
            batch.loss_mask = mask

    def update(self, micro_batches, experience: Experience) -> dict:
        """ppo_epochs optimizer steps over the packed batches with the policy loss; returns metrics."""
        start = time.perf_counter()
        if not micro_batches or experience.normalizer <= 0:  # nothing kept: every rank skips alike
            return {"skipped_update": 1.0, "seconds_update": time.perf_counter() - start}
        collected: list[dict] = []
        grad_norm = 0.0
        for _ in range(self.args.ppo_epochs):
            grad_norm, outputs = self.actor.train_step(micro_batches, self._policy_loss_fn(experience.normalizer))
            collected = outputs
        seconds = time.perf_counter() - start
        tokens = sum(b.num_valid_tokens for b in micro_batches) * self.args.ppo_epochs
        metrics = {"grad_norm": grad_norm, "seconds_update": seconds, "tokens_trained": tokens,
                   "tokens_per_second_update": tokens / max(seconds, 1e-9), "skipped_update": 0.0}
        if collected:
            weights = [o["num_tokens"] for o in collected]
            for key in collected[0]:
                if key != "num_tokens":
                    metrics[key] = sum(o[key] * w for o, w in zip(collected, weights)) / max(sum(weights), 1.0)
        return metrics

    def _policy_loss_fn(self, normalizer: float):
        vocab, config = self.actor.shape.vocab_size, self.loss_config

        def loss_fn(micro_batch, logits):
            logprobs, entropy = tensor_parallel_logprobs(logits, next_token_targets(micro_batch), vocab)
            old = micro_batch.old_logprobs if micro_batch.old_logprobs is not None else logprobs.detach()
            loss, metrics = policy_loss(
                config, logprobs=logprobs, old_logprobs=old, advantages=micro_batch.advantages,
                loss_mask=micro_batch.loss_mask, sample_weights=micro_batch.sample_weights,
                sample_ids=micro_batch.sample_index, normalizer=normalizer, ref_logprobs=micro_batch.ref_logprobs,
                rollout_logprobs=micro_batch.rollout_logprobs, entropy=entropy if config.entropy_coef else None)
            with torch.no_grad():
                mask = micro_batch.loss_mask
                gap = ((logprobs - micro_batch.rollout_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1)
            metrics["logprob_gap_train_vs_rollout"] = float(gap)
            return loss, metrics

        return loss_fn

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
        result.setdefault("seconds_sync", time.perf_counter() - start)
        return result

    # ------------------------------------------------------------------------------------------- evaluation
    def evaluate(self, count: int) -> dict:
        """rank 0: greedy accuracy on `count` held-out prompts through the rollout servers."""
        result = [None]
        if self.rank0:
            prompts = self.task.heldout(count)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=self.args.rollout_max_response_len,
                                    stop_token_ids=[self.tokenizer.eos_token_id])
            completions = self.client.generate([p.input_ids for p in prompts], greedy, n=1)
            scores = self.task.score([self.tokenizer.decode(c.output_ids) for c in completions],
                                     [p.reference for p in prompts])
            result = [{"accuracy": float(np.mean(scores)) if scores else 0.0, "count": len(scores)}]
        dist.broadcast_object_list(result, src=0)
        return result[0]

    # ------------------------------------------------------------------------------------------- checkpoints
    def total_steps(self) -> int:
        return self.args.train_iters if self.args.train_iters is not None else 10**9

    def save(self, extra: dict) -> None:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, rng)
        state = {"step": self.step, "task": self.task.state_dict() if self.rank0 else None,
                 "history": self.history.state_dict(), "scheduler": self.actor.scheduler.state_dict(),
                 "rng": rng_states, "pending_rollouts": self.pending_rollouts, **extra}
        save_checkpoint(self.args.save, self.step, self.actor.sharded_state_dict(),
                        self.hf_config, state if self.rank0 else None, self.args.keep_last_checkpoints)

    def load(self, checkpoint) -> dict:
        """Resume: model, optimizer, scheduler, step, data position, pruner history, RNG, pending rollouts."""
        path = resolve_checkpoint(checkpoint)
        state = load_trainer_state(path)
        self.actor.load_sharded(path, with_optimizer=state is not None)
        if state is None:  # a converter's (model-only) checkpoint: start training from these weights
            return {}
        self.step = state["step"]
        self.history.load_state_dict(state["history"])
        self.actor.scheduler.load_state_dict(state["scheduler"])
        if self.rank0:
            self.task.load_state_dict(state["task"])
            self.pending_rollouts = state["pending_rollouts"]
        rng = state["rng"][dist.get_rank()] if len(state["rng"]) == dist.get_world_size() else state["rng"][0]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        return state

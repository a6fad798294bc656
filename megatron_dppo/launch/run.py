"""Start everything a training run needs, run the trainer, shut everything down.

    parse/validate args ─► rank 0: the layout of the SGLang / vLLM servers it will start (enough GPUs?)
    ─► --hf-checkpoint: its tokenizer and the task (prompts + reward), read before anything starts
    ─► torch.distributed + Megatron parallel state
    ─► or the embedded default: tiny model + cached warm start, and the synthetic task
    ─► where the run starts (launch/resume.py): its own latest checkpoint in --save, --load, or afresh; one line says
       which; a --save holding another run's checkpoints is refused (rank 0 decides for every rank)
    ─► the memory plan of a trainer GPU (launch/memory_plan.py), with --rollout-colocate the SGLang server's share
       of it and the --mem-fraction-static it gets (launch/colocated_sglang.py): refused here if it cannot fit
    ─► actor (+ frozen reference when --kl-coef > 0)
    ─► rank 0: rollout servers (embedded engine | SGLang | vLLM | external URLs), client, weight syncer, server pool;
       the watchdog probes the servers
    ─► resume (the checkpoint decided above) ─► initial weight sync ─► evaluate ─► RL steps ─► evaluate ─► save
The last line on rank 0 is a JSON summary.
"""

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from megatron_dppo.actor.actor import Actor, OptimConfig
from megatron_dppo.actor.checkpoint import iteration_dir, read_hf_config, resolve_checkpoint
from megatron_dppo.actor.model import Recompute
from megatron_dppo.actor.parallel import destroy_parallel, init_parallel
from megatron_dppo.convert.hf_checkpoint import HFCheckpoint, read_config
from megatron_dppo.convert.mapping import model_shape
from megatron_dppo.data.checks import HELDOUT_METRIC, eval_metric
from megatron_dppo.errors import UserInputError
from megatron_dppo.launch.arguments import build_parser, is_embedded_default
from megatron_dppo.launch.cluster_flags import watchdog_config
from megatron_dppo.launch.colocated_sglang import start_colocated_share, with_server_flags
from megatron_dppo.launch.launch_plan import weight_sync_backend
from megatron_dppo.launch.memory_plan import start_memory_error
from megatron_dppo.launch.resume import resume_decision, run_record
from megatron_dppo.metrics import MetricsLogger, RolloutRecords, WandbRun
from megatron_dppo.pipeline.tasks import Task, dataset_task, synthetic_task
from megatron_dppo.pipeline.trainer import Trainer
from megatron_dppo.platform import device_memory_bytes, is_cpu
from megatron_dppo.platform import watchdog as run_watchdog
from megatron_dppo.platform.network import address_reaching, sync_socket_environment
from megatron_dppo.platform.process import is_rank0
from megatron_dppo.rollout.launcher import local_servers


def load_tokenizer(model_dir: Path):
    """The model directory's own tokenizer, as transformers loads it (the tokenizer the rollout servers use)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def build_task(args, tokenizer) -> Task:
    """The synthetic task, or prompts and held-out prompts read by load_prompt_data and scored by --reward-type; a
    --custom-reward-function scores either instead."""
    scorer = None
    if args.custom_reward_function:
        from megatron_dppo.rewards.custom import CustomReward

        scorer = CustomReward(args.custom_reward_function, args.reward_timeout_s, args.custom_reward_max_failures)
    if args.prompt_data == "synthetic":
        return synthetic_task(tokenizer, args.rl_seed, args.data_train_size, args.eval_size, args.data_synthetic_cells,
                              args.synthetic_task, scorer)
    from megatron_dppo.data.datasets import load_prompt_data

    fields = dict(input_key=args.input_key, label_key=args.label_key, reward_type=args.reward_type,
                  skip_bad_rows=args.skip_bad_rows, difficulty_key=args.difficulty_key)
    train = load_prompt_data(args.prompt_data, split=args.prompt_data_split, training=True,
                             config=args.prompt_data_config, **fields)
    heldout = {name: load_prompt_data(source, split=args.eval_prompt_data_split, limit=args.eval_size,
                                      flag="--eval-prompt-data", config=args.eval_prompt_data_config, **fields)
               for name, source in args.eval_sets}  # one unnamed set, or several by name (eval_sets)
    return dataset_task(train, heldout, tokenizer, args.rl_seed, args.reward_type, args.apply_chat_template,
                        args.reward_timeout_s, scorer, args.apply_chat_template_kwargs)


def embedded_engine_options(args, local_processes: int) -> dict:
    """How the trainer starts the embedded engine: deterministic (see start_rollout), --rollout-engine-workers decode
    workers of --rollout-engine-threads torch threads each. By default one worker with a thread per trainer process
    on this node (`local_processes`): they wait, blocked, while the engine generates, and one worker's batched
    matmuls use the freed cores best (measured by bench/step_cost.py: 1.05-1.07x the steps per second of one
    single-thread worker per process). Under --async the trainer computes while the engine generates, so the cores
    are shared: one single-thread worker per process, which slows down gracefully where one two-thread kernel waits
    for its slower thread (docs/rollout.md). --rollout-engine-weight-noise passes on, seeded by --rl-seed.
    --rollout-engine-device cuda: the engine decodes on rank 0's GPU."""
    shared_cores = args.async_rollout
    workers = args.rollout_engine_workers or (local_processes if shared_cores else 1)
    threads = args.rollout_engine_threads or (1 if shared_cores else max(1, local_processes // workers))
    device = {} if args.rollout_engine_device == "cpu" else {"device": args.rollout_engine_device}
    return {"threads": threads, "workers": workers, "enable_deterministic_inference": True,
            "disable_radix_cache": args.rollout_engine_disable_radix_cache, **device,
            **({"weight_noise": args.rollout_engine_weight_noise, "weight_noise_seed": args.rl_seed}
               if args.rollout_engine_weight_noise else {})}


def keeps_host_copy(args) -> bool:
    """Whether rank 0 keeps a host copy of the weights it last synced, for a server it restarts.

    A server started here (embedded, SGLang, vLLM) is restarted when it dies (ServerPool.ensure_alive) and must then
    get the weights the other servers hold. Rank 0 exports them again from its own model, with no copy, where it
    holds the whole model (TP = PP = 1, as every data-parallel rank then does) and the model still holds the synced
    version while the servers generate (synchronous rollouts: the update runs after generation; evaluation after
    the sync). Otherwise the copy is the only source: under TP or PP > 1 the other shards are on ranks blocked in a
    collective meanwhile, and under --async the update changes the model while the servers generate. Servers started
    elsewhere (external) are never restarted from here. The copy costs host memory of one model (about 8 GB for
    Qwen3-4B in bf16) and a device-to-host copy of every byte at every sync."""
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    return args.rollout_backend != "external" and (model_parallel > 1 or args.async_rollout)


def start_rollout(args, model_dir: Path, synced_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]):
    """rank 0: the servers, a client on them, a weight syncer, and the pool that restarts dead servers and re-syncs
    them: from the syncer's host copy where rank 0 keeps one (keeps_host_copy), else from `synced_weights`, which
    exports the model's weights (as HF tensors) again."""
    from megatron_dppo.rollout.client import RolloutClient, SGLangGenerateAPI, control_request
    from megatron_dppo.rollout.launcher import ServerPool, external_servers, launch_embedded_engine, start_local_servers
    from megatron_dppo.rollout.vllm import VLLMCompletionsAPI, VLLMControl
    from megatron_dppo.rollout.weight_sync import AUTO_FORMAT, WeightSyncer
    from megatron_dppo.weight_update_protocol import FLATTENED_BUCKET

    # Servers started here are deterministic (SGLang's --enable-deterministic-inference, which the embedded engine
    # mirrors): only then does the trainer's per-sample sampling_seed act, which exact resume relies on.
    api, control = SGLangGenerateAPI(), control_request
    if args.rollout_backend == "embedded":
        options = embedded_engine_options(args, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        handles = [launch_embedded_engine(str(model_dir), **options)
                   for _ in range(args.rollout_num_servers)]
    elif args.rollout_backend in ("sglang", "vllm"):
        if args.rollout_colocate and not is_cpu():  # the server sizes itself from the free memory it finds: the
            torch.cuda.empty_cache()               # memory plan's, once the allocator hands its cached blocks back
        handles = start_local_servers(args, str(model_dir), is_cpu())
        if args.rollout_backend == "vllm":
            api, control = VLLMCompletionsAPI(), VLLMControl()
    else:
        handles = external_servers(args.rollout_urls)
    urls = [handle.url for handle in handles]
    # The embedded engine takes large tensors in SGLang's per-tensor format: over gloo in host memory, packing them
    # would copy every byte once more (docs/rollout.md); SGLang over NCCL and vLLM take flattened buckets.
    syncer = WeightSyncer(urls, master_address=weight_sync_address(args), master_ports=args.weight_sync_port,
                          backend=weight_sync_backend(args, is_cpu()),
                          bucket_bytes=args.rollout_weight_bucket_mb * 2**20, timeout_s=args.rollout_timeout_s,
                          engine_ranks=[args.rollout_server_gpus] * len(urls),
                          keep_host_copy=keeps_host_copy(args), control=control,
                          load_format=AUTO_FORMAT if args.rollout_backend == "embedded" else FLATTENED_BUCKET)
    resync = syncer.resend if syncer.keep_host_copy else lambda: syncer.sync(synced_weights(), syncer.last_version)
    pool = ServerPool(handles, weight_syncer=syncer, resync=resync)
    client = RolloutClient(urls, max_concurrency=args.rollout_max_concurrency, request_timeout_s=args.rollout_timeout_s,
                           supervisor=pool, api=api)
    return pool, client, syncer


def weight_sync_address(args) -> str:
    """The address of rank 0 that the rollout servers dial for the weight-sync group: --weight-sync-master-address;
    else loopback for servers started here, and for external ones the address this host's routes to them leave
    from (not the one its name resolves to: 127.0.1.1 on Debian-style hosts, where each server would dial itself)."""
    if args.weight_sync_master_address:
        return args.weight_sync_master_address
    if args.rollout_backend != "external":
        return "127.0.0.1"
    return address_reaching([urlsplit(url).hostname for url in args.rollout_urls])


def bind_nccl_to_the_sync_interface(args) -> None:
    """rank 0, before its first NCCL communicator (NCCL reads its socket interface once per process): where the
    weight sync runs over NCCL to servers on other hosts and NCCL_SOCKET_IFNAME is unset, NCCL's bootstrap listens
    on the interface of the weight-sync address, the one the servers reach (platform/network.py)."""
    if not is_rank0():
        return
    chosen = sync_socket_environment(weight_sync_address(args), weight_sync_backend(args, is_cpu()))
    for variable, interface in chosen.items():
        os.environ[variable] = interface
        print(f"{os.uname().nodename}: {variable}={interface}, the interface of the weight-sync address (set "
              f"{variable} to choose another)", flush=True)


def start_watchdog(args) -> run_watchdog.Watchdog:
    """Every rank, once the process group exists: the watchdog of --heartbeat-* (rank 0 hosts it at MASTER_ADDR)."""
    def from_rank0(value):
        shared = [value]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    return run_watchdog.start(watchdog_config(args), dist.get_rank(), dist.get_world_size(),
                              os.environ.get("MASTER_ADDR", "127.0.0.1"), from_rank0)


def wandb_run(args, run_id: str | None = None) -> WandbRun | None:
    """The Weights & Biases run of --wandb-project (rank 0 logs to it), with the run's flags as its config; `run_id`:
    the W&B run a resumed training run continues (saved with its checkpoint)."""
    if not args.wandb_project:
        return None
    config = {key: value for key, value in vars(args).items()
              if value is None or isinstance(value, (str, int, float, bool, list, tuple, dict))}
    return WandbRun(args.wandb_project, args.wandb_exp_name, Path(args.wandb_save_dir or Path(args.log_dir) / "wandb"),
                    config, args.wandb_entity, args.wandb_group, run_id)


class RLClock:
    """The RL time that --time-budget-s counts: wall time without the held-out evaluations, or, with
    --time-budget-prices, the steps' logged work at those prices (a step, its decode iterations, generated and
    trained tokens), so that a benchmark's run does the same work on a busy machine as on an idle one. Both are
    logged per step (seconds_wall, seconds_priced); a resumed run goes on from the clock its checkpoint saved."""

    WORK = ("decode_iterations", "tokens_generated", "tokens_trained")

    def __init__(self, prices, resumed: dict | None = None):
        resumed = resumed or {}
        self.prices = None if prices is None else tuple(float(price) for price in prices)
        self.before = resumed.get("seconds_wall", resumed.get("seconds_rl", 0.0))
        self.start, self.evaluating = time.perf_counter(), 0.0
        self.priced = resumed.get("seconds_rl", 0.0) if self.prices is not None else 0.0

    def wall(self) -> float:
        return self.before + time.perf_counter() - self.start - self.evaluating

    def seconds(self) -> float:
        return self.wall() if self.prices is None else self.priced

    def add_step(self, step_metrics: dict) -> None:
        """Price one step's work (its metrics) and log both clocks into them."""
        if self.prices is not None:
            self.priced += self.prices[0] + sum(price * float(step_metrics.get(key, 0.0))
                                                for price, key in zip(self.prices[1:], self.WORK))
            step_metrics["seconds_priced"] = self.priced
        step_metrics["seconds_wall"] = self.wall()

    def add_evaluation(self, seconds: float) -> None:
        self.evaluating += seconds


def heldout_metrics(evaluation: dict) -> dict:
    """An evaluation's metrics: heldout_accuracy (the first held-out set), and heldout_accuracy/NAME for each named
    set (--eval-prompt-data NAME SOURCE ...)."""
    named = {eval_metric(name): result["accuracy"] for name, result in evaluation.get("sets", {}).items() if name}
    return {HELDOUT_METRIC: evaluation["accuracy"], **named}


def budget_spent(budget_s: float | None, elapsed_s: float) -> bool:
    """Rank 0's clock decides for every rank: ranks that stopped at different steps would deadlock."""
    if budget_s is None:
        return False
    decision = [elapsed_s > budget_s]
    dist.broadcast_object_list(decision, src=0)
    return decision[0]


def check_rollout_layout(args) -> None:
    """rank 0, first thing: lay out the servers it will start (enough GPUs beside the trainer's?), so that a layout
    that cannot fit fails before the checkpoint loads rather than after (start_rollout lays them out again)."""
    if is_rank0() and args.rollout_backend in ("sglang", "vllm"):
        local_servers(args, args.hf_checkpoint or "", is_cpu())


def resume_point(args, record: dict) -> str | None:
    """The checkpoint this run loads (None: it starts from the model), as rank 0 decides it (resume_decision) and
    says in one line; every rank gets the same answer, or the same UserInputError."""
    decided = [None]
    if dist.get_rank() == 0:
        try:
            decision = resume_decision(args.save, args.load, args.fresh_start, record)
            decided = [(decision.checkpoint, decision.message, None)]
        except UserInputError as error:
            decided = [(None, None, str(error))]
    dist.broadcast_object_list(decided, src=0)
    checkpoint, message, error = decided[0]
    if error:
        raise UserInputError(error)
    if message and dist.get_rank() == 0:
        print(message, flush=True)
    return checkpoint


def saves_what_it_loaded(save: str | None, load: str | None, step: int, loaded_step: int) -> bool:
    """Whether a save now would write the very checkpoint the run loaded, with no step taken since (a finished run
    run again): skipped, as it holds nothing new and would replace the directory `latest` names."""
    return bool(save and load) and step == loaded_step and \
        iteration_dir(save, step).resolve() == resolve_checkpoint(load).resolve()


def run(args) -> dict:
    start = time.perf_counter()
    check_rollout_layout(args)
    embedded_default = is_embedded_default(args)
    if not embedded_default:  # the user's model and prompts: read before any process group starts, so bad data
        model_dir = Path(args.hf_checkpoint)  # stops the run at once with its own error
        tokenizer = load_tokenizer(model_dir)
        task = build_task(args, tokenizer)
    bind_nccl_to_the_sync_interface(args)
    init_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed,
                  timeout_s=args.distributed_timeout_minutes * 60)
    watchdog = start_watchdog(args)  # stopped on success only: a rank that fails ends the others at once
    rank0 = dist.get_rank() == 0
    warm_start = None
    if embedded_default:
        from megatron_dppo.launch import embedded

        model_dir, tokenizer, warm_start = embedded.prepare(args)
        task = build_task(args, tokenizer)
    start_config = read_hf_config(resolve_checkpoint(args.load)) if args.load else read_config(model_dir)
    record = run_record(args, build_parser(), start_config)
    load = resume_point(args, record)
    hf_config = start_config if load == args.load else read_hf_config(resolve_checkpoint(load))
    shape = model_shape(hf_config)
    dp = dist.get_world_size() // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    memory_error, server_flags = start_memory_error(args, dp, shape, device_memory_bytes()), None
    if not memory_error:
        memory_error, server_flags = start_colocated_share(args, dp, shape, device_memory_bytes())
    if memory_error:  # every rank finds it alike; before the model is built, so nothing is allocated for nothing
        raise UserInputError(memory_error)
    server_args = args if server_flags is None else with_server_flags(args, server_flags)  # with the fraction
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    checkpoint = HFCheckpoint(model_dir)
    optim = OptimConfig(lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters,
                        lr_decay_iters=args.train_iters or 1, lr_decay_style=args.lr_decay_style,
                        clip_grad=args.clip_grad, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                        use_distributed_optimizer=args.use_distributed_optimizer,
                        initial_loss_scale=args.initial_loss_scale)
    actor = Actor(shape, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, dtype, optim,
                  checkpoint, args.sequence_parallel, args.transformer_impl,
                  recompute=Recompute(args.recompute_granularity, args.recompute_method, args.recompute_num_layers))
    if warm_start is not None and not load:
        actor.load_sharded(warm_start, with_optimizer=False)
    reference = None
    if args.kl_coef > 0:
        reference = Actor(shape, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, dtype, None,
                          checkpoint, args.sequence_parallel, args.transformer_impl)
        if warm_start is not None:
            reference.load_sharded(warm_start, with_optimizer=False)
    pool = client = syncer = None
    with contextlib.ExitStack() as stack:
        if rank0:
            pool, client, syncer = start_rollout(server_args, model_dir, actor.hf_tensors)
            stack.callback(pool.stop)
            watchdog.watch_servers(syncer.urls)
        trainer = Trainer(args, actor, task, tokenizer, client, syncer, hf_config, reference, record)
        resumed = trainer.load(load) if load else {}
        loaded_step = trainer.step
        trainer.sync_weights()
        before = resumed.get("eval_before") or trainer.evaluate(args.eval_size)
        prompts = resumed.get("prompt_totals") or {"prompts_drawn": 0.0, "prompts_pruned": 0.0}
        metrics = MetricsLogger(args.log_dir, rank0, args.train_iters, trainer.step, prompts,
                                wandb_run(args, resumed.get("wandb_run_id")), RolloutRecords.from_args(args))
        clock = RLClock(args.time_budget_prices, resumed)  # the periodic evaluations do not count

        while trainer.step < trainer.total_steps():
            if budget_spent(args.time_budget_s, clock.seconds()):
                break
            step_metrics = trainer.train_one_step(clock.seconds())
            clock.add_step(step_metrics)
            for key in prompts:
                prompts[key] += step_metrics.get(key, 0.0)
            if args.eval_interval and trainer.step % args.eval_interval == 0:
                eval_start = time.perf_counter()
                step_metrics.update(heldout_metrics(trainer.evaluate(args.eval_size)))
                clock.add_evaluation(time.perf_counter() - eval_start)
            metrics.log(trainer.step, step_metrics)
            if args.save and args.save_interval and trainer.step % args.save_interval == 0:
                trainer.save({"eval_before": before, "prompt_totals": dict(prompts), "seconds_rl": clock.seconds(),
                              "seconds_wall": clock.wall(), "wandb_run_id": metrics.wandb_run_id})
        seconds_rl = clock.seconds()
        after = trainer.evaluate(args.eval_size)
        if args.save and not (args.save_interval and trainer.step % args.save_interval == 0) and \
                not saves_what_it_loaded(args.save, load, trainer.step, loaded_step):
            trainer.save({"eval_before": before, "seconds_rl": seconds_rl, "seconds_wall": clock.wall(),
                          "prompt_totals": dict(prompts), "wandb_run_id": metrics.wandb_run_id})
        metrics.close()
    # the prompt level's work over the run: the share of drawn prompts it pruned, and the samples it never generated
    pruned_fraction = prompts["prompts_pruned"] / prompts["prompts_drawn"] if prompts["prompts_drawn"] else 0.0
    summary = {"heldout_accuracy_before": round(before["accuracy"], 4),
               "heldout_accuracy_after": round(after["accuracy"], 4), "steps": trainer.step,
               "prompts_pruned_fraction": round(pruned_fraction, 4),
               "rollouts_saved": int(prompts["prompts_pruned"]) * args.n_samples_per_prompt,
               "seconds": round(time.perf_counter() - start, 1)}
    named = {name: {"before": round(before["sets"][name]["accuracy"], 4), "after": round(result["accuracy"], 4)}
             for name, result in after.get("sets", {}).items() if name and name in before.get("sets", {})}
    if named:  # --eval-prompt-data NAME SOURCE ...: each set's before and after (the first is the headline above)
        summary["heldout_sets"] = named
    if rank0 and trainer.maker.partial is not None:  # every started sample trained once, or counted here
        summary["partial_rollout_samples"] = {**trainer.maker.partial.counts,
                                              "samples_open_at_end": trainer.maker.partial.samples_in_flight()}
    if rank0:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / "summary.json").write_text(json.dumps({**summary, "seconds_rl": seconds_rl}))
    watchdog.stop()
    destroy_parallel()
    return summary

"""The peer baseline: Hugging Face TRL's GRPOTrainer against our GRPO, same warm start, prompts, reward, held-out set.

    1. warm start: bench/time_to_accuracy.py's (cached) ─► megatron_dppo.actor.conversion.megatron_to_hf ─► HF dir
    2. ours: examples/pretrain_dppo.py --algorithm grpo with time_to_accuracy's flags, budget and evaluations
    3. peer: those flags mapped onto TRL's GRPOConfig (the mapping is printed), run by TRL 1.16 in its own environment
       (tools/setup_peer_env.sh) by bench/peer_grpo_trl.py: one process, 2 threads, in-process `generate`. Its
       prompts are the draws of our run's task in our order; its rewards and held-out scores are our task.score,
       computed in this process and sent over a socket pair; greedy held-out accuracy every --eval-interval steps,
       a budget of as many seconds as ours
       ─► <out>/runs/trl-peer/seed_<n>/metrics.jsonl + summary.json, the layout our trainer writes
    4. generation alone, on one step's 16 prompts x 8 samples: in-process HF `generate` as TRL calls it, against the
       embedded engine as the trainer starts it (and with the same threads as `generate`)
    5. tables (medians over steps and repeats), curves (megatron_dppo/metrics.py plot_runs), `name: value` lines

The bench times what each trainer times: a step of ours is the trainer's seconds_step (rollout, reward, update,
weight sync); a step of TRL's runs from the end of one optimizer step to the end of the next (generation, reward,
forward/backward, clip, optimizer, its per-step logging), evaluations excluded. Both stop after the step that
crosses the budget: ours counts RL time only (the trainer leaves its evaluations out), TRL's wall time with its
evaluations in, so a dense --eval-interval shortens TRL's training (docs/peer.md's run evaluated every 50 steps).
Runs are resumable: a finished run (summary.json, same command or config) is read, not run again; pointing --out-dir
at a time_to_accuracy output reuses its warm start and GRPO runs.

Examples:
    bash tools/setup_peer_env.sh                                    # once: TRL's environment, outside the repo
    python bench/peer_grpo.py --eval-interval 50                    # time_to_accuracy's 75 s each
    python bench/peer_grpo.py --budget-s 1 --warm-start-steps 50 --eval-size 32 --out-dir runs/peer_smoke
Last lines: our_grpo_step_vs_trl, embedded_engine_vs_hf_generate_tokens_per_s and their parts, as `name: value`.
"""

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import accuracy_runs, peer_grpo_trl  # noqa: E402
from bench.markdown_table import markdown  # noqa: E402
from bench.peer_grpo_trl import TRL_VERSION, completion_up_to_eos  # noqa: E402
from bench.run_costs import model_size, with_costs  # noqa: E402
from megatron_dppo.launch.arguments import parse_args as parse_training_args  # noqa: E402
from megatron_dppo.metrics import load_run, plot_runs  # noqa: E402

PEER_METHOD = "trl-peer"
THREADS = 2  # the peer as a user would run it on this 2-core machine: one process, both cores
# The peer reads a precomputed stream of prompts: enough for the budget at this many seconds per step at the fastest.
MIN_STEP_SECONDS = 0.02
# Our loss aggregations in TRL's names (algo/losses.py and TRL's GRPOConfig.loss_type: the same normalisers).
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
# Our advantage estimators in TRL's scale_rewards: (r - mean) / (std + eps), or r - mean. Both use the unbiased std.
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}


def default_peer_env() -> Path:
    """Where tools/setup_peer_env.sh puts TRL's environment when given no directory."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "megatron_dppo" / "trl-peer-env"


# ------------------------------------------------------------------------------------------------ hyper-parameters
@dataclass
class Setting:
    """One of our settings and what the peer is given for it."""

    ours: str  # our flag(s)
    value: str  # their value in our run
    trl: dict  # GRPOConfig fields
    note: str = ""


def trl_settings(args) -> list[Setting]:
    """Our parsed GRPO flags as GRPOConfig fields, one row per setting; refuses what TRL cannot mirror."""
    refusals = [
        (args.algorithm != "grpo", f"--algorithm {args.algorithm}: the peer is GRPO; give the GRPO run's flags"),
        (args.kl_coef != 0, f"--kl-coef {args.kl_coef}: the peer mirrors runs without a KL term (TRL's beta is k3 "
                            "only); use --kl-coef 0"),
        (args.entropy_coef != 0, f"--entropy-coef {args.entropy_coef}: the peer mirrors runs without an entropy "
                                 "bonus; use --entropy-coef 0"),
        (args.eps_clip_c is not None, f"--eps-clip-c {args.eps_clip_c}: TRL has no dual clip; drop the flag"),
        (args.advantage_estimator not in SCALE_REWARDS,
         f"--advantage-estimator {args.advantage_estimator}: TRL's GRPOTrainer has {sorted(SCALE_REWARDS)} only"),
        (args.dapo_oversample != 1.0, f"--dapo-oversample {args.dapo_oversample}: TRL has no over-sampling; use 1"),
        (args.async_rollout, "--async: TRL's GRPOTrainer generates on-policy in-process; drop --async"),
        (args.lr_decay_style != "constant", f"--lr-decay-style {args.lr_decay_style}: the peer maps only constant"),
        (args.rollout_top_k == 0, "--rollout-top-k 0 is not a valid top-k"),
    ]
    problems = [message for refused, message in refusals if refused]
    if problems:
        raise ValueError("the TRL peer cannot mirror this run: " + "; ".join(problems))
    batch, group = args.rollout_batch_size, args.n_samples_per_prompt
    warmup = args.lr_warmup_iters
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return [
        Setting("--rollout-batch-size x --n-samples-per-prompt", f"{batch} x {group}",
                {"per_device_train_batch_size": batch * group, "generation_batch_size": batch * group,
                 "gradient_accumulation_steps": 1, "num_generations": group},
                "one generation batch, one optimizer step"),
        Setting("--ppo-epochs", str(args.ppo_epochs), {"num_iterations": args.ppo_epochs}),
        Setting("--lr, --lr-decay-style, --lr-warmup-iters", f"{args.lr}, constant, {warmup}",
                {"learning_rate": args.lr, "lr_scheduler_type": "constant_with_warmup" if warmup else "constant",
                 "warmup_steps": warmup}, "TRL's default schedule is linear decay"),
        Setting("--adam-beta1, --adam-beta2, --adam-eps, --weight-decay",
                f"{args.adam_beta1}, {args.adam_beta2}, {args.adam_eps}, {args.weight_decay}",
                {"optim": "adamw_torch", "adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2,
                 "adam_epsilon": args.adam_eps, "weight_decay": args.weight_decay}),
        Setting("--clip-grad", str(args.clip_grad), {"max_grad_norm": args.clip_grad}),
        Setting("--rollout-temperature, --rollout-top-p, --rollout-top-k",
                f"{args.rollout_temperature}, {args.rollout_top_p}, {args.rollout_top_k}",
                {"temperature": args.rollout_temperature, "top_p": args.rollout_top_p,
                 "top_k": 0 if args.rollout_top_k == -1 else args.rollout_top_k}, "top-k off: -1 ours, 0 TRL's"),
        Setting("--rollout-max-response-len", str(args.rollout_max_response_len),
                {"max_completion_length": args.rollout_max_response_len}),
        Setting("--loss-agg-mode", args.loss_agg_mode, {"loss_type": LOSS_TYPES[args.loss_agg_mode]},
                "same normaliser: the full batch's response tokens (token-mean), sequences, or sequences x L_max"),
        Setting("--eps-clip, --eps-clip-high", f"{args.eps_clip}, {args.eps_clip_high}",
                {"epsilon": args.eps_clip, "epsilon_high": args.eps_clip_high}),
        Setting("--importance-level", args.importance_level, {"importance_sampling_level": args.importance_level}),
        Setting("--kl-coef, --entropy-coef", f"{args.kl_coef}, {args.entropy_coef}",
                {"beta": 0.0, "entropy_coef": 0.0}, "no reference model"),
        Setting("--advantage-estimator", args.advantage_estimator,
                {"scale_rewards": SCALE_REWARDS[args.advantage_estimator]},
                "both divide by the unbiased group std; + 1e-6 ours, + 1e-4 TRL's"),
        Setting("--dapo-filter", str(args.dapo_filter), {},
                "TRL has no filter: its zero-variance groups get advantage 0 and count in the normaliser, as ours "
                "do, so the update is the same; TRL still runs forward/backward on them" if args.dapo_filter
                else "off on both sides"),
        Setting("--rollout-correction", f"{args.rollout_correction} (cap {args.rollout_correction_cap})", {},
                "no TRL equivalent without vLLM: its sampler is the trained model itself"),
        Setting("precision (--bf16/--fp16)", precision,
                {"bf16": args.bf16, "fp16": args.fp16, "model_init_kwargs": {"dtype": "float32"}},
                "fp32 weights; TRL's default is bf16"),
        Setting("activation recompute", "none", {"gradient_checkpointing": False}, "TRL's default is on"),
        Setting("--rl-seed", str(args.rl_seed), {"seed": args.rl_seed, "shuffle_dataset": False},
                "TRL's sampling seed; the prompts are our run's draws, in order"),
    ]


def trl_config(args, max_steps: int, output_dir: str) -> dict:
    """GRPOConfig keyword arguments: the mapped settings plus the run's bookkeeping."""
    config = {"output_dir": output_dir, "max_steps": max_steps, "use_cpu": True, "logging_steps": 1,
              "report_to": "none", "save_strategy": "no", "disable_dropout": True, "dataloader_num_workers": 0}
    for setting in trl_settings(args):
        config.update(setting.trl)
    return config


def trl_generation_kwargs(max_new_tokens: int, temperature: float, top_p: float, top_k: int, pad_token_id: int,
                          bos_token_id: int | None, eos_token_ids: list[int]) -> dict:
    """The GenerationConfig TRL 1.16's GRPOTrainer builds for in-process `generate` (its __init__, no vLLM)."""
    return {"max_new_tokens": max_new_tokens, "do_sample": True, "pad_token_id": pad_token_id,
            "bos_token_id": bos_token_id, "eos_token_id": eos_token_ids, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "min_p": None, "repetition_penalty": 1.0, "cache_implementation": None,
            "disable_compile": True}


# ------------------------------------------------------------------------------------------------ reward service
def score_completions(task, tokenizer, prompts_by_id: dict, prompt_ids: list[int],
                      completion_ids: list[list[int]]) -> list[float]:
    """Our reward, as the trainer computes it: decode with our tokenizer (special tokens kept), then task.score."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompt ids for {len(completion_ids)} completions")
    return task.score([tokenizer.decode(ids) for ids in completion_ids],
                      [prompts_by_id[prompt_id].reference for prompt_id in prompt_ids])


def serve_scores(connection: Connection, score, process: subprocess.Popen, deadline: float) -> None:
    """Answer (prompt_ids, completion_ids) requests with score(...) until the peer closes its end or exits."""
    while True:
        if connection.poll(1.0):
            try:
                prompt_ids, completion_ids = connection.recv()
            except EOFError:
                return
            connection.send(score(prompt_ids, completion_ids))
        elif process.poll() is not None:
            return
        elif time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("the TRL peer ran past its deadline (budget + start-up + evaluations); it was killed")


# ------------------------------------------------------------------------------------------------ orchestration
def export_warm_start(warm_start: Path, out_dir: Path) -> Path:
    """The warm start as an HF directory (tokenizer from its embedded init), once per warm start."""
    from megatron_dppo.actor.conversion import megatron_to_hf

    hf_dir = out_dir / f"{warm_start.parent.name}_hf"  # embedded_<cache key>: a new warm start gets a new export
    if not (hf_dir / "config.json").is_file():
        megatron_to_hf(warm_start, hf_dir, tokenizer_dir=warm_start.parent / "init")
    return hf_dir


def load_task(args, hf_dir: Path):
    """The task our trainer builds from these flags, with the exported tokenizer (the warm start's)."""
    from megatron_dppo.launch.run import build_task, load_tokenizer

    tokenizer = load_tokenizer(hf_dir)
    return build_task(args, tokenizer), tokenizer


def run_peer(settings, seed: int, warm_start: Path, hf_dir: Path, ours_dir: Path, peer_python: Path,
             threads: int) -> Path:
    """The TRL run of one seed, unless finished with the same config; its directory."""
    run_dir = settings.out_dir / "runs" / PEER_METHOD / f"seed_{seed}"
    args = parse_training_args(accuracy_runs.rl_flags(settings, "grpo", seed, warm_start))
    task, tokenizer = load_task(args, hf_dir)
    steps = math.ceil(settings.budget_s / MIN_STEP_SECONDS)
    draws = [task.next_prompts(args.rollout_batch_size) for _ in range(steps)]  # the trainer's draws, in order
    heldout = task.heldout(args.eval_size)
    pool = {p.prompt_id: p for p in [*(p for batch in draws for p in batch), *heldout]}
    config = {
        "model_dir": str(hf_dir), "run_dir": str(run_dir), "threads": threads, "budget_s": settings.budget_s,
        "eval_interval": settings.eval_interval,
        "expected_accuracy_before": json.loads((ours_dir / "summary.json").read_text())["heldout_accuracy_before"],
        "trl": trl_config(args, steps, str(run_dir / "trl_output")),
        # the text TRL tokenizes is what the ids spell (a templated prompt's Prompt.text would not be)
        "pool": {str(i): {"text": tokenizer.decode(p.input_ids), "input_ids": p.input_ids} for i, p in pool.items()},
        "stream": [p.prompt_id for batch in draws for p in batch],
        "heldout": [{"prompt_id": p.prompt_id, "input_ids": p.input_ids} for p in heldout],
    }
    config_file = run_dir / "config.json"
    if (run_dir / "summary.json").is_file() and config_file.is_file() and json.loads(config_file.read_text()) == config:
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").unlink(missing_ok=True)
    config_file.write_text(json.dumps(config))
    ours_end, peers_end = socket.socketpair()
    with open(run_dir / "stdout.log", "w") as log:
        process = subprocess.Popen([str(peer_python), peer_grpo_trl.__file__, str(config_file), "--socket-fd",
                                    str(peers_end.fileno())], pass_fds=[peers_end.fileno()], stdout=log,
                                   stderr=subprocess.STDOUT, cwd=REPO)
    peers_end.close()
    connection = Connection(ours_end.detach())
    deadline = time.monotonic() + 3 * settings.budget_s + 900  # start-up, evaluations, a slow loaded machine

    def score(prompt_ids, completion_ids):
        return score_completions(task, tokenizer, pool, prompt_ids, completion_ids)

    try:
        serve_scores(connection, score, process, deadline)
    finally:
        connection.close()
        returncode = process.wait()
    if returncode != 0 or not (run_dir / "summary.json").is_file():
        raise RuntimeError(f"the TRL peer failed (exit {returncode}); its output is in {run_dir / 'stdout.log'}")
    return run_dir


def interleaved_rates(generators: dict, repeats: int) -> dict:
    """generators: name -> generate(repeat) returning tokens generated. One untimed warm-up call each (repeat 0),
    then `repeats` rounds that call every generator in turn, so a load change on a shared machine hits all alike.
    Per generator: the median tokens/s and tokens per call over the rounds."""
    for generate in generators.values():
        generate(0)
    rates = {name: [] for name in generators}
    tokens = {name: [] for name in generators}
    for repeat in range(1, repeats + 1):
        for name, generate in generators.items():
            start = time.perf_counter()
            count = generate(repeat)
            rates[name].append(count / (time.perf_counter() - start))
            tokens[name].append(count)
    return {name: {"tokens_per_s": statistics.median(rates[name]), "tokens": statistics.median(tokens[name])}
            for name in generators}


def hf_generator(hf_dir: Path, args, tokenizer, prompts: list, threads: int):
    """In-process HF `generate` of every prompt G times, with the GenerationConfig TRL builds; -> generate(repeat)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(threads)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    generation = GenerationConfig(**trl_generation_kwargs(
        args.rollout_max_response_len, args.rollout_temperature, args.rollout_top_p,
        0 if args.rollout_top_k == -1 else args.rollout_top_k, pad, tokenizer.bos_token_id, [eos]))
    rows = [p.input_ids for p in prompts for _ in range(args.n_samples_per_prompt)]  # TRL's order: G in a row
    width = max(map(len, rows))
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # [B*G, width], left-padded
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

    def generate(repeat: int) -> int:
        torch.manual_seed(repeat)
        with torch.no_grad():
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation)
        return sum(len(completion_up_to_eos(row[width:].tolist(), {eos}, pad)) for row in output)

    return generate


def engine_generator(url: str, args, task, tokenizer, prompts: list):
    """The embedded engine asked as the trainer asks it (its client settings, seeded, n=G); -> generate(repeat)."""
    from megatron_dppo.pipeline.experience import ExperienceMaker
    from megatron_dppo.rollout.client import RolloutClient

    client = RolloutClient([url], max_concurrency=args.rollout_max_concurrency,
                           request_timeout_s=args.rollout_timeout_s)
    maker = ExperienceMaker(args, task, tokenizer, client)

    def generate(repeat: int) -> int:
        completions = client.generate([p.input_ids for p in prompts], maker.sampling_for_step(repeat),
                                      args.n_samples_per_prompt)
        return sum(len(c.output_ids) for c in completions)

    return generate


def generation_benchmark(args, hf_dir: Path, threads: int, repeats: int, processes: int) -> dict:
    """One step's prompts x G samples: in-process HF `generate` as TRL calls it, and the embedded engine started as
    run.start_rollout starts it under `processes` trainer processes, and with one worker of `generate`'s threads."""
    from megatron_dppo.launch.run import embedded_engine_options
    from megatron_dppo.rollout.launcher import launch_embedded_engine

    task, tokenizer = load_task(args, hf_dir)
    prompts = task.next_prompts(args.rollout_batch_size)  # the first step's draw of the GRPO run
    generators = {f"hf_generate_{threads}_threads": hf_generator(hf_dir, args, tokenizer, prompts, threads)}
    trainer_options = embedded_engine_options(args, processes)
    with contextlib.ExitStack() as engines:
        for name, options in (("engine_as_trainer", trainer_options), ("engine_same_threads", {"threads": threads})):
            handle = engines.enter_context(launch_embedded_engine(str(hf_dir), **options))
            generators[name] = engine_generator(handle.url, args, task, tokenizer, prompts)
        rates = interleaved_rates(generators, repeats)
    return {"sequences": len(prompts) * args.n_samples_per_prompt, "trainer_engine_options": trainer_options, **rates}


# ------------------------------------------------------------------------------------------------ report
def median_of(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else float("nan")


def step_costs(records: list[dict]) -> dict:
    """Median per-step costs of one method's records (all seeds pooled)."""
    return {
        "seconds_step": median_of(records, "seconds_step"),
        "seconds_rollout": median_of(records, "seconds_rollout"),
        "seconds_update": median_of(records, "seconds_update"),
        "seconds_reward": median_of(records, "seconds_reward"),
        "seconds_sync": median_of(records, "seconds_sync"),
        "tokens_per_second_rollout": median_of(records, "tokens_per_second_rollout"),
        "tokens_generated": median_of(records, "tokens_generated"),
    }


def step_cost_table(ours: dict, peer: dict) -> tuple[str, dict]:
    """Markdown rows of median step costs and the ratios the issue names (ours / TRL's; > 1: ours is slower)."""
    def ms(value):
        return "-" if math.isnan(value) else f"{1000 * value:.0f}"

    rows = [[name, ms(c["seconds_step"]), ms(c["seconds_rollout"]), ms(c["seconds_reward"]), ms(c["seconds_update"]),
             ms(c["seconds_sync"]), f"{c['tokens_generated']:.0f}", f"{c['tokens_per_second_rollout']:.0f}"]
            for name, c in (("ours (GRPO)", ours), ("TRL peer", peer))]
    ratios = {"our_grpo_step_vs_trl": ours["seconds_step"] / peer["seconds_step"],
              "our_rollout_vs_trl_generation": ours["seconds_rollout"] / peer["seconds_rollout"],
              "our_update_vs_trl_update": ours["seconds_update"] / peer["seconds_update"],
              "our_generation_tokens_per_s_vs_trl": ours["tokens_per_second_rollout"]
              / peer["tokens_per_second_rollout"]}
    header = ["run", "ms/step", "generation", "reward", "update", "weight sync", "tokens gen/step",
              "generation tokens/s"]
    return markdown(header, rows), ratios


def accuracy_rows(runs: dict) -> list[list[str]]:
    rows = []
    for name, (run, seconds_steps) in runs.items():
        rows.append([name, str(len(run.records)), f"{seconds_steps:.0f}",
                     f"{run.summary.get('heldout_accuracy_before', float('nan')):.3f}",
                     f"{run.summary.get('heldout_accuracy_after', float('nan')):.3f}"])
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="runs/peer_grpo",
                        help="runs and caches; a time_to_accuracy --out-dir reuses its warm start and GRPO runs")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="RL seeds (default 1)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="RL time per run (default: time_to_accuracy's, 75 s)")
    parser.add_argument("--warm-start-steps", type=int, default=None,
                        help="default: the worked task's embedded default")
    parser.add_argument("--eval-interval", type=int, default=None,
                        help="steps between evaluations (default: time_to_accuracy's, 6)")
    parser.add_argument("--eval-size", type=int, default=None,
                        help="held-out problems (default: time_to_accuracy's, 256)")
    parser.add_argument("--processes", type=int, default=2, help="our trainer's torchrun --nproc-per-node")
    parser.add_argument("--peer-python", default=str(default_peer_env() / "bin" / "python"),
                        help="python of TRL's environment (tools/setup_peer_env.sh)")
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads of the peer and of `generate`")
    parser.add_argument("--generate-repeats", type=int, default=5, help="timed repeats of the generation benchmark")
    args = parser.parse_args(argv)
    if not Path(args.peer_python).is_file():
        parser.error(f"--peer-python {args.peer_python} does not exist: run `bash tools/setup_peer_env.sh` "
                     "(or pass the python of an environment it built)")
    if args.threads < 1 or args.generate_repeats < 1:
        parser.error(f"--threads {args.threads} and --generate-repeats {args.generate_repeats} must be >= 1")
    return args


def time_to_accuracy_settings(options: argparse.Namespace):
    """time_to_accuracy's Settings for our GRPO runs: only the options given here override its defaults."""
    argv = ["--out-dir", options.out_dir, "--methods", "grpo", "--processes", str(options.processes)]
    for flag, value in (("--budget-s", options.budget_s), ("--warm-start-steps", options.warm_start_steps),
                        ("--eval-interval", options.eval_interval), ("--eval-size", options.eval_size)):
        if value is not None:
            argv += [flag, str(value)]
    if options.seeds:
        argv += ["--seeds", *map(str, options.seeds)]
    else:
        argv += ["--seeds", "1"]
    return accuracy_runs.parse_args(argv)


def generation_table(generation: dict, args, threads: int) -> tuple[str, dict]:
    """Rows of the generation benchmark and the engine / `generate` tokens/s ratios."""
    hf_key, engine_key, same_threads_key = f"hf_generate_{threads}_threads", "engine_as_trainer", "engine_same_threads"
    options = generation["trainer_engine_options"]
    names = {hf_key: f"in-process HF generate, {threads} thread(s) (TRL's path)",
             engine_key: f"embedded engine as the trainer starts it: {options['workers']} worker(s) x "
                         f"{options['threads']} thread(s)",
             same_threads_key: f"embedded engine, 1 worker x {threads} thread(s)"}
    rows = [[name, f"{generation[key]['tokens_per_s']:.0f}", f"{generation[key]['tokens']:.0f}"]
            for key, name in names.items()]
    hf_rate = generation[hf_key]["tokens_per_s"]
    ratios = {"embedded_engine_vs_hf_generate_tokens_per_s": generation[engine_key]["tokens_per_s"] / hf_rate,
              "embedded_engine_same_threads_vs_hf_generate_tokens_per_s":
                  generation[same_threads_key]["tokens_per_s"] / hf_rate}
    return markdown(["generator", "tokens/s", "tokens per call"], rows), ratios


def load_average() -> str:
    """The machine's 1-minute load average over its cores: timings mean little on a loaded machine."""
    return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    settings = time_to_accuracy_settings(options)
    started, load_at_start = time.perf_counter(), load_average()
    warm_start = accuracy_runs.prepare_warm_start(settings)
    hf_dir = export_warm_start(warm_start, settings.out_dir / "peer")
    size = model_size(hf_dir)
    runs = {"grpo": [], PEER_METHOD: []}
    for seed in settings.seeds:
        ours_dir = accuracy_runs.run_rl(settings, "grpo", seed, warm_start)
        peer_dir = run_peer(settings, seed, warm_start, hf_dir, ours_dir, Path(options.peer_python), options.threads)
        # seconds_steps: RL time without evaluations, the results page's x axis
        runs["grpo"].append(with_costs(load_run(ours_dir, "ours (GRPO)"), size, old_logprob_pass=False))
        runs[PEER_METHOD].append(with_costs(load_run(peer_dir, "TRL peer"), size, old_logprob_pass=False))
        print(f"finished seed {seed} ({time.perf_counter() - started:.0f} s so far)", flush=True)
    args = parse_training_args(accuracy_runs.rl_flags(settings, "grpo", settings.seeds[0], warm_start))
    generation = generation_benchmark(args, hf_dir, options.threads, options.generate_repeats, options.processes)

    mapping = markdown(["our setting", "value", "TRL GRPOConfig", "note"],
                           [[s.ours, s.value, ", ".join(f"{k}={v}" for k, v in s.trl.items()) or "-", s.note]
                            for s in trl_settings(args)])
    records = {method: [r for run in group for r in run.records] for method, group in runs.items()}
    costs_table, ratios = step_cost_table(step_costs(records["grpo"]), step_costs(records[PEER_METHOD]))
    generation_rows, generation_ratios = generation_table(generation, args, options.threads)
    accuracy = markdown(
        ["run (seed)", "steps", "RL step time (s)", "held-out before", "held-out after"],
        accuracy_rows({f"{run.label} ({seed})": (run, run.records[-1]["seconds_steps"])
                       for method in runs for seed, run in zip(settings.seeds, runs[method])}))
    figures = plot_runs([run for group in runs.values() for run in group], settings.out_dir / "figures",
                        ("heldout_accuracy", "reward_mean"), ("seconds_steps", "step"), smooth=10,
                        title="ours (GRPO) vs TRL's GRPOTrainer, same warm start")
    print("\n\n".join([
        f"Settings: seeds {settings.seeds}, RL budget {settings.budget_s:.0f} s per run, {settings.eval_size} held-out "
        f"problems every {settings.eval_interval} steps; peer: TRL {TRL_VERSION}, one process, {options.threads} "
        f"thread(s); ours: {settings.processes} processes + the embedded engine. Load average at start "
        f"{load_at_start}, at the end {load_average()}.",
        f"### Hyper-parameters (ours -> TRL)\n\n{mapping}",
        f"### Step cost, median over every step of every seed (ms)\n\n{costs_table}",
        f"### Generation alone: {generation['sequences']} sequences (one step's prompts x samples), median of "
        f"{options.generate_repeats} interleaved rounds after a warm-up\n\n{generation_rows}",
        f"### Accuracy\n\n{accuracy}",
        "Figures: " + ", ".join(str(path) for path in figures),
        f"Bench wall time: {time.perf_counter() - started:.0f} s",
    ]))
    for name, value in {**ratios, **generation_ratios}.items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()

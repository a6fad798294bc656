"""Command-line arguments of examples/pretrain_dppo.py, grouped by subsystem and validated once at start-up.

Megatron's own flags keep Megatron-LM's names (--tensor-model-parallel-size, --lr, --save, ...); ours come in
prefixed groups: --rollout-*, --dppo-* (and the other algorithms' options), --reward-*, --data-*, --warm-start-*.
Every --sglang-* flag is forwarded verbatim to `python -m sglang.launch_server` (without the prefix).
A bad combination is reported naming both flags and the fix.
"""

import argparse
import os
from dataclasses import dataclass

from megatron_dppo.data.synthetic import TASKS as SYNTHETIC_TASKS

ALGORITHMS = ("grpo", "dppo", "cppo", "d3s")
PROMPT_DATA = ("synthetic", "math", "gsm8k")

# The embedded default (no --hf-checkpoint, embedded engine, synthetic prompts) starts from these unless a flag
# says otherwise: a tiny model, a supervised warm start cached under --cache-dir, a wall-time budget for RL.
EMBEDDED_DEFAULTS = dict(
    lr=1e-4, rollout_batch_size=16, n_samples_per_prompt=8, dapo_filter=True, time_budget_s=200.0,
    max_tokens_per_gpu=4096, log_dir="runs/embedded",
)
# ... and these, by --synthetic-task: how long a response may get, and what the warm start sees. The worked task's
# warm start sees worked solutions for a limited set only (--warm-start-problems of them, from --warm-start-cells),
# while RL draws answer-only prompts from every cell, so RL has something to earn (docs/trainer.md, calibration).
EMBEDDED_TASK_DEFAULTS = {
    "worked": dict(rollout_max_response_len=176, warm_start_steps=600, warm_start_lr=3e-3, warm_start_batch_size=64,
                   warm_start_problems=500, warm_start_cells=None),
    "answer": dict(rollout_max_response_len=8, warm_start_steps=900, warm_start_lr=3e-3, warm_start_batch_size=128,
                   warm_start_problems=0, warm_start_cells=None),
}
EMBEDDED_HEAD_DIM = 32  # the tiny model's attention heads: --embedded-hidden-size / 32 of them


def _by_task(key: str) -> str:
    """'worked: 600, answer: 900': a warm-start flag's embedded defaults, for its --help."""
    return ", ".join(f"{task}: {defaults[key]}" for task, defaults in EMBEDDED_TASK_DEFAULTS.items())


def is_embedded_default(args) -> bool:
    return args.rollout_backend == "embedded" and not args.hf_checkpoint and args.data_prompts == "synthetic"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_dppo.py",
        description="GRPO-family RL with DPPO on Megatron-Core. With no arguments on a CPU machine: the embedded "
        "default (tiny model, synthetic arithmetic, embedded rollout engine).",
    )
    megatron = parser.add_argument_group("megatron (Megatron-LM flag names)")
    megatron.add_argument("--tensor-model-parallel-size", type=int, default=1)
    megatron.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    megatron.add_argument("--sequence-parallel", action="store_true")
    megatron.add_argument("--use-distributed-optimizer", action="store_true")
    megatron.add_argument("--bf16", action="store_true")
    megatron.add_argument("--fp16", action="store_true")
    megatron.add_argument("--hf-checkpoint", help="HF model directory to start from (config.json + safetensors)")
    megatron.add_argument("--load", help="resume from a Megatron checkpoint (save dir or iter_* dir)")
    megatron.add_argument("--save", help="directory for Megatron distributed checkpoints")
    megatron.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: only at the end)")
    megatron.add_argument("--keep-last-checkpoints", type=int, default=2)
    megatron.add_argument("--train-iters", type=int, default=None, help="RL steps (default: until the time budget)")
    megatron.add_argument("--lr", type=float, default=1e-6)
    megatron.add_argument("--min-lr", type=float, default=0.0)
    megatron.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant")
    megatron.add_argument("--lr-warmup-iters", type=int, default=0)
    megatron.add_argument("--clip-grad", type=float, default=1.0)
    megatron.add_argument("--weight-decay", type=float, default=0.0)
    megatron.add_argument("--adam-beta1", type=float, default=0.9)
    megatron.add_argument("--adam-beta2", type=float, default=0.999)
    megatron.add_argument("--adam-eps", type=float, default=1e-8)
    megatron.add_argument("--seed", type=int, default=1234)
    megatron.add_argument("--rl-seed", type=int, default=None,
                          help="seed of the RL phase (prompt order, sampling, pruning draws); default: --seed. Vary "
                               "it to repeat RL from one warm start (the warm start is keyed by --seed)")
    megatron.add_argument("--max-tokens-per-gpu", type=int, default=8192, help="token budget of one micro-batch")
    megatron.add_argument("--packing-window", type=int, default=256, help="Dense Prompt Packing window W")
    megatron.add_argument("--log-dir", default="runs/dppo", help="metrics.jsonl and TensorBoard events")
    megatron.add_argument("--time-budget-s", type=float, default=None,
                          help="stop RL when this many seconds have passed since start (after the current step)")

    rollout = parser.add_argument_group("rollout")
    rollout.add_argument("--rollout-backend", choices=("embedded", "sglang", "external"), default="embedded",
                         help="embedded: our CPU engine; sglang: start SGLang servers; external: --rollout-urls")
    rollout.add_argument("--rollout-urls", nargs="*", default=[], help="servers started elsewhere (Slurm)")
    rollout.add_argument("--rollout-num-servers", type=int, default=1)
    rollout.add_argument("--rollout-batch-size", type=int, default=16, help="prompts per RL step")
    rollout.add_argument("--n-samples-per-prompt", type=int, default=8, help="group size G")
    rollout.add_argument("--rollout-temperature", type=float, default=1.0)
    rollout.add_argument("--rollout-top-p", type=float, default=1.0)
    rollout.add_argument("--rollout-top-k", type=int, default=-1)
    rollout.add_argument("--rollout-max-response-len", type=int, default=1024)
    rollout.add_argument("--rollout-max-concurrency", type=int, default=64)
    rollout.add_argument("--rollout-timeout-s", type=float, default=600.0)
    rollout.add_argument("--rollout-weight-bucket-mb", type=int, default=512, help="weight-sync bucket size")
    rollout.add_argument("--rollout-server-gpus", type=int, default=1,
                         help="GPUs of one rollout server (SGLang tp x dp): its ranks in the weight-sync group")
    rollout.add_argument("--weight-sync-master-address", default=None,
                         help="address of trainer rank 0 that rollout servers reach for the weight-sync group "
                              "(default: 127.0.0.1 for local servers, this host's address for external ones)")
    rollout.add_argument("--rollout-engine-threads", type=int, default=1, help="torch threads of the embedded engine")
    rollout.add_argument("--async", dest="async_rollout", action="store_true",
                         help="generate step t+1 while step t trains (one step off-policy, corrected by TIS)")

    algo = parser.add_argument_group("algorithm (--dppo-* and the other pruners)")
    algo.add_argument("--algorithm", choices=ALGORITHMS, default="dppo")
    algo.add_argument("--dppo-prompt-prune-rate", type=float, default=0.5)
    algo.add_argument("--dppo-completion-prune-rate", type=float, default=0.5)
    algo.add_argument("--dppo-mode", choices=("stochastic", "deterministic"), default="stochastic")
    algo.add_argument("--dppo-keep-policy", choices=("uniform", "proportional"), default="proportional")
    algo.add_argument("--dppo-prompt-p-min", type=float, default=0.3)
    algo.add_argument("--dppo-completion-p-min", type=float, default=0.05)
    algo.add_argument("--dppo-candidates", choices=("all", "below_mean"), default="below_mean")
    # the names of algo.history.PROMPT_SCORES, written out so that parsing (and --dry-run) does not import torch
    algo.add_argument("--dppo-prompt-score", choices=("mean_abs_advantage", "reward_std", "unsolved_rate"),
                      default="mean_abs_advantage",
                      help="what the prompt history records: mean |A| or reward std (0 for all-correct and all-wrong "
                           "groups), or unsolved_rate = 1 - mean reward (0 only for solved prompts; rewards in [0, 1])")
    algo.add_argument("--cppo-prune-rate", type=float, default=0.5)
    algo.add_argument("--cppo-scope", choices=("per_group", "batch"), default="per_group")
    algo.add_argument("--cppo-refill", action="store_true", help="draw batch / (1 - P) prompts (CPPO's allocation)")
    algo.add_argument("--d3s-sample-fraction", type=float, nargs=2, default=(0.25, 0.75), metavar=("INIT", "FINAL"))
    algo.add_argument("--d3s-token-fraction", type=float, nargs=2, default=(0.5, 1.0), metavar=("INIT", "FINAL"))
    algo.add_argument("--dapo-filter", action=argparse.BooleanOptionalAction, default=False,
                      help="drop groups whose rewards are all equal")
    algo.add_argument("--dapo-oversample", type=float, default=1.0, help="prompts drawn per step / kept (refill)")
    algo.add_argument("--advantage-estimator", choices=("grpo", "dr_grpo", "rloo"), default="grpo")
    algo.add_argument("--loss-agg-mode", default="token-mean",
                      choices=("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"))
    algo.add_argument("--eps-clip", type=float, default=0.2)
    algo.add_argument("--eps-clip-high", type=float, default=0.28)
    algo.add_argument("--eps-clip-c", type=float, default=None, help="dual-clip constant (e.g. 3)")
    algo.add_argument("--kl-coef", type=float, default=0.0, help="> 0 loads a frozen reference model")
    algo.add_argument("--kl-type", choices=("k1", "k2", "k3", "low_var_kl"), default="low_var_kl")
    algo.add_argument("--entropy-coef", type=float, default=0.0)
    algo.add_argument("--importance-level", choices=("token", "sequence"), default="token", help="sequence: GSPO")
    algo.add_argument("--tis-cap", type=float, default=2.0, help="truncated IS cap for rollout/trainer mismatch")
    algo.add_argument("--ppo-epochs", type=int, default=1, help="update passes over each rollout batch")
    algo.add_argument("--history-ema-decay", type=float, default=0.5)

    reward = parser.add_argument_group("reward")
    reward.add_argument("--reward-fn", choices=("synthetic", "math", "gsm8k"), default=None,
                        help="default: the one matching --data-prompts")
    reward.add_argument("--reward-timeout-s", type=float, default=5.0)

    data = parser.add_argument_group("data")
    data.add_argument("--data-prompts", default="synthetic", help="synthetic | math | gsm8k")
    data.add_argument("--data-train-size", type=int, default=4000,
                      help="synthetic: size of the recurring training pool (prompts recur, so history can prune)")
    data.add_argument("--data-synthetic-cells", nargs="+", default=None, metavar="OxD",
                      help="synthetic difficulty cells: O operators x D max digits (default: --synthetic-task's)")
    data.add_argument("--data-skip-bad-rows", action="store_true")
    data.add_argument("--eval-size", type=int, default=500, help="held-out problems evaluated before and after")
    data.add_argument("--eval-interval", type=int, default=0, help="also evaluate every N steps (0: never)")

    synthetic = parser.add_argument_group("synthetic task")
    synthetic.add_argument("--synthetic-task", choices=SYNTHETIC_TASKS, default="worked",
                           help="worked: the response writes each intermediate result, then '#', the final answer and "
                                "'$' (the reward reads the final answer only); answer: the answer and '$' alone")

    warm = parser.add_argument_group("embedded default (tiny model, supervised warm start; defaults by task)")
    warm.add_argument("--warm-start-steps", type=int, default=None,
                      help=f"supervised steps ({_by_task('warm_start_steps')})")
    warm.add_argument("--warm-start-lr", type=float, default=None, help=f"peak lr ({_by_task('warm_start_lr')})")
    warm.add_argument("--warm-start-batch-size", type=int, default=None,
                      help=f"problems per supervised step ({_by_task('warm_start_batch_size')})")
    warm.add_argument("--warm-start-problems", type=int, default=None,
                      help="the warm start's worked solutions come from a fixed pool of this many problems, revisited "
                           f"in epochs; 0: a fresh problem every step ({_by_task('warm_start_problems')})")
    warm.add_argument("--warm-start-cells", nargs="+", default=None, metavar="OxD",
                      help="cells of the warm start's problems (default: the RL cells, --data-synthetic-cells)")
    warm.add_argument("--embedded-hidden-size", type=int, default=128,
                      help=f"tiny model width, a multiple of {EMBEDDED_HEAD_DIM} (one head per {EMBEDDED_HEAD_DIM})")
    warm.add_argument("--embedded-num-layers", type=int, default=3, help="tiny model depth")
    warm.add_argument("--cache-dir", default="cache", help="where the warm start is cached and reused")

    ops = parser.add_argument_group("operations")
    ops.add_argument("--dry-run", action="store_true", help="print the launch plan and parallel layout, start nothing")
    return parser


def embedded_errors(args: argparse.Namespace) -> list[str]:
    """The synthetic task's and the tiny model's flags, checked where they are used (the embedded default)."""
    from megatron_dppo.data.synthetic import TASK_CELLS, max_target_length, parse_cell

    errors = []
    for flag, cells in (("--data-synthetic-cells", args.data_synthetic_cells),
                        ("--warm-start-cells", args.warm_start_cells)):
        for cell in cells or ():
            try:
                parse_cell(cell)
            except ValueError as error:
                errors.append(f"{flag}: {error}")
    if errors or not is_embedded_default(args):
        return errors
    longest = max_target_length(args.data_synthetic_cells or TASK_CELLS[args.synthetic_task], args.synthetic_task)
    if args.rollout_max_response_len < longest:
        errors.append(f"--rollout-max-response-len {args.rollout_max_response_len} cuts the longest "
                      f"{args.synthetic_task} responses of the cells ({longest} tokens), which could never score: "
                      f"raise it to {longest} or choose shorter --data-synthetic-cells")
    hidden = args.embedded_hidden_size
    if hidden < EMBEDDED_HEAD_DIM or hidden % EMBEDDED_HEAD_DIM:
        errors.append(f"--embedded-hidden-size {hidden} must be a positive multiple of {EMBEDDED_HEAD_DIM}")
    for flag, value, minimum in (("--embedded-num-layers", args.embedded_num_layers, 1),
                                 ("--warm-start-steps", args.warm_start_steps, 0),
                                 ("--warm-start-batch-size", args.warm_start_batch_size, 1),
                                 ("--warm-start-problems", args.warm_start_problems, 0)):
        if value < minimum:
            errors.append(f"{flag} {value} must be >= {minimum}")
    return errors


@dataclass
class Topology:
    world_size: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; `args.sglang_args` holds the forwarded --sglang-* flags."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if is_embedded_default(args):
        parser.set_defaults(**EMBEDDED_DEFAULTS, **EMBEDDED_TASK_DEFAULTS[args.synthetic_task])
        args, unknown = parser.parse_known_args(argv)
    sglang_args, rest = [], []
    for index, token in enumerate(unknown):
        takes_value = index > 0 and unknown[index - 1].startswith("--sglang-") and "=" not in unknown[index - 1]
        if token.startswith("--sglang-") or (takes_value and not token.startswith("--")):
            sglang_args.append(token)
        else:
            rest.append(token)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.sglang_args = sglang_args
    validate(args, parser)
    return args


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Reject bad combinations with a message naming both flags and the fix."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    errors = []
    if world % model_parallel:
        errors.append(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x "
                      f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} = {model_parallel} does not "
                      f"divide the {world} launched processes: launch a multiple of {model_parallel} (torchrun "
                      "--nproc-per-node) or lower the parallel sizes")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1: drop it or raise TP")
    if args.bf16 and args.fp16:
        errors.append("--bf16 and --fp16 are exclusive: pick one")
    if args.rollout_backend == "external" and not args.rollout_urls:
        errors.append("--rollout-backend external needs --rollout-urls URL [URL ...]")
    if args.rollout_urls and args.rollout_backend != "external":
        errors.append(f"--rollout-urls is given but --rollout-backend is {args.rollout_backend}: "
                      "use --rollout-backend external")
    if args.sglang_args and args.rollout_backend != "sglang":
        errors.append(f"--sglang-* flags ({args.sglang_args[0]}) need --rollout-backend sglang")
    if args.rollout_backend == "sglang" and not (args.hf_checkpoint or args.load):
        errors.append("--rollout-backend sglang needs --hf-checkpoint (the model SGLang starts from)")
    if args.algorithm != "dppo":
        touched = [flag for flag, value, default in (
            ("--dppo-prompt-prune-rate", args.dppo_prompt_prune_rate, 0.5),
            ("--dppo-completion-prune-rate", args.dppo_completion_prune_rate, 0.5),
            ("--dppo-mode", args.dppo_mode, "stochastic"),
            ("--dppo-prompt-score", args.dppo_prompt_score, "mean_abs_advantage")) if value != default]
        if touched:
            errors.append(f"{touched[0]} only applies to --algorithm dppo, but --algorithm is {args.algorithm}: "
                          f"drop {touched[0]} or use --algorithm dppo")
    if args.dapo_oversample != 1.0 and not args.dapo_filter:
        errors.append("--dapo-oversample refills groups removed by the DAPO filter: add --dapo-filter")
    if args.ppo_epochs < 1:
        errors.append(f"--ppo-epochs {args.ppo_epochs} must be >= 1")
    if args.n_samples_per_prompt < 2 and args.advantage_estimator != "dr_grpo":
        errors.append(f"--n-samples-per-prompt {args.n_samples_per_prompt} gives every sample a zero "
                      f"--advantage-estimator {args.advantage_estimator} advantage: use G >= 2")
    if args.data_prompts not in PROMPT_DATA and not os.path.isfile(args.data_prompts):
        errors.append(f"--data-prompts {args.data_prompts!r} is neither one of {PROMPT_DATA} nor a JSONL file")
    if (args.reward_fn == "synthetic") != (args.data_prompts == "synthetic") and args.reward_fn is not None:
        errors.append(f"--reward-fn {args.reward_fn} does not score --data-prompts {args.data_prompts}: the synthetic "
                      "reward goes with the synthetic prompts, math/gsm8k with MATH/GSM8K-style prompts")
    errors += embedded_errors(args)
    if errors:
        parser.error("\n  ".join(["invalid arguments:", *errors]))
    if args.rl_seed is None:
        args.rl_seed = args.seed
    if args.reward_fn is None:
        args.reward_fn = args.data_prompts if args.data_prompts in ("math", "gsm8k") else (
            "synthetic" if args.data_prompts == "synthetic" else "math")

"""Command-line arguments of examples/pretrain_dppo.py, grouped by subsystem and validated once at start-up.

Megatron's own flags keep Megatron-LM's names (--tensor-model-parallel-size, --lr, --save, ...); ours come in
prefixed groups: --rollout-*, --dppo-* (and the other algorithms' options), --reward-*, --data-*, --warm-start-*.
Every --sglang-* flag is forwarded verbatim to `python -m sglang.launch_server` (without the prefix).

    argv ─► argparse, each numeric flag through its Domain (its range, declared where the flag is added)
         ─► validate: one check per group of flags (megatron_errors, rollout_errors, ...), each returning its
            problems; the model folder and the prompt sources in data/checks.py ─► fill_dependent_defaults

Invariants:
- every numeric flag has a Domain (build_parser refuses one without), so no out-of-range value reaches the run;
- every problem is one line naming the flag, the value and the fix, exit status 2, said once under torchrun (rank 0);
- parsing imports no torch: --dry-run runs before every Slurm launch.
"""

import argparse
import os

from megatron_dppo.data.checks import (
    HF_MODEL_FILES,
    PROMPT_FLAGS,
    default_eval_prompt_data,
    default_reward_type,
    eval_sets,
    hf_model_folder,
    prompt_data_errors,
)
from megatron_dppo.data.synthetic import TASKS as SYNTHETIC_TASKS
from megatron_dppo.data.templates import chat_template_kwargs_flag
from megatron_dppo.flags import (
    COUNT,
    COUNT_OR_NONE,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    RATE,
    SEED,
    TOP_K,
    FlagParser,
    changed_flags,
    require_domains,
)
from megatron_dppo.launch import algorithm_flags as algorithm
from megatron_dppo.launch import cluster_flags, logging_flags
from megatron_dppo.launch import rollout_correction_flags as correction
from megatron_dppo.launch.algorithm_flags import SEQUENCE_CLIP, TOKEN_CLIP
from megatron_dppo.launch.memory_plan import memory_flags, recompute_errors
from megatron_dppo.launch.resume import resume_errors, resume_flags
from megatron_dppo.launch.rollout_servers import SGLANG_TP_FLAGS, rollout_server_gpus
from megatron_dppo.platform import TRANSFORMER_IMPLS, transformer_impl_error
from megatron_dppo.rewards.custom import reward_function_flag
from megatron_dppo.rollout.launcher import (
    SGLANG_PASSTHROUGH_HELP,
    VLLM_PYTHON_VARIABLE,
    forward_sglang_args,
    sglang_flag_value,
)

REWARD_TYPES = ("math", "gsm8k", "synthetic")  # megatron_dppo.rewards.REWARD_FUNCTIONS, named without importing it
RENAMED_FLAGS = {"--data-prompts": "--prompt-data", "--reward-fn": "--reward-type",
                 "--data-skip-bad-rows": "--skip-bad-rows"}

# The embedded default (no --hf-checkpoint, embedded engine, synthetic prompts) starts from these unless a flag
# says otherwise: a tiny model, a supervised warm start cached under --cache-dir, a wall-time budget for RL.
# Its pool of 2048 problems comes back many times in the budget, so DPPO's prompt level has a history to act on, and
# is large enough that RL generalises rather than learning the pool (docs/trainer.md, calibration: 512, 1024, 2048,
# 4096 measured).
EMBEDDED_DEFAULTS = dict(
    lr=1e-4, rollout_batch_size=16, n_samples_per_prompt=8, dapo_filter=True, time_budget_s=240.0,
    max_tokens_per_gpu=4096, log_dir="runs/embedded", data_train_size=2048,
)
# ... and these, by --synthetic-task: how long a response may get, and what the warm start sees. The worked task's
# warm start sees worked solutions for a limited set only (--warm-start-problems of them, from --warm-start-cells),
# while RL draws answer-only prompts from every cell, so RL has something to earn (docs/trainer.md, calibration).
EMBEDDED_TASK_DEFAULTS = {
    "worked": dict(rollout_max_response_len=176, warm_start_steps=450, warm_start_lr=3e-3, warm_start_batch_size=64,
                   warm_start_problems=500, warm_start_cells=None),
    "answer": dict(rollout_max_response_len=8, warm_start_steps=900, warm_start_lr=3e-3, warm_start_batch_size=128,
                   warm_start_problems=0, warm_start_cells=None),
}
EMBEDDED_HEAD_DIM = 32  # the tiny model's attention heads: --embedded-hidden-size / 32 of them


def is_embedded_default(args) -> bool:
    """The tiny model and synthetic task of the no-argument run, served by the embedded engine or by vLLM."""
    return args.rollout_backend in ("embedded", "vllm") and not args.hf_checkpoint and args.prompt_data == "synthetic"


def build_parser() -> FlagParser:
    parser = FlagParser(
        prog="pretrain_dppo.py",
        description="GRPO-family RL with DPPO on Megatron-Core. With no arguments on a CPU machine: the embedded "
        "default (tiny model, synthetic arithmetic, embedded rollout engine).",
    )
    for add_flags in (megatron_flags, resume_flags, memory_flags, rollout_flags, algorithm.add_flags,
                      correction.add_flags, reward_flags, data_flags, embedded_flags, logging_flags.add_flags,
                      operation_flags, cluster_flags.add_flags):
        add_flags(parser)
    require_domains(parser)
    parser.note_replaced_defaults("the embedded default", EMBEDDED_DEFAULTS, EMBEDDED_TASK_DEFAULTS,
                                  "--synthetic-task")
    return parser


def megatron_flags(parser: argparse.ArgumentParser) -> None:
    megatron = parser.add_argument_group("megatron (Megatron-LM flag names)")
    megatron.add_argument("--tensor-model-parallel-size", type=COUNT, default=1)
    megatron.add_argument("--pipeline-model-parallel-size", type=COUNT, default=1)
    megatron.add_argument("--sequence-parallel", action="store_true")
    megatron.add_argument("--use-distributed-optimizer", action="store_true")
    megatron.add_argument("--bf16", action="store_true")
    megatron.add_argument("--fp16", action="store_true")
    megatron.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default=None,
                          help="the layer implementation: transformer_engine (Transformer Engine's layers; a GPU "
                               "without TE installed stops at start-up saying so: pass local there) or local "
                               "(megatron-core's own layers with SDPA attention over packed sequences; the only "
                               "choice on the CPU); default: transformer_engine on every GPU, local on the CPU")
    megatron.add_argument("--initial-loss-scale", type=POSITIVE, default=2.0**16,
                          help="--fp16: the dynamic loss scale at the start (Megatron-LM starts at 2^32 and halves "
                               "it after overflowing steps, which are skipped: here each skipped step throws a "
                               "rollout away)")
    megatron.add_argument("--hf-checkpoint", metavar="DIR_OR_ORG/NAME", help="the HF model to start from: a folder, "
                          "or a Hub name (Qwen/Qwen3-4B) downloaded to the HF cache (HF_HUB_OFFLINE=1: read from it)")
    megatron.add_argument("--load", help="the Megatron checkpoint the run starts from (a save dir or an iter_* dir: "
                          "a converter's, or one to resume); where --save holds this run's own checkpoints, the run "
                          "resumes from their latest instead, unless --load names one of them (--fresh-start)")
    megatron.add_argument("--no-load-optim", action="store_true",
                          help="--load the model (and the run's step, data position and history) without the "
                               "optimizer and its LR schedule, which start afresh (Megatron-LM's flag): e.g. for a "
                               "checkpoint whose distributed-optimizer state was saved under another TP/PP")
    megatron.add_argument("--save", help="directory for Megatron distributed checkpoints; a run resumes from its own "
                          "latest checkpoint there, and refuses one holding another run's")
    megatron.add_argument("--save-interval", type=COUNT_OR_NONE, default=0,
                          help="save every N steps (0: only at the end)")
    megatron.add_argument("--keep-last-checkpoints", type=COUNT_OR_NONE, default=2, help="0: keep every checkpoint")
    megatron.add_argument("--train-iters", type=COUNT_OR_NONE, default=None,
                          help="RL steps (default: until the time budget; 0: none, the start is evaluated only, as "
                               "the benchmarks' warm-start and supervised-control runs do)")
    megatron.add_argument("--lr", type=POSITIVE, default=1e-6)
    megatron.add_argument("--min-lr", type=NON_NEGATIVE, default=0.0)
    megatron.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant")
    megatron.add_argument("--lr-warmup-iters", type=COUNT_OR_NONE, default=0)
    megatron.add_argument("--clip-grad", type=NON_NEGATIVE, default=1.0, help="gradient norm clip (0: off)")
    megatron.add_argument("--weight-decay", type=NON_NEGATIVE, default=0.0)
    megatron.add_argument("--adam-beta1", type=RATE, default=0.9)
    megatron.add_argument("--adam-beta2", type=RATE, default=0.999)
    megatron.add_argument("--adam-eps", type=POSITIVE, default=1e-8)
    megatron.add_argument("--distributed-timeout-minutes", type=POSITIVE, default=120.0,
                          help="how long a collective waits for the other ranks before failing; the ranks wait in "
                               "one while rank 0 generates a step's rollouts or starts the servers, so it must "
                               "outlast both (Megatron-LM's default, 10, does not)")
    megatron.add_argument("--seed", type=SEED, default=1234)
    megatron.add_argument("--rl-seed", type=SEED, default=None,
                          help="seed of the RL phase (prompt order, sampling, pruning draws); default: --seed. Vary "
                               "it to repeat RL from one warm start (the warm start is keyed by --seed)")
    megatron.add_argument("--max-tokens-per-gpu", type=COUNT, default=8192, help="token budget of one micro-batch")
    megatron.add_argument("--packing-window", type=COUNT, default=256, help="Dense Prompt Packing window W")
    megatron.add_argument("--log-dir", default="runs/dppo", help="metrics.jsonl and TensorBoard events")
    megatron.add_argument("--time-budget-s", type=POSITIVE, default=None,
                          help="stop RL once this many seconds of it have passed (after the current step); held-out "
                               "evaluations (--eval-interval) are not counted")
    megatron.add_argument("--time-budget-prices", type=NON_NEGATIVE, nargs=4, default=None,
                          metavar=("STEP", "ITERATION", "GENERATED", "TRAINED"),
                          help="count --time-budget-s in the seconds the steps' logged work would take at these "
                               "prices (per step, per decode iteration, per generated token, per trained token) "
                               "instead of wall time: a run then does the same work whatever else the machine runs "
                               "(benchmarks on shared machines); default: wall time")


def rollout_flags(parser: argparse.ArgumentParser) -> None:
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument("--rollout-backend", choices=("embedded", "sglang", "vllm", "external"), default="embedded",
                         help="embedded: our CPU engine; sglang: start SGLang servers; vllm: start vLLM servers from "
                              "--rollout-python's environment; external: SGLang servers at --rollout-urls")
    rollout.add_argument("--rollout-python", default=None,
                         help=f"--rollout-backend vllm: the interpreter of the environment vLLM is installed in "
                              f"(default: ${VLLM_PYTHON_VARIABLE}; tools/install_vllm_cpu.sh builds one on CPU)")
    rollout.add_argument("--rollout-urls", nargs="*", default=[], help="servers started elsewhere (Slurm)")
    rollout.add_argument("--rollout-num-servers", type=COUNT, default=1)
    rollout.add_argument("--rollout-batch-size", type=COUNT, default=16, help="prompts per RL step")
    rollout.add_argument("--n-samples-per-prompt", type=COUNT, default=8, help="group size G")
    rollout.add_argument("--rollout-temperature", type=NON_NEGATIVE, default=1.0, help="0: greedy")
    rollout.add_argument("--rollout-top-p", type=FRACTION, default=1.0)
    rollout.add_argument("--rollout-top-k", type=TOP_K, default=-1)
    rollout.add_argument("--rollout-max-response-len", type=COUNT, default=1024)
    rollout.add_argument("--rollout-max-concurrency", type=COUNT, default=64)
    rollout.add_argument("--rollout-timeout-s", type=POSITIVE, default=600.0)
    rollout.add_argument("--rollout-weight-bucket-mb", type=COUNT, default=512, help="weight-sync bucket size")
    rollout.add_argument("--rollout-server-gpus", type=COUNT, default=None,
                         help="GPUs of one rollout server, its tensor-parallel size (SGLang refuses weight updates "
                              "with more than one data-parallel replica): its ranks in the weight-sync group "
                              "(default 1). --rollout-backend sglang: forwarded as SGLang's --tp-size, which "
                              "--sglang-tp-size also sets")
    rollout.add_argument("--weight-sync-master-address", default=None,
                         help="address of trainer rank 0 that rollout servers reach for the weight-sync group "
                              "(default: 127.0.0.1 for local servers, this host's address for external ones)")
    rollout.add_argument("--rollout-engine-threads", type=COUNT, default=None,
                         help="torch threads of each decode worker of the embedded engine (default: the trainer's "
                              "processes on this node, whose cores are free while the engine generates; 1 with "
                              "--async, where they train meanwhile)")
    rollout.add_argument("--rollout-engine-workers", type=COUNT, default=None,
                         help="decode workers (threads) of the embedded engine; a step's batch is split among them "
                              "(default: 1; with --async, the trainer's processes on this node, each worker one "
                              "thread, which degrades more gracefully when the cores are shared)")
    rollout.add_argument("--rollout-engine-disable-radix-cache", action="store_true",
                         help="the embedded engine keeps no prefix K/V between requests (SGLang's "
                              "--disable-radix-cache): each partial-rollout chunk prefills its prompt and tokens again")
    rollout.add_argument("--rollout-engine-device", choices=("cpu", "cuda"), default="cpu",
                         help="where the embedded engine decodes: the host, or the GPU of trainer rank 0 (beside the "
                              "trainer; for tiny models, as bench/step_cost.py measures a GPU's decode cost)")
    rollout.add_argument("--rollout-colocate", action="store_true",
                         help="--rollout-backend sglang: the servers share the trainer's GPUs and weights sync over "
                              "gloo, as NCCL refuses two ranks on one GPU; the memory plan gives each server its "
                              "share and passes it the --mem-fraction-static that fits (or checks "
                              "--sglang-mem-fraction-static)")
    rollout.add_argument("--async", dest="async_rollout", action="store_true",
                         help="generate step t+1 while step t trains (one step off-policy, corrected by TIS)")
    rollout.add_argument("--partial-rollout", action="store_true",
                         help="a step's rollout does not wait for its longest response: each step's draw is a "
                              "cohort continued chunk by chunk over up to --partial-rollout-max-staleness + 1 steps, "
                              "and each step trains the oldest once all its samples are done (docs/rollout.md)")
    rollout.add_argument("--partial-rollout-chunk-tokens", type=COUNT, default=64,
                         help="--partial-rollout: tokens a sample may add per request; the step checks between "
                              "chunks whether its oldest cohort is whole")
    rollout.add_argument("--partial-rollout-max-staleness", type=COUNT_OR_NONE, default=1,
                         help="--partial-rollout: how many weight versions a carried token may be older than the "
                              "weights that train on it (cohorts open at once: this + 1; 0: synchronous)")
    parser.add_argument_group("sglang (forwarded)", SGLANG_PASSTHROUGH_HELP)


def reward_flags(parser: argparse.ArgumentParser) -> None:
    reward = parser.add_argument_group("reward")
    reward.add_argument("--reward-type", choices=REWARD_TYPES, default=None,
                        help="how a response is scored against its label: math (math-verify), gsm8k (final number), "
                             "synthetic (exact '<integer>$'); default: the one of the built-in --prompt-data set, "
                             "math for your own prompts")
    reward.add_argument("--reward-timeout-s", type=POSITIVE, default=5.0,
                        help="deadline of one reward check (math-verify, or one --custom-reward-function call); past "
                             "it the response scores 0")
    reward.add_argument("--custom-reward-function", type=reward_function_flag, default=None, metavar="PATH.py:NAME",
                        help="your reward in place of --reward-type's: NAME(response, label, **fields) -> float, "
                             "fields the prompt's row, or verl's compute_score(data_source, solution_str, "
                             "ground_truth, extra_info); plain or async; a dict with 'score' also (its other keys "
                             "logged); a call that overruns --reward-timeout-s scores 0, with a warning line")
    reward.add_argument("--custom-reward-max-failures", type=COUNT_OR_NONE, default=0,
                        help="--custom-reward-function calls that may raise or return no finite score over the run, "
                             "each scoring 0 with a warning line; the next one stops the run naming the row")


def data_flags(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data (prompts: the synthetic task, a built-in set, your files, a hub data set)")
    data.add_argument("--prompt-data", default="synthetic", metavar="SOURCE",
                      help="synthetic (the embedded default's task); math or gsm8k (built-in training sets, read from "
                           "DPPO_DATA_DIR or ../shared/data); a .jsonl/.json/.parquet file or a directory of them; or "
                           "a Hugging Face data set name (needs network access)")
    data.add_argument("--prompt-data-split", default="train", help="split of a Hugging Face data set")
    data.add_argument("--prompt-data-config", default=None, help="configuration of a Hugging Face data set with "
                      "several (openai/gsm8k: main), or of a folder holding one (hf download --local-dir)")
    data.add_argument("--eval-prompt-data", nargs="+", default=None, metavar="NAME SOURCE",
                      help="held-out prompts: one SOURCE in the same forms (a built-in name: math500, gsm8k_test, "
                           "aime24, ...), or NAME SOURCE pairs (slime's form), each evaluated and logged as "
                           "heldout_accuracy/NAME (the first also as heldout_accuracy); default: math500 for "
                           "--reward-type math, gsm8k_test for gsm8k")
    data.add_argument("--eval-prompt-data-split", default="test", help="split of a Hugging Face data set")
    data.add_argument("--eval-prompt-data-config", default=None, help="--prompt-data-config of the held-out sets")
    data.add_argument("--input-key", default="prompt",
                      help="field of your rows holding the prompt: text, or chat messages [{role, content}]")
    data.add_argument("--label-key", default="label", help="field of your rows holding the reference answer")
    data.add_argument("--difficulty-key", default=None,
                      help="field of your rows holding a difficulty or category (any value): DPPO's prompt level "
                           "pools the history of each value as the prior of prompts not yet seen (MATH's built-in set "
                           "uses its level and type)")
    data.add_argument("--apply-chat-template", action="store_true",
                      help="render prompts with the tokenizer's chat template (a text prompt becomes one user turn); "
                           "without it a prompt is used as written")
    data.add_argument("--apply-chat-template-kwargs", type=chat_template_kwargs_flag, default=None, metavar="JSON",
                      help="--apply-chat-template: a JSON object of the template's own arguments, e.g. "
                           "'{\"enable_thinking\": false}' for Qwen3 without thinking (slime's flag)")
    data.add_argument("--skip-bad-rows", action="store_true",
                      help="leave out rows without a usable prompt or label (counted and reported) instead of stopping")
    data.add_argument("--data-train-size", type=COUNT, default=4000,
                      help="synthetic: size of the recurring training pool (prompts recur, so history can prune)")
    data.add_argument("--data-synthetic-cells", nargs="+", default=None, metavar="OxD",
                      help="synthetic difficulty cells: O operators x D max digits (default: --synthetic-task's)")
    data.add_argument("--eval-size", type=COUNT, default=500, help="held-out problems evaluated before and after")
    data.add_argument("--eval-interval", type=COUNT_OR_NONE, default=0, help="also evaluate every N steps (0: never)")


def embedded_flags(parser: argparse.ArgumentParser) -> None:
    synthetic = parser.add_argument_group("synthetic task")
    synthetic.add_argument("--synthetic-task", choices=SYNTHETIC_TASKS, default="worked",
                           help="worked: the response writes each intermediate result, then '#', the final answer and "
                                "'$' (the reward reads the final answer only); answer: the answer and '$' alone")
    warm = parser.add_argument_group("embedded default (tiny model, supervised warm start; defaults by task)")
    warm.add_argument("--warm-start-steps", type=COUNT_OR_NONE, default=None, help="supervised steps")
    warm.add_argument("--warm-start-lr", type=POSITIVE, default=None, help="peak lr")
    warm.add_argument("--warm-start-batch-size", type=COUNT, default=None, help="problems per supervised step")
    warm.add_argument("--warm-start-problems", type=COUNT_OR_NONE, default=None,
                      help="the warm start's worked solutions come from a fixed pool of this many problems, revisited "
                           "in epochs; 0: a fresh problem every step")
    warm.add_argument("--warm-start-cells", nargs="+", default=None, metavar="OxD",
                      help="cells of the warm start's problems (default: the RL cells, --data-synthetic-cells)")
    warm.add_argument("--embedded-hidden-size", type=COUNT, default=128,
                      help=f"tiny model width, a multiple of {EMBEDDED_HEAD_DIM} (one head per {EMBEDDED_HEAD_DIM})")
    warm.add_argument("--embedded-num-layers", type=COUNT, default=3, help="tiny model depth")
    warm.add_argument("--cache-dir", default="cache", help="where the warm start is cached and reused")


def operation_flags(parser: argparse.ArgumentParser) -> None:
    ops = parser.add_argument_group("operations")
    ops.add_argument("--dry-run", action="store_true", help="print the launch plan and parallel layout, start nothing")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; `args.sglang_args` holds the --sglang-* flags as SGLang takes them (without the prefix)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if is_embedded_default(args):
        parser.set_defaults(**EMBEDDED_DEFAULTS, **EMBEDDED_TASK_DEFAULTS[args.synthetic_task])
        args, unknown = parser.parse_known_args(argv)
    sglang_tokens, rest = [], []
    for index, token in enumerate(unknown):
        takes_value = index > 0 and unknown[index - 1].startswith("--sglang-") and "=" not in unknown[index - 1]
        if token.startswith("--sglang-") or (takes_value and not token.startswith("--")):
            sglang_tokens.append(token)
        else:
            rest.append(token)
    if rest:
        renamed = [f"{flag} is now {RENAMED_FLAGS[flag]}" for flag in rest if flag in RENAMED_FLAGS]
        parser.error(f"unrecognized arguments: {' '.join(rest)}" + (f" ({'; '.join(renamed)})" if renamed else ""))
    args.sglang_args = forward_sglang_args(sglang_tokens)
    validate(args, parser)
    return args


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Reject bad combinations, a missing model folder and unreadable prompt sources, each with one line naming the
    flag and the fix; then fill in the defaults that depend on other flags. One check per group of flags, in the
    order of --help; where a check asks whether a flag was given, the parser's default answers it."""
    server_gpus, server_errors = rollout_server_gpus(args)
    errors = [*megatron_errors(args), *resume_errors(args), *recompute_errors(args), *rollout_errors(args),
              *server_errors, *vllm_errors(args), *algorithm.errors(args, parser), *correction.errors(args, parser),
              *batch_filling_errors(args, parser), *cluster_flags.errors(args),
              *range_combination_errors(args), *model_and_data_errors(args, parser), *embedded_errors(args),
              *logging_flags.errors(args, changed_flags(args, parser, *logging_flags.WANDB_ONLY))]
    if errors:
        parser.error(errors[0] if len(errors) == 1 else "\n  ".join(["invalid arguments:", *errors]))
    fill_dependent_defaults(args, server_gpus)


def megatron_errors(args: argparse.Namespace) -> list[str]:
    """Megatron's flags: the parallel layout against the launched processes, the precision, the layers."""
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
    # without --transformer-impl the model resolves the layers where torch is imported; parsing does not import it
    if args.transformer_impl is not None and (error := transformer_impl_error(args.transformer_impl)):
        errors.append(error)
    return errors


def rollout_errors(args: argparse.Namespace) -> list[str]:
    """The rollout flags that belong to one --rollout-backend, and the servers --rollout-backend external needs."""
    backend = args.rollout_backend
    errors = []
    if backend == "external" and not args.rollout_urls:
        errors.append("--rollout-backend external needs --rollout-urls URL [URL ...]")
    if args.rollout_urls and backend != "external":
        errors.append(f"--rollout-urls is given but --rollout-backend is {backend}: use --rollout-backend external")
    if args.rollout_engine_device != "cpu" and backend != "embedded":
        errors.append(f"--rollout-engine-device {args.rollout_engine_device} places the embedded engine, but "
                      f"--rollout-backend is {backend}: drop it or use --rollout-backend embedded")
    if args.rollout_colocate and backend != "sglang":
        errors.append("--rollout-colocate places SGLang servers on the trainer's GPUs: use --rollout-backend sglang")
    if args.sglang_args and backend != "sglang":
        errors.append(f"--sglang-* flags (--sglang-{args.sglang_args[0].removeprefix('--')}) need --rollout-backend "
                      "sglang")
    return errors


def vllm_errors(args: argparse.Namespace) -> list[str]:
    """--rollout-backend vllm and --rollout-python, the interpreter of vLLM's environment, need each other."""
    if args.rollout_backend == "vllm" and not (args.rollout_python or os.environ.get(VLLM_PYTHON_VARIABLE)):
        return [f"--rollout-backend vllm needs --rollout-python PATH (or {VLLM_PYTHON_VARIABLE}=PATH): the "
                "interpreter of vLLM's environment; tools/install_vllm_cpu.sh builds one on CPU"]
    if args.rollout_python and args.rollout_backend != "vllm":
        return [f"--rollout-python is for --rollout-backend vllm, but --rollout-backend is {args.rollout_backend}: "
                "drop it or use --rollout-backend vllm"]
    return []


def batch_filling_errors(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The ways a step fills its batch, each with the flags it needs: the DAPO filter's over-sampling, partial
    rollouts (draws carried across steps) and DAPO's dynamic sampling (rounds until the batch is full, for GRPO)."""
    errors = []
    if changed_flags(args, parser, "--dapo-oversample") and not (args.dapo_filter or args.dapo_dynamic_sampling):
        errors.append("--dapo-oversample refills groups removed by the DAPO filter: add --dapo-filter")
    partial_flags = changed_flags(args, parser, "--partial-rollout-chunk-tokens", "--partial-rollout-max-staleness")
    if partial_flags and not args.partial_rollout:
        errors.append(f"{partial_flags[0]} applies to partial rollouts: add --partial-rollout or drop it")
    if args.partial_rollout and args.dapo_dynamic_sampling:
        errors.append("--partial-rollout carries whole draws across steps, while --dapo-dynamic-sampling rolls out "
                      "rounds until the batch is full: use one of them")
    if args.dapo_dynamic_sampling and args.algorithm != "grpo":
        errors.append(f"--dapo-dynamic-sampling is DAPO's (biased) way to fill the batch, for --algorithm grpo; "
                      f"--algorithm {args.algorithm} has its own: drop it or use --algorithm grpo")
    return errors


def range_combination_errors(args: argparse.Namespace) -> list[str]:
    """Values each inside its own domain that cannot run together."""
    errors = []
    if args.min_lr > args.lr:
        errors.append(f"--min-lr {args.min_lr} exceeds --lr {args.lr}: the schedule decays from --lr down to "
                      "--min-lr; lower --min-lr")
    if args.rollout_max_response_len >= args.max_tokens_per_gpu:
        errors.append(f"--max-tokens-per-gpu {args.max_tokens_per_gpu} cannot hold one response of "
                      f"--rollout-max-response-len {args.rollout_max_response_len} and its prompt in a micro-batch: "
                      "raise --max-tokens-per-gpu or lower --rollout-max-response-len")
    if args.time_budget_prices is not None and args.time_budget_s is None:
        errors.append("--time-budget-prices prices the steps for --time-budget-s, which is not given: add "
                      "--time-budget-s or drop --time-budget-prices")
    if args.save_interval and not args.save:
        errors.append(f"--save-interval {args.save_interval} saves to --save DIR, which is not given: add --save")
    if args.n_samples_per_prompt < 2 and args.advantage_estimator != "dr_grpo":
        errors.append(f"--n-samples-per-prompt {args.n_samples_per_prompt} gives every sample a zero "
                      f"--advantage-estimator {args.advantage_estimator} advantage: use G >= 2")
    return errors


def model_and_data_errors(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The model and prompt flags, checked before any process starts: the model folder, and the prompt flags and
    sources (data/checks.py). With --dry-run the files are not checked, nor is --hf-checkpoint required: the plan may
    be printed where they are not."""
    errors = []
    if not is_embedded_default(args) and not args.hf_checkpoint and not args.dry_run:
        reason = (f"--prompt-data {args.prompt_data}" if args.prompt_data != "synthetic"
                  else f"--rollout-backend {args.rollout_backend}")
        errors.append(f"{reason} needs --hf-checkpoint DIR or ORG/NAME, the Hugging Face model to train and serve "
                      f"({HF_MODEL_FILES}); only the embedded default (--prompt-data synthetic with the embedded "
                      "engine) runs without one, on its own tiny model")
    if args.apply_chat_template_kwargs is not None and not args.apply_chat_template:
        errors.append("--apply-chat-template-kwargs are arguments of the chat template: add --apply-chat-template")
    if args.hf_checkpoint and not args.dry_run:  # the trainer and the servers it starts read the model's folder
        args.hf_checkpoint, model_errors = hf_model_folder(args.hf_checkpoint)
        errors.extend(model_errors)
    return [*errors, *prompt_data_errors(args, changed_flags(args, parser, *PROMPT_FLAGS))]


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
    if args.embedded_hidden_size % EMBEDDED_HEAD_DIM:
        errors.append(f"--embedded-hidden-size {args.embedded_hidden_size} must be a multiple of {EMBEDDED_HEAD_DIM} "
                      "(one attention head per 32)")
    return errors


def fill_dependent_defaults(args: argparse.Namespace, server_gpus: int) -> None:
    """The defaults that follow from other flags, filled in once every flag is known to be valid."""
    args.rollout_server_gpus = server_gpus
    correction.resolve(args)
    if args.rollout_backend == "sglang" and sglang_flag_value(args.sglang_args, SGLANG_TP_FLAGS) is None:
        args.sglang_args += ["--tp-size", str(server_gpus)]
    if args.rl_seed is None:
        args.rl_seed = args.seed
    clip = SEQUENCE_CLIP if args.importance_level == "sequence" else TOKEN_CLIP
    args.eps_clip = clip[0] if args.eps_clip is None else args.eps_clip
    args.eps_clip_high = clip[1] if args.eps_clip_high is None else args.eps_clip_high
    args.reward_type = args.reward_type or default_reward_type(args.prompt_data)
    args.eval_sets = eval_sets(args.eval_prompt_data, default_eval_prompt_data(args.prompt_data, args.reward_type))

"""The rollout servers' layout from the trainer's flags: how many GPUs one server takes, and the SGLang layouts that
cannot take the trainer's weights (checked at parse time by launch/arguments.py, one line each).

    --rollout-backend, --rollout-server-gpus, the forwarded --sglang-* flags ─► rollout_server_gpus ─► (GPUs of one
    server, errors) ─► arguments.fill_dependent_defaults sets --rollout-server-gpus from it
"""

import argparse

from megatron_dppo.rollout.launcher import sglang_flag_value

# SGLang's names for its tensor- and data-parallel sizes (srt/arg_groups/fields/parallel.py in sglang 0.5.23)
SGLANG_TP_FLAGS = ("--tp-size", "--tensor-parallel-size")
SGLANG_DP_FLAGS = ("--dp-size", "--data-parallel-size")
SGLANG_PP_FLAGS = ("--pp-size", "--pipeline-parallel-size")


def rollout_server_gpus(args: argparse.Namespace) -> tuple[int, list[str]]:
    """(GPUs of one rollout server, errors). One number: an SGLang server's GPUs are its tensor-parallel size, given
    by --sglang-tp-size or --rollout-server-gpus (both only if they agree), as SGLang refuses weight updates with more
    than one data-parallel replica (its tokenizer manager asserts dp_size == 1)."""
    given = args.rollout_server_gpus
    if args.rollout_backend in ("vllm", "embedded") and (given or 1) > 1:
        return 1, [f"--rollout-server-gpus {given}: a --rollout-backend {args.rollout_backend} server joins the "
                   "weight-sync group as one rank (the group would wait for ranks that never join): drop it, and "
                   "start more servers with --rollout-num-servers instead"]
    if args.rollout_backend != "sglang":
        return given or 1, []
    errors = []
    dp = sglang_flag_value(args.sglang_args, SGLANG_DP_FLAGS)
    if dp is not None and dp.strip() != "1":
        errors.append(f"--sglang-dp-size {dp}: SGLang refuses weight updates from the trainer with more than one "
                      "data-parallel replica; start more servers instead (--rollout-num-servers)")
    pp = sglang_flag_value(args.sglang_args, SGLANG_PP_FLAGS)
    if pp is not None and pp.strip() != "1":
        errors.append(f"--sglang-pp-size {pp}: an SGLang server split into pipeline stages cannot take the trainer's "
                      "weights (each stage joins the weight-sync group at rank_offset + tp_rank, so stages collide "
                      "on one rank): use --sglang-tp-size for a server's GPUs, or more servers")
    tp = sglang_flag_value(args.sglang_args, SGLANG_TP_FLAGS)
    if tp is None:
        return given or 1, errors
    if not tp.isdigit() or int(tp) < 1:
        return given or 1, [*errors, f"--sglang-tp-size {tp} must be a positive integer"]
    if given is not None and given != int(tp):
        errors.append(f"--rollout-server-gpus {given} and --sglang-tp-size {tp} disagree on an SGLang server's GPUs: "
                      "give one of them")
    return int(tp), errors

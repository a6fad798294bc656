"""What every torchrun check worker shares: rank-tagged logging and the run-these-checks main."""

import argparse

import torch
import torch.distributed as dist


def log(message: str) -> None:
    print(f"[rank {dist.get_rank()}] {message}", flush=True)


def run_checks(checks: dict, extra_options: tuple[str, ...] = ()) -> None:
    """Parse `--models --tp --pp --checks a,b [extra options]`, start the parallel state, run the named checks."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--checks", required=True)
    for option in extra_options:
        parser.add_argument(option)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from megatron_dppo.actor.parallel import destroy_parallel, init_parallel

    init_parallel(args.tp, args.pp)
    for name in args.checks.split(","):
        if name not in checks:
            raise SystemExit(f"unknown check {name!r}: choose from {sorted(checks)}")
        checks[name](args)
    destroy_parallel()

"""Which process of a torchrun launch this is, and how every rank stops on an error they all found alike.

Imports nothing of torch (nor does platform/watchdog.py, which it stops): argument parsing, which runs before every
Slurm launch (--dry-run), uses it.
"""

import os
import sys
import time

RANK0_ERROR_WAIT_S = 60  # how long ranks other than 0 wait for rank 0 to report an error and exit


def is_rank0() -> bool:
    """Whether this process is rank 0 of its torchrun launch (a process started without torchrun is)."""
    return int(os.environ.get("RANK", "0")) == 0


def exit_saying_once(status: int, message: str) -> None:
    """Exit with an error every rank found alike, said once, by rank 0. torchrun stops every rank as soon as one
    exits, so a rank that exited first could take rank 0 down before it speaks: the others wait for rank 0's exit to
    stop them (a bounded wait, in case it cannot). This process's watchdog stops first: an error found alike is no lost
    peer (platform/watchdog.py)."""
    from megatron_dppo.platform.watchdog import stop_all

    stop_all()
    if is_rank0():
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(RANK0_ERROR_WAIT_S)
    sys.exit(status)

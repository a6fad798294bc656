"""The one exception type for input a user can fix (a flag, a file, how the run was launched), and the launch check
every torchrun entry point makes first.

Entry points catch UserInputError and say its message as one line, with no traceback: a traceback is for our own
bugs. Raise it (or a subclass, such as data.datasets.PromptDataError) with a message naming the input and the fix.
"""

import os
import sys


class UserInputError(ValueError):
    """Bad input the user fixes; the message names the input and the fix."""


def require_torchrun() -> None:
    """Refuse a process that torchrun did not start: its environment (RANK, WORLD_SIZE, MASTER_ADDR) is how the
    ranks find each other. Checked before anything heavy is imported, so the mistake costs no wait."""
    if "RANK" not in os.environ:
        script = sys.argv[0] or "SCRIPT"
        raise UserInputError(f"{script} runs under torchrun, which gives each process RANK, WORLD_SIZE and "
                             f"MASTER_ADDR, and this python was started without it: launch with torchrun "
                             f"--nproc-per-node N {script} [FLAGS]")

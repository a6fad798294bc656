"""Servers die with the process that started them: every server a trainer starts runs behind a tether.

    launcher (any thread) ─► spawn(command): `python -I tether.py TRAINER_PID -- command`, in a new session
    tether ─► TRAINER_PID is still its parent? no: the trainer died while the tether started; exit, start nothing
           ─► start the server as its child (armed to be SIGKILLed when the tether dies)
           ─► every POLL_S: trainer gone (reparented)? ─► SIGKILL the whole session's process group
                            server exited?             ─► exit with its status
    SIGTERM to the tether (ServerHandle.stop) ─► forwarded to the server, which shuts down in its own way

Why a separate process, and not a watchdog inside the server:
- a watchdog thread starts only once the server has imported torch (seconds); a trainer that dies before then leaves
  the server watching init's pid forever. The tether is a few standard-library lines and reads the trainer's pid
  from its command line, so there is nothing to miss;
- Linux's parent-death signal (PR_SET_PDEATHSIG) fires when the *thread* that forked the child exits: a server
  (re)started from one of the rollout client's worker threads would die with that thread. getppid() changes only
  when the whole trainer process is gone, so the tether polls it instead;
- servers have children of their own (vLLM's engine core, SGLang's scheduler and detokenizer processes) that would
  outlive a killed leader; the tether leads the process group they all belong to and kills all of it.
The tether itself has one thread, so the parent-death signal is exact for the server it forks: a server never
outlives its tether either, even one killed with SIGKILL.

Invariants:
- the server is never started once the trainer is gone, and is SIGKILLed (with its whole process group) within
  POLL_S of the trainer's death, at any stage: importing, loading, serving, or inside a collective;
- this file imports only the standard library and runs by path under `python -I`, so it starts in milliseconds in
  any environment (vLLM's own included) whatever PYTHONPATH holds;
- the tether's exit status is the server's (128 + signal for a server ended by a signal).
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.2
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHANED_AT_START = 3  # the tether's status when the trainer was gone before the server could start


def spawn(command: list[str], env: dict[str, str] | None, output) -> subprocess.Popen:
    """Start `command` behind a tether bound to this process, as the leader of a new session; `output` takes the
    tether's and the server's stdout and stderr. The returned process is the tether: signal it, not the server."""
    tethered = [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), "--", *command]
    return subprocess.Popen(tethered, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def die_with(parent: int):
    """A preexec function for a child of `parent`: SIGKILL it when `parent` dies (Linux), or exit at once if `parent`
    already died between the fork and this call. Safe here only because the tether has no other thread."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform == "linux" else None

    def arm():
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(ORPHANED_AT_START)

    return arm


def main(argv: list[str]) -> int:
    """`TRAINER_PID -- command...`: run command until it exits or the trainer dies; return the exit status."""
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: python -I tether.py TRAINER_PID -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    trainer = int(argv[0])
    if os.getpgrp() != os.getpid():  # started by hand: lead a group of its own, so the kill below spares the caller
        os.setsid()
    server = None

    def forward(signum, frame):
        if server is not None:
            server.send_signal(signum)
        else:  # the server is not started yet: nothing to shut down gracefully
            sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    if os.getppid() != trainer:
        print(f"tether: the process that started this server ({trainer}) is gone; not starting {argv[2]}",
              file=sys.stderr, flush=True)
        return ORPHANED_AT_START
    server = subprocess.Popen(argv[2:], preexec_fn=die_with(os.getpid()))
    while server.poll() is None:
        if os.getppid() != trainer:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the tether too: nothing is left to report to
        time.sleep(POLL_S)
    return server.returncode if server.returncode >= 0 else 128 - server.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

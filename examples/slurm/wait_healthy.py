"""Wait until every rollout server answers GET /health_generate, or fail naming the ones that do not.

    python examples/slurm/wait_healthy.py [--timeout-s 900] [--watch-pid PID] URL [URL ...]

--watch-pid: fail at once if that process (the srun step of the servers) exits while waiting.
"""

import argparse
import os
import sys
import time
import urllib.error
import urllib.request


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health_generate", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--watch-pid", type=int, default=None)
    args = parser.parse_args()
    waiting = list(args.urls)
    deadline = time.monotonic() + args.timeout_s
    while waiting:
        waiting = [url for url in waiting if not healthy(url)]
        if not waiting:
            break
        if args.watch_pid is not None and not process_alive(args.watch_pid):
            print(f"wait_healthy: the rollout servers' step exited; not up: {' '.join(waiting)}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"wait_healthy: not healthy after {args.timeout_s} s: {' '.join(waiting)} "
                  "(see the sglang-*.log files; raise SERVER_TIMEOUT_S for large models)", file=sys.stderr)
            return 1
        time.sleep(2)
    print(f"wait_healthy: {len(args.urls)} rollout servers healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a run, as the watchdog sees it, without torch: RANK from the environment, a plan of phases.

    python tests/workers/watchdog_rank.py PLAN_JSON
    plan: {"world": N, "port": P, "interval_s": s, "timeout_s": s, "deadlines": {phase: s},
           "phases": [[name, seconds], ...], "servers": [url, ...] (rank 0 probes them),
           "fail_in": name (raise a RuntimeError in that phase; a UserInputError with "user_error": true),
           "exit_without_bye": bool (exit inside the last phase),
           "say_once": text (after the phases, exit through exit_saying_once, as an error every rank found alike)}

Prints "ready" once its watchdog runs, then goes through its phases; exits 0 after stopping the watchdog (or 1
without it, in its last phase, with exit_without_bye, as a crashed process would).
"""

import json
import os
import sys
import time

from megatron_dppo.errors import UserInputError
from megatron_dppo.platform.process import exit_saying_once
from megatron_dppo.platform.watchdog import WatchdogConfig, phase, start


def main() -> int:
    plan = json.loads(sys.argv[1])
    config = WatchdogConfig(plan["interval_s"], plan["timeout_s"], plan["port"], plan["port"],
                            plan.get("deadlines", {}))
    watchdog = start(config, int(os.environ["RANK"]), plan["world"], "127.0.0.1", lambda port: plan["port"])
    watchdog.watch_servers(plan.get("servers", []))
    print("ready", flush=True)
    for position, (name, seconds) in enumerate(plan["phases"]):
        with phase(name):
            time.sleep(seconds)
            if plan.get("fail_in") == name:
                raise (UserInputError if plan.get("user_error") else RuntimeError)(f"planted failure in {name}")
            if plan.get("exit_without_bye") and position == len(plan["phases"]) - 1:
                os._exit(1)  # inside its last phase, as a crash would: the phase the watchdog names is not a race
    if plan.get("say_once"):
        exit_saying_once(2, plan["say_once"])
    watchdog.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

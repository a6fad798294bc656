"""One math-verify worker process of VerifierPool, started as a module of ours:

    python -P -m megatron_dppo.rewards.verifier_worker REQUEST_FD REPLY_FD TIMEOUT_SECONDS

    import math-verify ─► reply "ready" ─► loop: (answer, reference) ─► parse + verify ─► (equal, reason)
                                                   until the parent closes its end of the request pipe

Why a module and not multiprocessing: multiprocessing's spawn re-imports the caller's main module in every worker,
so a script read on standard input (`python - <<EOF`) fails and a script without an `if __name__ == "__main__":`
guard runs again in each worker. Here the main module is always this file. Messages travel on two inherited pipe
ends (multiprocessing Connection framing), not on stdin/stdout, so anything a library prints cannot corrupt them.
math-verify's own timeout uses signal.alarm, which works here because the loop runs in the main thread.
"""

import logging
import sys
from multiprocessing.connection import Connection


def verify_pair(answer: str, reference: str, timeout_seconds: int) -> tuple[bool | None, str]:
    """math-verify equivalence of two extracted answers: (equal, reason); equal is None on timeout."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout_seconds, raise_on_error=True)
        predicted = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_seconds, raise_on_error=True)
        if not gold or not predicted:
            return False, "math-verify-unparsable"
        equal = verify(gold, predicted, timeout_seconds=timeout_seconds, raise_on_error=True)
    except TimeoutException:
        return None, "timeout"
    except Exception as error:  # sympy raises many exception types on odd input; all mean "not verified"
        return False, f"error: {type(error).__name__}"
    return bool(equal), "math-verify-equal" if equal else "math-verify-different"


def serve(requests: Connection, replies: Connection, timeout_seconds: int) -> None:
    """Import math-verify, say ready, then answer (answer, reference) pairs until the request pipe closes."""
    import math_verify  # noqa: F401  (imported before "ready", so no deadline pays for the import)

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    replies.send("ready")
    while True:
        try:
            answer, reference = requests.recv()
        except EOFError:
            return
        replies.send(verify_pair(answer, reference, timeout_seconds))


if __name__ == "__main__":
    request_fd, reply_fd, timeout = (int(value) for value in sys.argv[1:4])
    serve(Connection(request_fd, writable=False), Connection(reply_fd, readable=False), timeout)

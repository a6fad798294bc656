"""Local networking the launchers, the weight-sync group, the converter and the tests share."""

import socket


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (the caller binds it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

"""Local networking the launchers, the weight-sync group, the converter and the tests share: free ports, and the
address of this host that the other hosts of a run reach it at.

    peer host (a rollout server) ─► route_source: the address this host sends from to reach it

Why: a host's own name is no guide. Debian's /etc/hosts maps it to 127.0.1.1, so `gethostbyname(gethostname())` is
loopback there: a rollout server told to dial it dials itself. The route to a peer is what the peer can reach back.

Nothing here sends a packet (a UDP socket's connect only picks the route) or needs torch.
"""

from __future__ import annotations

import ipaddress
import socket

from megatron_dppo.errors import UserInputError


class NetworkChoiceError(UserInputError):
    """No address or interface can be chosen for the other hosts to reach this one; says what to set."""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (the caller binds it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def resolve(host: str) -> str:
    """`host`'s IPv4 address as this host resolves it (its /etc/hosts, then DNS)."""
    try:
        return socket.gethostbyname(host)
    except OSError as error:
        raise NetworkChoiceError(f"host {host!r} does not resolve on {socket.gethostname()}: {error}") from None


def route_source(host: str) -> str:
    """The local IPv4 address this host sends from to reach `host` (a name or an address): the address `host` reaches
    this one at. A local address gives itself; any loopback address gives loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((resolve(host), 9))  # no packet: connect on UDP only routes
        return sock.getsockname()[0]


def address_reaching(hosts: list[str]) -> str:
    """This host's address that every one of `hosts` reaches it at (the one each route leaves from); hosts reached
    from different addresses raise, naming them."""
    sources = {host: route_source(host) for host in hosts}
    if len(set(sources.values())) > 1:
        routes = ", ".join(f"{host} from {source}" for host, source in sources.items())
        raise NetworkChoiceError(f"the rollout servers are reached from different addresses of this host ({routes}): "
                                 "pass --weight-sync-master-address with one they all reach")
    return next(iter(sources.values()))

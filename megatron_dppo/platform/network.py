"""Local networking the launchers, the weight-sync group, the converter and the tests share: free ports, and which
of this host's addresses (and interfaces) the other hosts of a run reach it at.

    peer host (a rollout server) ─► route_source: the address this host sends from to reach it ─► the weight-sync
    group's master address (address_reaching)
    peer host (MASTER_ADDR, the weight-sync master) ─► route_source ─► interface_of: the interface holding that address
    ─► GLOO_SOCKET_IFNAME, for gloo groups made meanwhile (gloo_interface, gloo_bound_to)

Why: a host's own name is no guide. Debian's /etc/hosts maps it to 127.0.1.1, so `gethostbyname(gethostname())` is
loopback there, and torch's gloo binds to that address (when GLOO_SOCKET_IFNAME is unset) and tells every other
member to dial it: each dials itself and the group times out. The route to a peer is what the peer can reach back.

Invariants:
- nothing here sends a packet (a UDP socket's connect only picks the route) or needs torch;
- a choice is only made where torch's own would fail: GLOO_SOCKET_IFNAME, when set, always wins, as does a host name
  that resolves to a routable address.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct

from megatron_dppo.errors import UserInputError

GLOO_INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR, _SIOCGIFFLAGS, _IFF_UP = 0x8915, 0x8913, 0x1


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


def interface_addresses(up_only: bool = True) -> dict[str, str]:
    """{interface: IPv4 address} of this host's interfaces that have one (those up, by default)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                address = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24])
                flags = struct.unpack("H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request)[16:18])[0]
            except OSError:  # no IPv4 address
                continue
            if flags & _IFF_UP or not up_only:
                found[name] = address
    return found


def interface_of(address: str) -> str:
    """The interface that holds `address`."""
    for name, held in interface_addresses(up_only=False).items():
        if held == address:
            return name
    raise NetworkChoiceError(f"no interface of {socket.gethostname()} holds {address}")


def gloo_interface(peer: str, members_elsewhere: bool = False) -> str | None:
    """The interface gloo must bind for a group with `peer` (another member, or the group's master) so that members
    on other hosts can reach this one; None where torch's own choice serves (GLOO_SOCKET_IFNAME set, this host's name
    resolves to a routable address, or every member is on this host).

    The interface holding the address that routes to `peer`. Where `peer` is this host itself (the trainer's master
    node: MASTER_ADDR is its own name) but `members_elsewhere`, the host's one interface that is up with an IPv4
    address besides loopback; with several, NetworkChoiceError names them and GLOO_SOCKET_IFNAME."""
    if os.environ.get(GLOO_INTERFACE_VARIABLE):
        return None
    try:
        own = socket.gethostbyname(socket.gethostname())  # what torch's gloo binds to
    except OSError:
        own = None  # torch's gloo falls back to loopback
    if own is not None and not is_loopback(own):
        return None
    source = route_source(peer)
    if not is_loopback(source):
        return interface_of(source)
    if not members_elsewhere:
        return None
    candidates = sorted(name for name, address in interface_addresses().items() if not is_loopback(address))
    if len(candidates) == 1:
        return candidates[0]
    raise NetworkChoiceError(
        f"host {socket.gethostname()}'s name resolves to {own or 'no address'} (its /etc/hosts), so gloo would give "
        f"the other nodes a loopback address, and the host has {len(candidates)} other interfaces "
        f"({', '.join(candidates) or 'none up'}): set {GLOO_INTERFACE_VARIABLE} to the one the other nodes reach "
        "(examples/slurm/dppo.sbatch: SOCKET_IFNAME)")


@contextlib.contextmanager
def gloo_bound_to(interface: str | None):
    """GLOO_SOCKET_IFNAME=`interface` while gloo groups are created in the block (None: unchanged); torch reads it
    when a gloo group is made."""
    if interface is None:
        yield
        return
    before = os.environ.get(GLOO_INTERFACE_VARIABLE)
    os.environ[GLOO_INTERFACE_VARIABLE] = interface
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GLOO_INTERFACE_VARIABLE, None)
        else:
            os.environ[GLOO_INTERFACE_VARIABLE] = before


def address_reaching(hosts: list[str]) -> str:
    """This host's address that every one of `hosts` reaches it at (the one each route leaves from); hosts reached
    from different addresses raise, naming them."""
    sources = {host: route_source(host) for host in hosts}
    if len(set(sources.values())) > 1:
        routes = ", ".join(f"{host} from {source}" for host, source in sources.items())
        raise NetworkChoiceError(f"the rollout servers are reached from different addresses of this host ({routes}): "
                                 "pass --weight-sync-master-address with one they all reach")
    return next(iter(sources.values()))

"""Local networking the launchers, the weight-sync group, the converter and the tests share: free ports, this host's
interfaces, and which of its addresses (and interfaces) the other hosts of a run reach it at.

    getifaddrs(3) ─► host_interfaces: every interface with its flags (up, carrier, loopback) and every address on it
                     (IPv4 and IPv6, secondary addresses included)
    peer host (a rollout server; a name, an IPv4 or an IPv6 literal) ─► route_source: the address this host sends
    from to reach it ─► the weight-sync group's master address (address_reaching)
    weight-sync master address ─► sync_interface: the interface holding the address its route leaves from
        ─► GLOO_SOCKET_IFNAME while the sync group's gloo side is made (gloo_bound_to)
        ─► NCCL_SOCKET_IFNAME for the process, before its first NCCL communicator (sync_socket_environment)
    peer host (MASTER_ADDR) ─► gloo_interface ─► GLOO_SOCKET_IFNAME for the trainer's own gloo groups

Why: a host's own name is no guide. Debian's /etc/hosts maps it to 127.0.1.1, so `gethostbyname(gethostname())` is
loopback there, and torch's gloo binds to that address (when GLOO_SOCKET_IFNAME is unset) and tells every other
member to dial it: each dials itself and the group times out. NCCL picks its own bootstrap interface (IPoIB first),
which the rollout nodes may not reach. The route to a peer is what the peer can reach back.

Invariants:
- nothing here sends a packet (a UDP socket's connect only picks the route) or needs torch;
- a choice is only made where the user made none: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, when set, always win;
- an interface that is up without a link (docker0 or virbr0 with nothing attached: IFF_RUNNING off, `ip` shows
  NO-CARRIER) is never chosen. The flag comes from getifaddrs, which reads the calling process's network namespace;
  /sys/class/net/*/operstate would be the one of whichever namespace /sys was mounted in;
- a peer on this host (its address is one of ours, or loopback) reaches any of our addresses, so it never makes the
  choice of one fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import socket
from dataclasses import dataclass

from megatron_dppo.errors import UserInputError

GLOO_INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"
NCCL_INTERFACE_VARIABLE = "NCCL_SOCKET_IFNAME"
_IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x1, 0x8, 0x40  # <net/if.h>
# The socket variables the user set, read when this module is first imported (before anything here sets them): a
# choice made here for one group never stands in for the user's in another.
USER_SET_VARIABLES = frozenset(name for name in (GLOO_INTERFACE_VARIABLE, NCCL_INTERFACE_VARIABLE)
                               if os.environ.get(name))


class NetworkChoiceError(UserInputError):
    """No address or interface can be chosen for the other hosts to reach this one; says what to set."""


# ------------------------------------------------------------------------------------------------ ports
def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (the caller binds it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class PortRange:
    """The ports a listener may take: one (`29600`), a range (`29600-29609`), or any free one (`0`)."""

    first: int
    last: int

    @classmethod
    def parse(cls, text: str) -> PortRange:
        """`PORT`, `FIRST-LAST` or `0`; ValueError naming the rule otherwise."""
        parts = text.split("-")
        if len(parts) > 2 or not all(part.strip().isdigit() for part in parts):
            raise ValueError(f"{text!r} is not a port or a range of ports; give PORT or FIRST-LAST (0: any free one)")
        first, last = int(parts[0]), int(parts[-1])
        if first == 0 and last == 0:
            return cls(0, 0)
        if not 1 <= first <= last <= 65535:
            raise ValueError(f"{text!r} is not a port or a range of ports; give PORT or FIRST-LAST, ports in "
                             "1-65535, FIRST <= LAST (0: any free one)")
        return cls(first, last)

    @property
    def any(self) -> bool:
        return self.first == 0

    def __str__(self) -> str:
        return "any free port" if self.any else str(self.first) if self.first == self.last else \
            f"{self.first}-{self.last}"


ANY_PORT = PortRange(0, 0)


def free_port_in(ports: PortRange, what: str) -> int:
    """A port of `ports` free on every interface a moment ago (the caller binds it next); any free one for `0`.
    NetworkChoiceError names `what` (the flag) when every port of the range is taken."""
    if ports.any:
        return free_port()
    for port in range(ports.first, ports.last + 1):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise NetworkChoiceError(f"every port of {what} {ports} is taken on {socket.gethostname()}: widen the range "
                             "or free one")


# ------------------------------------------------------------------------------------------------ interfaces
@dataclass(frozen=True)
class Interface:
    """One network interface of this host as the kernel reports it."""

    name: str
    up: bool  # administratively up (IFF_UP)
    carrier: bool  # operationally up (IFF_RUNNING): a cable, a peer or a port is there
    loopback: bool
    addresses: tuple[str, ...]  # every IPv4 and IPv6 address, in the kernel's order (primary before secondaries)

    @property
    def usable(self) -> bool:
        """Up with a link, so that another host can reach an address on it."""
        return self.up and self.carrier


class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]  # large enough for sockaddr_in6


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("next", ctypes.POINTER(_Ifaddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.POINTER(_Sockaddr)), ("netmask", ctypes.POINTER(_Sockaddr)),
                     ("broadaddr", ctypes.POINTER(_Sockaddr)), ("data", ctypes.c_void_p)]


def _address_of(sockaddr: _Sockaddr) -> str | None:
    """The IP address of a sockaddr_in (offset 4) or sockaddr_in6 (offset 8), as text; None for other families."""
    raw = bytes(sockaddr.data)  # the bytes after the family field
    if sockaddr.family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[2:6])
    if sockaddr.family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[6:22])
    return None


def host_interfaces() -> list[Interface]:
    """Every interface of this host's network namespace, in the kernel's order, with all its IP addresses (getifaddrs:
    an entry per address, plus the link entry that carries flags of interfaces without any)."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found: dict[str, tuple[int, list[str]]] = {}
    try:
        entry = head
        while entry:
            item = entry.contents
            name = item.name.decode()
            flags, addresses = found.setdefault(name, (item.flags, []))
            address = _address_of(item.addr.contents) if item.addr else None
            if address is not None and address not in addresses:
                addresses.append(address)
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return [Interface(name, bool(flags & _IFF_UP), bool(flags & _IFF_RUNNING), bool(flags & _IFF_LOOPBACK),
                      tuple(addresses)) for name, (flags, addresses) in found.items()]


def same_address(a: str, b: str) -> bool:
    return ipaddress.ip_address(a) == ipaddress.ip_address(b)


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def interface_of(address: str, interfaces: list[Interface] | None = None) -> str:
    """The interface that holds `address` (a primary or secondary IPv4 address, or an IPv6 one)."""
    interfaces = host_interfaces() if interfaces is None else interfaces
    for interface in interfaces:
        if any(same_address(held, address) for held in interface.addresses):
            return interface.name
    raise NetworkChoiceError(f"no interface of {socket.gethostname()} holds {address}")


def reachable_interfaces(interfaces: list[Interface] | None = None) -> list[str]:
    """The interfaces another host could reach this one on: up, with a link, not loopback, with an address."""
    interfaces = host_interfaces() if interfaces is None else interfaces
    return [i.name for i in interfaces if i.usable and not i.loopback and i.addresses]


# ------------------------------------------------------------------------------------------------ routes
def resolve(host: str) -> str:
    """`host`'s address as this host resolves it: an IP literal (IPv6 ones with or without URL brackets) as it is,
    a name through /etc/hosts then DNS, its IPv4 address first (NCCL_SOCKET_FAMILY=AF_INET in dppo.sbatch)."""
    literal = host.strip("[]")
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(literal))
    try:
        infos = socket.getaddrinfo(literal, None, proto=socket.IPPROTO_TCP)
    except OSError as error:
        raise NetworkChoiceError(f"host {host!r} does not resolve on {socket.gethostname()}: {error}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


def route_source(host: str) -> str:
    """The local address this host sends from to reach `host` (a name, an IPv4 or an IPv6 address): the address `host`
    reaches this one at. A local address gives itself; any loopback address gives loopback."""
    address = resolve(host)
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))  # no packet: connect on UDP only routes
        except OSError as error:
            raise NetworkChoiceError(f"no route from {socket.gethostname()} to {host} ({address}): {error}") from None
        return sock.getsockname()[0]


def is_this_host(host: str) -> bool:
    """Whether `host` is this host: loopback, or one of its own addresses (the route to it leaves from it)."""
    address = resolve(host)
    return is_loopback(address) or same_address(route_source(address), address)


def address_reaching(hosts: list[str]) -> str:
    """This host's address that every one of `hosts` reaches it at (the one each route leaves from). A host that is
    this one reaches any of our addresses, so only the others decide (all of them on this host: loopback); others
    reached from different addresses raise, naming them."""
    remote = {host: route_source(host) for host in hosts if not is_this_host(host)}
    if not remote:
        return "127.0.0.1"
    if len(set(remote.values())) > 1:
        routes = ", ".join(f"{host} from {source}" for host, source in remote.items())
        raise NetworkChoiceError(f"the rollout servers are reached from different addresses of this host ({routes}): "
                                 "pass --weight-sync-master-address with one they all reach")
    return next(iter(remote.values()))


# ------------------------------------------------------------------------------------------------ socket interfaces
def sync_interface(master_address: str) -> str | None:
    """The interface a member of the weight-sync group binds on this host: the one holding the address its route to
    the group's master leaves from (on the master's own host, the master address's interface); None where that is
    loopback (every member on this host)."""
    source = route_source(master_address)
    return None if is_loopback(source) else interface_of(source)


def sync_socket_environment(master_address: str, backend: str) -> dict[str, str]:
    """The socket variables trainer rank 0 sets before its first NCCL communicator, so that NCCL's bootstrap listens
    on the interface the rollout servers reach (NCCL reads NCCL_SOCKET_IFNAME once per process, when it first
    initialises): {NCCL_SOCKET_IFNAME: the sync interface} for an NCCL weight sync to servers on other hosts, unless
    the user set it. The gloo side is bound per group (init_weight_update_group, gloo_bound_to)."""
    if backend != "nccl" or NCCL_INTERFACE_VARIABLE in USER_SET_VARIABLES:
        return {}
    interface = sync_interface(master_address)
    return {} if interface is None else {NCCL_INTERFACE_VARIABLE: interface}


def gloo_interface(peer: str, members_elsewhere: bool = False) -> str | None:
    """The interface the trainer's gloo groups must bind so that members on other hosts can reach this one, where
    `peer` is another member or the group's master (MASTER_ADDR); None where torch's own choice serves
    (GLOO_SOCKET_IFNAME set, this host's name resolves to a routable address, or every member is on this host).

    The interface holding the address that routes to `peer`. Where `peer` is this host itself (the trainer's master
    node: MASTER_ADDR is its own name) but `members_elsewhere`, the host's one interface that is up with a link and
    an address besides loopback; with several, NetworkChoiceError names them and GLOO_SOCKET_IFNAME."""
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
    candidates = sorted(reachable_interfaces())
    if len(candidates) == 1:
        return candidates[0]
    raise NetworkChoiceError(
        f"host {socket.gethostname()}'s name resolves to {own or 'no address'} (its /etc/hosts), so gloo would give "
        f"the other nodes a loopback address, and the host has {len(candidates)} other interfaces up with a link "
        f"({', '.join(candidates) or 'none'}): set {GLOO_INTERFACE_VARIABLE} to the one the other nodes reach "
        "(examples/slurm/dppo.sbatch: SOCKET_IFNAME)")


@contextlib.contextmanager
def gloo_bound_to(interface: str | None):
    """GLOO_SOCKET_IFNAME=`interface` while gloo groups are created in the block (None, or a value the user set:
    unchanged); torch reads it when a gloo group is made. A value set by this process (the trainer's own groups'
    interface, gloo_interface) is replaced in the block and restored after it."""
    if interface is None or GLOO_INTERFACE_VARIABLE in USER_SET_VARIABLES:
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

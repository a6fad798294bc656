"""platform/network.py on a real host of several interfaces: a network namespace made here, as a GPU node looks.

    node (namespace, host name "node", /etc/hosts: node on 127.0.1.1, peer and fabric-peer by address)
      lo
      eth0    10.77.0.1/24 + secondary 10.77.0.9/24 + fd77::1/64 ── veth ── peer namespace: 10.77.0.2, fd77::2
      ib0     10.78.0.1/24                                       ── veth ── fabric namespace: 10.78.0.2
      docker0 172.17.0.1/16, up, its other end down: NO-CARRIER (docker0 with no container)
      virbr0  192.168.122.1/24, a bridge up whose one port is down: NO-CARRIER (libvirt's virbr0)

The functions run inside the namespace on its real interfaces (getifaddrs, the kernel's routes), and what they see
is checked against `ip -j addr`, iproute2's own report of the same namespace. Namespaces need root; where they
cannot be made the tests fail with the reason (tests/cluster/cluster.sh's rule).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_dppo.platform.network import PortRange, free_port_in
from tests.launch import REPO_ROOT

PREFIX = f"dppo-pid{os.getpid()}-net"  # tests/cluster/cluster.sh sweep removes these once this process is gone
NODE, PEER, FABRIC = f"{PREFIX}-node", f"{PREFIX}-peer", f"{PREFIX}-fabric"
HOSTS = "127.0.0.1\tlocalhost\n127.0.1.1\tnode\n10.77.0.2\tpeer\n10.78.0.2\tfabric-peer\n::1\tlocalhost\n"


def ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"ip {' '.join(args)}: {result.stderr}"
    return result.stdout


def make_namespaces() -> None:
    for namespace in (NODE, PEER, FABRIC):
        ip("netns", "add", namespace)
    for namespace in (NODE, PEER, FABRIC):
        ip("-n", namespace, "link", "set", "lo", "up")
    ip("-n", NODE, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", PEER)
    ip("-n", NODE, "link", "add", "ib0", "type", "veth", "peer", "name", "ib0", "netns", FABRIC)
    ip("-n", NODE, "link", "add", "docker0", "type", "veth", "peer", "name", "docker0-peer")  # peer stays down
    ip("-n", NODE, "link", "add", "virbr0", "type", "bridge")
    ip("-n", NODE, "link", "add", "virbr0-nic", "type", "veth", "peer", "name", "vnet0")
    ip("-n", NODE, "link", "set", "virbr0-nic", "master", "virbr0")
    for namespace, device, addresses in (
            (NODE, "eth0", ["10.77.0.1/24", "10.77.0.9/24", "fd77::1/64"]),
            (PEER, "eth0", ["10.77.0.2/24", "fd77::2/64"]),
            (NODE, "ib0", ["10.78.0.1/24"]), (FABRIC, "ib0", ["10.78.0.2/24"]),
            (NODE, "docker0", ["172.17.0.1/16"]), (NODE, "virbr0", ["192.168.122.1/24"])):
        for address in addresses:
            ip("-n", namespace, "addr", "add", address, "dev", device, *(["nodad"] if ":" in address else []))
        ip("-n", namespace, "link", "set", device, "up")


@pytest.fixture(scope="module")
def node():
    if os.geteuid() != 0:
        pytest.fail(f"network namespaces need root (uid {os.geteuid()}): run these tests as root (CI does)",
                    pytrace=False)
    hosts_dir = f"/etc/netns/{NODE}"  # `ip netns exec` mounts its files over /etc
    try:
        make_namespaces()
        os.makedirs(hosts_dir, exist_ok=True)
        with open(f"{hosts_dir}/hosts", "w") as hosts:
            hosts.write(HOSTS)
        yield NODE
    finally:
        for namespace in (NODE, PEER, FABRIC):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run(["rm", "-rf", hosts_dir], timeout=30)


def on_node(code: str, env: dict | None = None) -> dict:
    """Run `code` (which prints one JSON line) in the node namespace, as host "node"; its result."""
    script = "import json\nfrom megatron_dppo.platform import network\n" + textwrap.dedent(code)
    command = ["ip", "netns", "exec", NODE, "unshare", "--uts", "sh", "-c", 'hostname node && exec "$@"', "sh",
               sys.executable, "-c", script]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_interfaces_are_read_with_every_address_and_their_link_state_as_iproute2_reports_them(node):
    seen = on_node("""
        print(json.dumps([[i.name, i.up, i.carrier, i.loopback, list(i.addresses)] for i in network.host_interfaces()]))
    """)
    reference = json.loads(ip("-n", NODE, "-j", "addr"))
    expected = {link["ifname"]: ["UP" in link["flags"], "NO-CARRIER" not in link["flags"] and "UP" in link["flags"],
                                 "LOOPBACK" in link["flags"], sorted(a["local"] for a in link.get("addr_info", []))]
                for link in reference}
    got = {name: [up, carrier, loopback, sorted(addresses)] for name, up, carrier, loopback, addresses in seen}
    # link-local IPv6 addresses come and go with the link; compare the ones configured here
    for table in (expected, got):
        for row in table.values():
            row[3] = [address for address in row[3] if not address.startswith("fe80:")]
    assert got == expected
    assert got["eth0"] == [True, True, False, ["10.77.0.1", "10.77.0.9", "fd77::1"]]
    assert got["docker0"][:2] == [True, False] and got["virbr0"][:2] == [True, False]  # up, no link


def test_secondary_and_ipv6_addresses_are_found_on_their_interface(node):
    seen = on_node("""
        print(json.dumps({address: network.interface_of(address)
                          for address in ("10.77.0.1", "10.77.0.9", "fd77::1", "10.78.0.1", "127.0.0.1")}))
    """)
    assert seen == {"10.77.0.1": "eth0", "10.77.0.9": "eth0", "fd77::1": "eth0", "10.78.0.1": "ib0",
                    "127.0.0.1": "lo"}


def test_ipv6_literals_in_urls_resolve_and_route(node):
    seen = on_node("""
        from urllib.parse import urlsplit
        host = urlsplit("http://[fd77::2]:30000").hostname
        print(json.dumps({"resolve": network.resolve("[fd77::2]"), "route": network.route_source(host),
                          "master": network.address_reaching([host]), "interface": network.sync_interface(host)}))
    """)
    assert seen == {"resolve": "fd77::2", "route": "fd77::1", "master": "fd77::1", "interface": "eth0"}


def test_a_server_on_the_trainers_own_node_beside_remote_ones_takes_the_remote_ones_address(node):
    seen = on_node("""
        out = {"own name + remote": network.address_reaching(["node", "peer"]),
               "loopback + remote": network.address_reaching(["127.0.0.1", "10.77.0.2"]),
               "own address + remote": network.address_reaching(["10.77.0.1", "peer"]),
               "all local": network.address_reaching(["node", "127.0.0.1"])}
        try:
            network.address_reaching(["peer", "fabric-peer"])
        except network.NetworkChoiceError as error:
            out["two networks"] = str(error)
        print(json.dumps(out))
    """)
    assert seen["own name + remote"] == seen["loopback + remote"] == seen["own address + remote"] == "10.77.0.1"
    assert seen["all local"] == "127.0.0.1"
    assert "peer from 10.77.0.1" in seen["two networks"] and "fabric-peer from 10.78.0.1" in seen["two networks"]
    assert "--weight-sync-master-address" in seen["two networks"]


GLOO_CHOICE = """
    try:
        print(json.dumps({"chosen": network.gloo_interface("node", members_elsewhere=True)}))
    except network.NetworkChoiceError as error:
        print(json.dumps({"error": str(error)}))
"""


def test_interfaces_up_without_a_link_are_never_candidates_for_gloo(node):
    """The master's node (its name is loopback): the one interface up with a link is chosen; docker0 and virbr0,
    up without one, are not counted."""
    both = on_node(GLOO_CHOICE)
    assert "2 other interfaces up with a link (eth0, ib0)" in both["error"] and "GLOO_SOCKET_IFNAME" in both["error"]
    ip("-n", NODE, "link", "set", "ib0", "down")
    try:
        assert on_node(GLOO_CHOICE) == {"chosen": "eth0"}
    finally:
        ip("-n", NODE, "link", "set", "ib0", "up")


def test_the_sync_interface_sets_ncclS_and_gloos_socket_interface_unless_the_user_did(node):
    check = """
        import os
        from megatron_dppo.platform.network import gloo_bound_to
        out = {"nccl to eth0's secondary": network.sync_socket_environment("10.77.0.9", "nccl"),
               "nccl to ib0": network.sync_socket_environment("10.78.0.1", "nccl"),
               "nccl local": network.sync_socket_environment("127.0.0.1", "nccl"),
               "gloo backend": network.sync_socket_environment("10.77.0.1", "gloo"),
               "from a server's side": network.sync_interface("fabric-peer")}
        with gloo_bound_to(network.sync_interface("10.78.0.1")):
            out["gloo in the block"] = os.environ.get("GLOO_SOCKET_IFNAME")
        out["gloo after"] = os.environ.get("GLOO_SOCKET_IFNAME")
        print(json.dumps(out))
    """
    assert on_node(check) == {
        "nccl to eth0's secondary": {"NCCL_SOCKET_IFNAME": "eth0"}, "nccl to ib0": {"NCCL_SOCKET_IFNAME": "ib0"},
        "nccl local": {}, "gloo backend": {}, "from a server's side": "ib0", "gloo in the block": "ib0",
        "gloo after": None}
    user_set = on_node(check, env={"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"})
    assert user_set["nccl to ib0"] == {} and user_set["gloo in the block"] == user_set["gloo after"] == "eth0"


def test_a_port_range_gives_its_first_free_port_and_names_the_flag_when_all_are_taken():
    assert PortRange.parse("29600") == PortRange(29600, 29600)
    assert PortRange.parse("29600-29609") == PortRange(29600, 29609) and PortRange.parse("0").any
    for bad in ("29609-29600", "70000", "a-b", "1-2-3", ""):
        with pytest.raises(ValueError, match="FIRST-LAST"):
            PortRange.parse(bad)
    import socket

    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        assert free_port_in(PortRange(taken, taken + 1), "--weight-sync-port") == taken + 1
        with pytest.raises(Exception, match=f"every port of --weight-sync-port {taken} is taken"):
            free_port_in(PortRange(taken, taken), "--weight-sync-port")

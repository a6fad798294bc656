#!/usr/bin/env bash
# A three-host test cluster on one Linux kernel: hosts trainer-0, trainer-1 and rollout-0, each a network + UTS +
# mount namespace with its own host name, its own address on a private bridge and a Debian-style /etc/hosts.
#
#   tests/cluster/cluster.sh start DIR             make the hosts (as root; apt-get installs iproute2 where missing)
#   tests/cluster/cluster.sh exec DIR HOST CMD...  run CMD on HOST (its network, host name and /etc/hosts; same cwd)
#   tests/cluster/cluster.sh kill DIR HOST         SIGKILL every process on HOST (as if it crashed; the host stays)
#   tests/cluster/cluster.sh link DIR HOST down|up pull HOST's cable (its switch port goes down: the host keeps its
#                                                  address and routes, its packets go nowhere, nothing tells either
#                                                  side), or plug it back
#   tests/cluster/cluster.sh stop DIR              kill every process on the hosts, remove namespaces and bridge
#   tests/cluster/cluster.sh sweep                 stop the clusters (and namespaces) whose owner is gone
#
# DIR/nodes then lists the hosts as "name=address ..." (tests/slurm/local_slurm.sh's NODES).
#
#   bridge namespace <tag>-bridge:  bridge br0 ── veth ──┬── <tag>-trainer-0: eth0 10.243.0.1/24
#                                                        ├── <tag>-trainer-1: eth0 10.243.0.2/24
#                                                        └── <tag>-rollout-0: eth0 10.243.0.3/24
#   each host: lo up, hostname HOST, /etc/hosts (bind-mounted in its own mount namespace):
#       127.0.0.1 localhost / 127.0.1.1 HOST / the other hosts by their addresses
#
# The bridge lives in a namespace of its own and each veth is made there, so the root namespace's network is never
# touched; the addresses exist only inside these namespaces (no route leads out). A host is held by one process
# (`sleep`, its namespaces' first member; pid in DIR/HOST.pid) that `exec` enters with nsenter. `stop` kills every
# process in the hosts' network namespaces (by pid, from `ip netns pids`) and deletes the namespaces, which removes the
# veths and the bridge; the mount namespaces (and their /etc/hosts mounts) end with their last process. `stop` is
# safe to run on a half-started cluster and twice.
# Settings: CLUSTER_HOSTS (default "trainer-0 trainer-1 rollout-0"), CLUSTER_SUBNET (first three octets, default
# 10.243.0; the i-th host, from 1, gets .i), CLUSTER_OWNER_PID (default: the caller's pid, e.g. pytest's).
#
# Namespaces are named dppo-pid<OWNER>-<DIR's checksum>-<host>, so clusters in different DIRs coexist and each names
# the process it lives for. A test killed without its teardown leaves its cluster behind (the holders are in their own
# sessions); `sweep` (which the tests run before making a cluster) stops every dppo-pid<N>-* namespace whose process
# N is gone, and whatever runs in it. Clusters of live owners are left alone.
set -euo pipefail

USAGE="usage: cluster.sh start|exec|kill|link|stop DIR [HOST [CMD...]], or cluster.sh sweep"
ACTION=${1:?$USAGE}
if [ "$ACTION" = sweep ]; then
    for namespace in $(ip netns list 2>/dev/null | cut -d' ' -f1 | grep -E '^dppo-pid[0-9]+-' || true); do
        owner=${namespace#dppo-pid}
        owner=${owner%%-*}
        if ! kill -0 "$owner" 2>/dev/null; then
            pids=$(ip netns pids "$namespace" 2>/dev/null || true)
            # shellcheck disable=SC2086
            [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
            ip netns del "$namespace" 2>/dev/null || true
            echo "cluster.sh: swept $namespace (its owner, pid $owner, is gone)" >&2
        fi
    done
    exit 0
fi
DIR=${2:?$USAGE}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
STATE=$DIR/cluster.env

fail() {
    echo "cluster.sh: $*" >&2
    exit 1
}

require_tools() {
    [ "$(id -u)" = 0 ] || fail "network namespaces need root (uid $(id -u)): run the cluster tests as root (CI does)"
    local missing=() tool
    for tool in ip:iproute2 unshare:util-linux nsenter:util-linux mount:mount; do
        command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    echo "cluster.sh: installing ${missing[*]} with apt-get" >&2
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
        >"$DIR/apt.log" 2>&1; then
        tail -n 20 "$DIR/apt.log" >&2
        fail "apt-get could not install ${missing[*]} (ip, unshare, nsenter, mount); see $DIR/apt.log"
    fi
}

start() {
    require_tools
    [ ! -e "$STATE" ] || fail "$DIR already holds a cluster ($STATE): stop it first"
    local tag subnet owner=${CLUSTER_OWNER_PID:-$PPID}
    tag=dppo-pid$owner-$(printf '%s' "$DIR" | cksum | cut -d' ' -f1)
    HOSTS=${CLUSTER_HOSTS:-trainer-0 trainer-1 rollout-0}
    subnet=${CLUSTER_SUBNET:-10.243.0}
    printf 'TAG=%q\nHOSTS=%q\nSUBNET=%q\nOWNER=%q\n' "$tag" "$HOSTS" "$subnet" "$owner" >"$STATE"
    # shellcheck disable=SC2086
    set -- $HOSTS
    local i=0 host nodes=()
    for host in "$@"; do
        i=$((i + 1))
        nodes+=("$host=$subnet.$i")
    done
    echo "${nodes[*]}" >"$DIR/nodes"

    ip netns add "$tag-bridge" || fail "could not create a network namespace (ip netns add): is this a container " \
        "without CAP_SYS_ADMIN?"
    ip -n "$tag-bridge" link add br0 type bridge
    ip -n "$tag-bridge" link set br0 up
    i=0
    for host in "$@"; do
        i=$((i + 1))
        ip netns add "$tag-$host"
        ip -n "$tag-bridge" link add "veth$i" type veth peer name eth0 netns "$tag-$host"
        ip -n "$tag-bridge" link set "veth$i" master br0
        ip -n "$tag-bridge" link set "veth$i" up
        ip -n "$tag-$host" link set lo up
        ip -n "$tag-$host" addr add "$subnet.$i/24" dev eth0
        ip -n "$tag-$host" link set eth0 up
    done

    i=0
    for host in "$@"; do
        i=$((i + 1))
        {
            printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n' "$host"
            local j=0 other
            for other in "$@"; do
                j=$((j + 1))
                [ "$other" = "$host" ] || printf '%s.%s\t%s\n' "$subnet" "$j" "$other"
            done
            printf '::1\tlocalhost ip6-localhost ip6-loopback\n'
        } >"$DIR/$host.hosts"
        rm -f "$DIR/$host.ready"
        # the network namespace -> unshare (UTS and mount namespaces, no mount propagation back) -> the host name
        # and /etc/hosts -> sleep holds them. Not `ip netns exec`: its fresh /sys would hide /sys/fs/cgroup, which
        # slurmd needs; /sys/class/net therefore lists the root namespace's interfaces (use `ip link` on a host).
        setsid nsenter --net="/run/netns/$tag-$host" unshare --uts --mount --propagation private \
            sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && touch "$3" && exec sleep infinity' \
            sh "$host" "$DIR/$host.hosts" "$DIR/$host.ready" </dev/null >"$DIR/$host.holder.log" 2>&1 &
        echo $! >"$DIR/$host.pid"
    done
    local deadline=$((SECONDS + 30))
    for host in "$@"; do
        while [ ! -e "$DIR/$host.ready" ]; do
            kill -0 "$(cat "$DIR/$host.pid")" 2>/dev/null ||
                fail "host $host did not start: $(cat "$DIR/$host.holder.log")"
            [ $SECONDS -lt $deadline ] || fail "host $host not ready after 30 s"
            sleep 0.1
        done
    done
    for host in "$@"; do
        local seen
        seen=$(run_on "$host" hostname)
        [ "$seen" = "$host" ] || fail "host $host reports host name '$seen'"
    done
    echo "cluster.sh: hosts $* up on $subnet.0/24 (namespaces $tag-*)" >&2
}

namespace_pids() {  # the processes in these network namespaces
    local ns
    for ns in "$@"; do
        ip netns pids "$ns" 2>/dev/null || true
    done
}

kill_host() {
    local host=$1 holder pids
    holder=$(cat "$DIR/$host.pid" 2>/dev/null) || fail "no host $host in $DIR (hosts: $HOSTS)"
    pids=$(namespace_pids "$TAG-$host" | grep -vx "$holder" || true)
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
}

set_link() {  # the bridge's end of HOST's cable: veth<i> of the bridge namespace
    local host=$1 state=$2 i=0 each
    [ "$state" = down ] || [ "$state" = up ] || fail "link state must be down or up, not '$state'"
    for each in $HOSTS; do
        i=$((i + 1))
        if [ "$each" = "$host" ]; then
            ip -n "$TAG-bridge" link set "veth$i" "$state"
            return
        fi
    done
    fail "no host $host in $DIR (hosts: $HOSTS)"
}

run_on() {
    local host=$1 pid
    shift
    pid=$(cat "$DIR/$host.pid" 2>/dev/null) || fail "no host $host in $DIR (hosts: $HOSTS)"
    nsenter --target "$pid" --net --uts --mount --wd="$PWD" -- "$@"
}

stop() {
    [ -e "$STATE" ] || return 0
    # shellcheck disable=SC1090
    . "$STATE"
    local host namespaces=() pids
    for host in $HOSTS; do
        namespaces+=("$TAG-$host")
    done
    namespaces+=("$TAG-bridge")
    for signal in TERM KILL; do
        pids=$(namespace_pids "${namespaces[@]}")
        [ -n "$pids" ] || break
        # shellcheck disable=SC2086
        kill -s "$signal" $pids 2>/dev/null || true
        for _ in $(seq 50); do
            pids=$(namespace_pids "${namespaces[@]}")
            [ -n "$pids" ] || break
            sleep 0.1
        done
    done
    for ns in "${namespaces[@]}"; do
        if ip netns list | grep -qw -- "$ns"; then
            ip netns del "$ns"
        fi
    done
    rm -f "$STATE" "$DIR/nodes" "$DIR"/*.pid "$DIR"/*.ready
    echo "cluster.sh: stopped $HOSTS (namespaces $TAG-* removed)" >&2
}

case $ACTION in
    start)
        trap 'status=$?; [ $status -eq 0 ] || stop; exit $status' EXIT
        start
        ;;
    exec)
        [ -e "$STATE" ] || fail "no cluster in $DIR: run cluster.sh start $DIR"
        # shellcheck disable=SC1090
        . "$STATE"
        [ $# -ge 4 ] || fail "usage: cluster.sh exec DIR HOST CMD..."
        run_on "$3" "${@:4}"
        ;;
    kill)
        [ -e "$STATE" ] || fail "no cluster in $DIR: run cluster.sh start $DIR"
        # shellcheck disable=SC1090
        . "$STATE"
        kill_host "${3:?usage: cluster.sh kill DIR HOST}"
        ;;
    link)
        [ -e "$STATE" ] || fail "no cluster in $DIR: run cluster.sh start $DIR"
        # shellcheck disable=SC1090
        . "$STATE"
        set_link "${3:?usage: cluster.sh link DIR HOST down|up}" "${4:?usage: cluster.sh link DIR HOST down|up}"
        ;;
    stop)
        stop
        ;;
    *)
        fail "unknown action '$ACTION' (use start, exec, kill, link, stop or sweep)"
        ;;
esac

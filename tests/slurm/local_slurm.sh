#!/usr/bin/env bash
# A Slurm cluster for tests: Debian's slurm-wlm and munge, no cgroups, no accounting. By default one node,
# localhost; with NODES and ON_NODE, one slurmd on each host of a test cluster (tests/cluster/cluster.sh).
#
#   tests/slurm/local_slurm.sh start DIR   install (as root, when missing), write DIR/slurm.conf, start munged,
#                                          slurmctld (on the first node) and a slurmd per node, wait until every
#                                          node is idle
#   tests/slurm/local_slurm.sh stop DIR    stop the daemons started by `start DIR` (by their pid files) and remove
#                                          the munge key if `start DIR` created it
#
# Clients then need SLURM_CONF=DIR/slurm.conf (and, with ON_NODE, to run on a node). Settings: CPUS (default: nproc),
# each node's CPU count; NODES, the nodes as "name=address ..." (default "localhost"; the first runs slurmctld);
# ON_NODE, a command that runs its arguments after the first on the node the first names (e.g.
# "tests/cluster/cluster.sh exec DIR"; default: run here). munged runs here: the hosts share its socket's file system.
set -euo pipefail

ACTION=${1:?usage: local_slurm.sh start|stop DIR}
DIR=${2:?usage: local_slurm.sh start|stop DIR}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "local_slurm.sh: slurm-wlm and munge are missing and installing them needs root" >&2
        exit 1
    fi
    echo "local_slurm.sh: installing slurm-wlm and munge with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; } >"$DIR/apt.log" 2>&1
    then
        echo "local_slurm.sh: apt-get could not install slurm-wlm and munge; see $DIR/apt.log:" >&2
        tail -n 20 "$DIR/apt.log" >&2
        exit 1
    fi
}

read -r -a NODE_LIST <<<"${NODES:-localhost}"
CONTROLLER=${NODE_LIST[0]%%=*}

on_node() {
    local node=$1
    shift
    if [ -n "${ON_NODE:-}" ]; then
        # shellcheck disable=SC2086
        $ON_NODE "$node" "$@"
    else
        "$@"
    fi
}

write_config() {
    local cpus=${CPUS:-$(nproc)}
    local memory_mb node names=()
    memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)
    mkdir -p "$DIR/state" "$DIR/log"
    for node in "${NODE_LIST[@]}"; do
        names+=("${node%%=*}")
        mkdir -p "$DIR/spool/${node%%=*}"
    done
    cat >"$DIR/slurm.conf" <<CONF
ClusterName=dppo-test
SlurmctldHost=$(with_address "${NODE_LIST[0]}" "(")
SlurmUser=root
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
$(for node in "${NODE_LIST[@]}"; do
    echo "NodeName=$(with_address "$node" NodeAddr=) CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN"
done)
PartitionName=debug Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP
CONF
}

with_address() {  # "name=address" PREFIX -> "name PREFIXaddress" (Prefix "(": "name(address)"); "name" -> "name"
    local node=$1 prefix=$2
    if [ "$node" = "${node%%=*}" ]; then
        echo "$node"
    elif [ "$prefix" = "(" ]; then
        echo "${node%%=*}(${node#*=})"
    else
        echo "${node%%=*} $prefix${node#*=}"
    fi
}

start_daemons() {
    mkdir -p /run/munge
    if [ ! -s /etc/munge/munge.key ]; then
        echo created >"$DIR/munge_key.created"  # first: a key half-made by a failed start is removed too
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chmod 400 /etc/munge/munge.key
    fi
    if ! munge -n >/dev/null 2>&1; then
        # Our own munged; --force lets it run as root in a container.
        munged --force --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log"
        echo started >"$DIR/munged.started"
    fi
    export SLURM_CONF=$DIR/slurm.conf
    on_node "$CONTROLLER" slurmctld -f "$SLURM_CONF"
    local node
    for node in "${NODE_LIST[@]}"; do
        on_node "${node%%=*}" slurmd -f "$SLURM_CONF" -N "${node%%=*}"
    done
    local deadline=$((SECONDS + 60)) states=""
    while [ $SECONDS -lt $deadline ]; do
        states=$(on_node "$CONTROLLER" sinfo -h -N -o '%N=%T' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        if [ -n "$states" ] && [ "$(echo "$states" | tr ' ' '\n' | grep -c '=idle$')" -eq ${#NODE_LIST[@]} ]; then
            echo "local_slurm.sh: ${#NODE_LIST[@]} nodes idle (config $SLURM_CONF)" >&2
            return 0
        fi
        sleep 0.5
    done
    echo "local_slurm.sh: nodes not idle after 60 s (states: '${states:-none}'); logs in $DIR/log:" >&2
    tail -n 20 "$DIR"/log/*.log >&2 || true
    exit 1
}

stop_pidfile() {
    local pidfile=$1 pid
    [ -s "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

case $ACTION in
    start)
        install_packages
        write_config
        start_daemons
        ;;
    stop)
        for pidfile in "$DIR"/slurmd-*.pid; do
            stop_pidfile "$pidfile"
        done
        stop_pidfile "$DIR/slurmctld.pid"
        if [ -e "$DIR/munged.started" ]; then
            stop_pidfile "$DIR/munged.pid"
            rm -f "$DIR/munged.started"
        fi
        if [ -e "$DIR/munge_key.created" ]; then  # a munged still running read it at its start
            rm -f /etc/munge/munge.key "$DIR/munge_key.created"
        fi
        ;;
    *)
        echo "local_slurm.sh: unknown action '$ACTION' (use start or stop)" >&2
        exit 2
        ;;
esac

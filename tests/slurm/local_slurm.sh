#!/usr/bin/env bash
# A one-node Slurm cluster on localhost for tests: Debian's slurm-wlm and munge, no cgroups, no accounting.
#
#   tests/slurm/local_slurm.sh start DIR   install (as root, when missing), write DIR/slurm.conf, start munged,
#                                          slurmctld and slurmd, wait until the node is idle
#   tests/slurm/local_slurm.sh stop DIR    stop the three daemons started by `start DIR` (by their pid files)
#
# Clients then need SLURM_CONF=DIR/slurm.conf. CPUS (default: nproc) sets the node's CPU count.
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

write_config() {
    local cpus=${CPUS:-$(nproc)}
    local memory_mb
    memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    cat >"$DIR/slurm.conf" <<CONF
ClusterName=dppo-test
SlurmctldHost=localhost
SlurmUser=root
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
NodeName=localhost CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
}

start_daemons() {
    mkdir -p /run/munge
    if [ ! -s /etc/munge/munge.key ]; then
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
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF" -N localhost
    local deadline=$((SECONDS + 60)) state=""
    while [ $SECONDS -lt $deadline ]; do
        state=$(sinfo -h -N -n localhost -o %T 2>/dev/null || true)
        case $state in
            idle*) echo "local_slurm.sh: node localhost is idle (config $SLURM_CONF)" >&2; return 0 ;;
        esac
        sleep 0.5
    done
    echo "local_slurm.sh: node not idle after 60 s (state: '${state:-none}'); logs in $DIR/log:" >&2
    tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
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
        stop_pidfile "$DIR/slurmd.pid"
        stop_pidfile "$DIR/slurmctld.pid"
        if [ -e "$DIR/munged.started" ]; then
            stop_pidfile "$DIR/munged.pid"
            rm -f "$DIR/munged.started"
        fi
        ;;
    *)
        echo "local_slurm.sh: unknown action '$ACTION' (use start or stop)" >&2
        exit 2
        ;;
esac

#!/usr/bin/env bash
# One rollout node (started by dppo.sbatch through srun, one task per node): GPUS_PER_NODE / TP SGLang servers,
# server i on GPUs [i*TP, (i+1)*TP) and port BASE_PORT + i, each with its own log. Exits when any server exits
# (the trainer then fails on that URL: see docs/multinode.md) or when srun sends TERM. Servers run with
# --enable-deterministic-inference: without it SGLang ignores the trainer's per-sample sampling_seed, and rollouts
# (and so resumed runs) are not reproducible.
# ROLLOUT_ENGINE=embedded (environment; default sglang) starts the embedded CPU engine instead (SGLang's HTTP and
# weight-sync protocol, no GPU, TP 1): GPUS_PER_NODE engines per node, for multi-node runs without GPUs.
#
#   rollout_node.sh MODEL GPUS_PER_NODE TP BASE_PORT LOG_DIR PYTHON [extra SGLang flags ...]
set -euo pipefail

if [ $# -lt 6 ]; then
    echo "usage: rollout_node.sh MODEL GPUS_PER_NODE TP BASE_PORT LOG_DIR PYTHON [SGLang flags ...]" >&2
    exit 2
fi
MODEL=$1 GPUS=$2 TP=$3 BASE_PORT=$4 LOG_DIR=$5 PYTHON=$6
shift 6
NODE=${SLURMD_NODENAME:-$(hostname)}
ENGINE=${ROLLOUT_ENGINE:-sglang}
case $ENGINE in
    sglang) ;;
    embedded)
        if [ "$TP" != 1 ]; then
            echo "rollout_node.sh: ROLLOUT_ENGINE=embedded serves on the CPU without TP, but TP is $TP: SGLANG_TP=1" >&2
            exit 2
        fi ;;
    *)
        echo "rollout_node.sh: ROLLOUT_ENGINE=$ENGINE is not sglang or embedded" >&2
        exit 2 ;;
esac
mkdir -p "$LOG_DIR"

PIDS=()
stop_all() {
    for pid in "${PIDS[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
    wait || true
}
trap 'stop_all; exit 143' TERM INT

for ((i = 0; i < GPUS / TP; i++)); do
    port=$((BASE_PORT + i))
    devices=$(seq -s, $((i * TP)) $((i * TP + TP - 1)))
    log=$LOG_DIR/$ENGINE-$NODE-$port.log
    # the orders of megatron_dppo.rollout.launcher.sglang_command and embedded_engine_command, which the --dry-run
    # plan prints
    if [ "$ENGINE" = embedded ]; then
        echo "rollout_node.sh: $NODE embedded engine $i on the CPU, port $port, log $log"
        setsid "$PYTHON" -m megatron_dppo.servers.embedded --model-dir "$MODEL" --host 0.0.0.0 --port "$port" \
            --enable-deterministic-inference "$@" >"$log" 2>&1 &
    else
        echo "rollout_node.sh: $NODE server $i on GPUs $devices, port $port, log $log"
        CUDA_VISIBLE_DEVICES=$devices setsid "$PYTHON" -m sglang.launch_server --model-path "$MODEL" \
            --host 0.0.0.0 --port "$port" --enable-deterministic-inference --tp-size "$TP" "$@" >"$log" 2>&1 &
    fi
    PIDS+=($!)
done

status=0
wait -n "${PIDS[@]}" || status=$?
echo "rollout_node.sh: a server on $NODE exited with code $status; stopping the others" >&2
stop_all
exit 1

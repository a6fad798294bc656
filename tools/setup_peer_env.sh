#!/usr/bin/env bash
# The peer's own environment for bench/peer_grpo.py: Hugging Face TRL's GRPOTrainer, outside this project's venv.
#
#   python -m venv ENV_DIR ─► torch (CPU build, pinned) ─► trl + transformers (pinned, torch held by a constraint)
#   ─► drop torchvision/torchaudio if anything pulled them (CUDA builds only) ─► check the versions, print the python
#
# Idempotent: an environment that already holds the pinned versions is left as it is. PyPI only.
# Usage: tools/setup_peer_env.sh [ENV_DIR]     (default: the directory printed by --print-env-dir)
#        tools/setup_peer_env.sh --print-env-dir
# The transformers pin equals constraints.txt's, so in-process `generate` in the peer and the embedded engine run
# the same model code; torch is pinned because an unpinned one pulls a multi-GB CUDA build.
set -euo pipefail

TRL_VERSION=1.16.0
TORCH_VERSION=2.13.0
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_ENV_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/megatron_dppo/trl-peer-env"

if [[ "${1:-}" == "--print-env-dir" ]]; then
    echo "$DEFAULT_ENV_DIR"
    exit 0
fi
ENV_DIR="${1:-$DEFAULT_ENV_DIR}"
case "$ENV_DIR" in
    "$REPO"|"$REPO"/*) echo "error: $ENV_DIR is inside the repository; the peer environment goes outside it" >&2
                       exit 2 ;;
esac
TRANSFORMERS_VERSION="$(sed -n 's/^transformers==//p' "$REPO/constraints.txt")"
if [[ -z "$TRANSFORMERS_VERSION" ]]; then
    echo "error: constraints.txt pins no transformers==VERSION; the peer pins the same version as the project" >&2
    exit 2
fi
PYTHON="${PYTHON:-python3.11}"
PEER_PYTHON="$ENV_DIR/bin/python"

check() {
    "$PEER_PYTHON" - "$TRL_VERSION" "$TORCH_VERSION" "$TRANSFORMERS_VERSION" <<'EOF'
import sys
import torch, transformers, trl
trl_version, torch_version, transformers_version = sys.argv[1:]
problems = []
if trl.__version__ != trl_version:
    problems.append(f"trl {trl.__version__} (want {trl_version})")
if torch.__version__.split("+")[0] != torch_version or torch.version.cuda is not None:
    problems.append(f"torch {torch.__version__} with CUDA {torch.version.cuda} (want the {torch_version} CPU build)")
if transformers.__version__ != transformers_version:
    problems.append(f"transformers {transformers.__version__} (want {transformers_version})")
if problems:
    sys.exit("; ".join(problems))
EOF
}

if [[ -x "$PEER_PYTHON" ]] && check 2>/dev/null; then
    echo "peer environment ready (trl $TRL_VERSION, torch $TORCH_VERSION CPU): $PEER_PYTHON"
    exit 0
fi
if [[ ! -x "$PEER_PYTHON" ]]; then
    "$PYTHON" -m venv "$ENV_DIR"
fi
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
printf 'torch==%s\ntransformers==%s\n' "$TORCH_VERSION" "$TRANSFORMERS_VERSION" > "$CONSTRAINTS"
"$PEER_PYTHON" -m pip install -q --upgrade pip
"$PEER_PYTHON" -m pip install -q -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
"$PEER_PYTHON" -m pip install -q -c "$CONSTRAINTS" "trl==$TRL_VERSION" "transformers==$TRANSFORMERS_VERSION"
for package in torchvision torchaudio; do
    if "$PEER_PYTHON" -m pip show -q "$package" >/dev/null 2>&1; then
        "$PEER_PYTHON" -m pip uninstall -q -y "$package"
    fi
done
check
echo "peer environment ready (trl $TRL_VERSION, torch $TORCH_VERSION CPU): $PEER_PYTHON"

#!/usr/bin/env bash
# One-GPU smoke run of the GPU path (tests/gpu/test_gpu_smoke.py): a tiny Qwen3 converted by our converter, the TE
# actor, a real SGLang server on the same GPU, 3 DPPO steps with weight sync; checks the synced weight version and
# that the server's log-probs of the trained tokens match the trainer's. Run inside the Docker image (or any
# environment with `pip install -e '.[gpu,test]'`), from anywhere:
#
#   bash examples/gpu_smoke.sh
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_smoke.sh: no CUDA GPU visible to $PYTHON; this smoke run needs one" >&2
    exit 1
fi
cd "$REPO"
exec "$PYTHON" -m pytest -v -rs -s tests/gpu

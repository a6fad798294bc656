# megatron_dppo on an NGC PyTorch base: trainer (Megatron-Core + Transformer Engine) and SGLang rollout servers
# in one Python environment, so the weight-sync NCCL group joins two processes built on the same torch and NCCL.
#
#   docker build -t megatron-dppo:0.1.0 .
#   enroot import dockerd://megatron-dppo:0.1.0   # then srun --container-image=... under Slurm (docs/multinode.md)
#
# Versions: one consistent set (README.md states it; see docs/multinode.md, "The image"):
#   torch 2.14.1, sglang 0.5.23, transformers 5.19.0, megatron-core 0.16.1, transformer-engine 2.11.0.
# - SGLang 0.5.23 pins torch==2.14.1 (PyPI, CUDA 13 build), transformers==5.19.0 and flashinfer-python[cu13]==0.7.2,
#   and its kernels (sglang-kernel 0.4.10) are compiled against exactly that torch. NGC's own torch build
#   (2.x.0a0+nv) cannot satisfy an exact pin, so torch is replaced by the one SGLang pins; the NGC base still
#   provides CUDA 13, cuDNN, NCCL, HPC-X/UCX and InfiniBand user space, and the compilers Transformer Engine needs.
# - megatron-core 0.16.1 (the version this package is tested with) accepts Transformer Engine >=2.9.0a0,<2.12.0
#   (its own `dev` extra: transformer-engine[core_cu13,pytorch]); 2.11.0 is the newest release in that range.
# - NGC's packages compiled against its torch (Transformer Engine, apex, torchvision, ...) are removed first, and
#   Transformer Engine 2.11.0 is rebuilt against torch 2.14.1.
# - NGC sets PIP_CONSTRAINT to a file pinning its torch; it is cleared so the replacement is allowed.
FROM nvcr.io/nvidia/pytorch:26.03-py3

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PIP_CONSTRAINT="" \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    NVTE_FRAMEWORK=pytorch \
    MAX_JOBS=16

# Drop what NGC compiled against its own torch; pip ignores names that are not installed.
RUN pip uninstall -y transformer_engine transformer_engine_torch transformer_engine_cu13 apex torchvision \
        torchaudio torch_tensorrt flash_attn \
    && pip install --no-cache-dir \
        "torch==2.14.1" \
        "sglang==0.5.23" \
        "transformers==5.19.0" \
        "megatron-core==0.16.1"

# Transformer Engine in megatron-core 0.16.1's range, against torch 2.14.1: NVTE_PYTORCH_FORCE_BUILD makes it compile
# its PyTorch extension here (tens of minutes) instead of fetching a prebuilt one made for another torch.
RUN NVTE_PYTORCH_FORCE_BUILD=TRUE pip install --no-cache-dir --no-build-isolation \
        "transformer-engine[core_cu13,pytorch]==2.11.0"

WORKDIR /workspace/megatron_dppo
COPY setup.py pyproject.toml constraints.txt README.md ./
COPY megatron_dppo ./megatron_dppo
COPY examples ./examples
COPY tools ./tools
# examples/gpu_smoke.sh runs tests/gpu with pytest (and pyproject.toml's timeout, a pytest-timeout option)
COPY tests ./tests
# This package: its other dependencies (math-verify, safetensors, aiohttp, ...) come from setup.py;
# torch, transformers and megatron-core are already installed at the versions above and stay.
RUN pip install --no-cache-dir "megatron-dppo @ file:///workspace/megatron_dppo" "pytest==9.2.0" \
        "pytest-timeout==2.4.0" \
    && python -c "import importlib.metadata as m; \
versions = {name: m.version(name) for name in ('torch', 'sglang', 'transformers', 'megatron-core', \
'transformer-engine')}; \
print(versions); \
expected = {'torch': '2.14.1', 'sglang': '0.5.23', 'transformers': '5.19.0', 'megatron-core': '0.16.1', \
'transformer-engine': '2.11.0'}; \
assert {name: version.split('+')[0] for name, version in versions.items()} == expected, versions"

ENV PYTHONPATH=/workspace/megatron_dppo
CMD ["bash"]

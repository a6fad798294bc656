"""Which device the actor runs on, decided once: CUDA with NCCL where a GPU is visible, else the CPU mode over gloo.

Nothing else in the package asks which platform it is on except through `is_cpu()` / `distributed_backend()` /
`current_device()`;
hide the GPUs (`CUDA_VISIBLE_DEVICES=""`) to run the CPU mode on a GPU machine.
"""

import os


def is_cpu() -> bool:
    import torch  # here, not at the top: platform.network must stay importable without torch (argument parsing)

    return not torch.cuda.is_available()


def distributed_backend() -> str:
    return "gloo" if is_cpu() else "nccl"


def current_device():
    """This rank's device: its GPU (after `setup_device`), or the CPU."""
    import torch

    return torch.device("cpu") if is_cpu() else torch.device("cuda", torch.cuda.current_device())


def device_memory_bytes() -> int | None:
    """The memory of this rank's GPU (after `setup_device`), or None on the CPU (the host's memory is not planned)."""
    import torch

    return None if is_cpu() else torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


TRANSFORMER_IMPLS = ("transformer_engine", "local")  # Megatron-LM's --transformer-impl


def default_transformer_impl() -> str:
    """Megatron-LM's default, Transformer Engine, where a GPU runs the model; megatron-core's local spec on the CPU."""
    return "local" if is_cpu() else "transformer_engine"


def transformer_impl_error(transformer_impl: str) -> str | None:
    """Why `--transformer-impl transformer_engine` cannot run here (TE not installed, or no GPU), else None. The GPU
    is asked about only once TE is found, so that argument parsing stays torch-free where TE is absent."""
    import importlib.util

    if transformer_impl != "transformer_engine":
        return None
    if importlib.util.find_spec("transformer_engine") is None:
        return ("--transformer-impl transformer_engine (the default on a GPU) needs Transformer Engine, which is not "
                "installed: install it (pip install -e '.[gpu]', or the Dockerfile's image) or pass "
                "--transformer-impl local")
    if is_cpu():
        return ("--transformer-impl transformer_engine needs a CUDA GPU; on the CPU the model runs megatron-core's "
                "local spec: drop the flag or pass --transformer-impl local")
    return None


def setup_device():
    """Switch megatron-core to the CPU mode, or bind this process to its local GPU; return the torch.device."""
    import torch

    if is_cpu():
        from megatron_dppo.platform.cpu import enable_cpu_mode

        enable_cpu_mode()
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)

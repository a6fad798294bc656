"""Which device the actor runs on, decided once: CUDA with NCCL where a GPU is visible, else the CPU mode over gloo.

Nothing else in the package asks which platform it is on except through `is_cpu()` / `distributed_backend()`;
hide the GPUs (`CUDA_VISIBLE_DEVICES=""`) to run the CPU mode on a GPU machine.
"""

import os


def is_cpu() -> bool:
    import torch  # here, not at the top: platform.network must stay importable without torch (argument parsing)

    return not torch.cuda.is_available()


def distributed_backend() -> str:
    return "gloo" if is_cpu() else "nccl"


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

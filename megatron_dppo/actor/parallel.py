"""Start torch.distributed and megatron-core's parallel state for a TP x PP x DP layout."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dppo.errors import require_torchrun
from megatron_dppo.platform import distributed_backend, is_cpu, setup_device
from megatron_dppo.platform.network import GLOO_INTERFACE_VARIABLE, gloo_interface


def init_parallel(tp_size: int = 1, pp_size: int = 1, seed: int = 1234, timeout_s: float = 600) -> torch.device:
    """Initialise the default process group (from torchrun's environment) and Megatron's TP/PP/DP groups.
    `timeout_s`: how long a collective may wait for a rank (the trainer passes --distributed-timeout-minutes).

    Returns this rank's device. Weight initialisation draws from the seeded CPU generator on every rank, so a
    randomly initialised model is the same whatever the TP/PP layout."""
    if not dist.is_initialized():
        require_torchrun()
        bind_gloo_across_nodes()
    device = setup_device()
    if not dist.is_initialized():
        dist.init_process_group(backend=distributed_backend(), timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % (tp_size * pp_size):
        raise ValueError(
            f"world size {world} is not a multiple of tensor parallel size {tp_size} x pipeline parallel size "
            f"{pp_size}: launch a multiple of {tp_size * pp_size} processes or change the parallel sizes"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                                 pipeline_model_parallel_size=pp_size)
    torch.manual_seed(seed)
    if not is_cpu():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return device


def bind_gloo_across_nodes() -> None:
    """A run over several nodes: every gloo group of this process (the CPU's default group, Megatron's gloo groups,
    the weight-sync group) binds the interface the other nodes reach, where torch would bind the address this host's
    name resolves to and that is loopback (Debian's 127.0.1.1): see platform/network.py."""
    local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's processes on this node
    if local is None or local == os.environ.get("WORLD_SIZE"):
        return  # one node: loopback serves
    interface = gloo_interface(os.environ.get("MASTER_ADDR", "127.0.0.1"), members_elsewhere=True)
    if interface is not None:
        os.environ[GLOO_INTERFACE_VARIABLE] = interface
        if os.environ.get("LOCAL_RANK") == "0":
            print(f"{os.uname().nodename}: the host name resolves to loopback, so gloo binds {interface}, the "
                  f"interface the other nodes reach ({GLOO_INTERFACE_VARIABLE} picks another)", flush=True)


def destroy_parallel() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

"""Every tensor collective of the package goes through here, and each tensor's device is checked against the
backend of its group before anything is sent.

    caller ─► broadcast | all_gather | all_reduce | send | recv (group, tensors, what they are)
           ─► check_devices: an NCCL group carries CUDA tensors, a gloo group host tensors; any other tensor raises
              CollectiveDeviceError naming it, its device, the group's backend and the fix
           ─► torch.distributed

Why: NCCL refuses a host tensor only when the collective runs, on a GPU machine and deep into a run (the first weight
sync after the checkpoint loaded, the first D3S step); gloo takes CUDA tensors for some collectives only, through
hidden host copies. On a CPU machine neither mistake fails. Checked here, a CPU test that hands a group the wrong
device fails as the GPU run would.

Invariants:
- a group's backend is the one its ProcessGroup reports (`ProcessGroup.name()`), so a group declared NCCL is held
  to NCCL's rule on any machine (tests/test_collectives.py declares one on the CPU);
- `collective_device(backend)` is the one answer to "where must this group's tensors be": callers move their tensors
  there (the weight syncer, D3S's gather) rather than guess;
- object collectives (broadcast_object_list, all_gather_object) and barriers carry no tensor of ours (torch puts
  their buffers where the backend needs them), so they are called on torch.distributed directly.
"""

import torch
import torch.distributed as dist

# The device type each backend's collectives take; the package speaks these two.
BACKEND_DEVICES = {"nccl": "cuda", "gloo": "cpu"}


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a collective whose backend cannot carry its device."""


def group_backend(group=None) -> str:
    """The backend of `group` (None: the default group), as its ProcessGroup reports it."""
    return (group if group is not None else dist.group.WORLD).name()


def backend_device_type(backend: str) -> str:
    """The device type a `backend` group carries: "cuda" for NCCL, "cpu" for gloo."""
    if backend not in BACKEND_DEVICES:
        raise CollectiveDeviceError(f"process group backend {backend!r}: megatron_dppo runs its collectives over "
                                    f"{' or '.join(BACKEND_DEVICES)}")
    return BACKEND_DEVICES[backend]


def collective_device(backend: str) -> torch.device:
    """Where a `backend` group's tensors must be: this process's CUDA device for NCCL, the host for gloo."""
    if backend_device_type(backend) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_devices(group, tensors: list[torch.Tensor], what: str) -> None:
    """Raise CollectiveDeviceError if a tensor is not on the device type `group`'s backend carries."""
    backend = group_backend(group)
    wanted = backend_device_type(backend)
    for index, tensor in enumerate(tensors):
        if tensor.device.type != wanted:
            part = what if len(tensors) == 1 else f"{what} (tensor {index} of {len(tensors)})"
            raise CollectiveDeviceError(
                f"{part}, shape {tuple(tensor.shape)} {tensor.dtype}, is on {tensor.device}, but its group's backend "
                f"is {backend}, which carries {wanted} tensors only: move it there first "
                f"(tensor.to(megatron_dppo.platform.collectives.collective_device({backend!r})))")


def broadcast(group, tensor: torch.Tensor, root: int, what: str):
    """`group.broadcast(tensor, root)`, root a rank of the group; returns the Work (wait on it)."""
    check_devices(group, [tensor], what)
    return group.broadcast(tensor, root)  # the list form of ProcessGroup.broadcast raises in torch 2.13


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group, what: str) -> None:
    check_devices(group, [*outputs, tensor], what)
    dist.all_gather(outputs, tensor, group=group)


def all_reduce(tensor: torch.Tensor, op, group, what: str) -> None:
    check_devices(group, [tensor], what)
    dist.all_reduce(tensor, op=op, group=group)


def send(tensor: torch.Tensor, dst: int, group, what: str) -> None:
    """dist.send to global rank `dst`."""
    check_devices(group, [tensor], what)
    dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group, what: str) -> None:
    """dist.recv from global rank `src`."""
    check_devices(group, [tensor], what)
    dist.recv(tensor, src=src, group=group)

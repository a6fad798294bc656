"""Every collective checks each tensor's device against its group's backend, and every caller hands it the device
that backend carries: NCCL CUDA tensors, gloo host tensors.

On this CPU machine NCCL cannot run, so its rule is checked on a group *declared* NCCL: torch's own ProcessGroup
whose backend type is NCCL and which has no communicator behind it (it reports "nccl" as a GPU's NCCL group does; a
collective that reached it would fail on its missing backend, never pass).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron_dppo.launch.arguments import parse_args


def declared_group(backend: ProcessGroup.BackendType, size: int = 2) -> ProcessGroup:
    group = ProcessGroup(dist.HashStore(), 0, size)
    group._set_default_backend(backend)
    return group


def test_embedded_engine_syncs_over_gloo_where_the_trainer_runs_nccl(monkeypatch, tmp_path):
    """The embedded engine holds its model in host memory, so its weight-sync group is gloo on a CUDA machine too
    (whose trainer runs NCCL there): an NCCL group would be handed host tensors."""
    from megatron_dppo.launch import run
    from megatron_dppo.rollout import launcher

    monkeypatch.setattr(run, "is_cpu", lambda: False)  # a CUDA machine, whose trainer runs NCCL
    monkeypatch.setattr(launcher, "launch_embedded_engine",
                        lambda model_dir, **options: launcher.ServerHandle("http://127.0.0.1:9"))
    _, _, syncer = run.start_rollout(parse_args([]), tmp_path, synced_weights=lambda: iter(()))
    assert syncer.backend == "gloo"


def test_the_check_refuses_a_host_tensor_on_an_nccl_group_and_a_device_tensor_on_a_gloo_group():
    from megatron_dppo.platform.collectives import CollectiveDeviceError, all_gather, broadcast

    nccl = declared_group(ProcessGroup.BackendType.NCCL)
    with pytest.raises(CollectiveDeviceError, match=r"weight bucket a \.\. b, shape \(8,\) torch.uint8, is on cpu, "
                                                    r"but its group's backend is nccl, which carries cuda tensors "
                                                    r"only: move it there first \(tensor.to\(.*collective_device"
                                                    r"\('nccl'\)\)\)"):
        broadcast(nccl, torch.zeros(8, dtype=torch.uint8), 0, "weight bucket a .. b")
    gloo = declared_group(ProcessGroup.BackendType.GLOO)
    with pytest.raises(CollectiveDeviceError, match=r"D3S token values \(tensor 1 of 3\), shape \(4,\) "
                                                    r"torch.float32, is on meta, but its group's backend is gloo, "
                                                    r"which carries cpu tensors only"):
        all_gather([torch.zeros(4), torch.zeros(4, device="meta")], torch.zeros(4), gloo, "D3S token values")


def test_embedded_engine_refuses_an_nccl_weight_group_before_joining():
    from megatron_dppo.servers.embedded.prefix_cache import PrefixCache
    from megatron_dppo.servers.embedded.request_parser import RequestError
    from megatron_dppo.servers.embedded.weights import WeightUpdates

    weights = WeightUpdates(model=None, prefix_cache=PrefixCache(0))  # joining reads no model
    with pytest.raises(RequestError, match="holds its model in host memory, which only a gloo group carries"):
        weights.join_group({"backend": "nccl", "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                           "world_size": 2, "group_name": "g"})
    assert weights.groups == {}

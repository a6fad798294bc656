"""Stream a live TP/PP-sharded Megatron model as HF-named full tensors on one rank (weight sync, export).

    gather TP shards (all-gather in the owning stage's TP group) → merge with the convert/ table
    → send to the source rank over the PP group (stages > 0) → yield (hf_name, tensor) there

The source rank is TP 0 / PP 0 / DP 0. Every rank of data-parallel replica 0 must iterate the generator to the end
(it runs collectives); other data-parallel replicas hold the same weights and return at once. The order is fixed:
stage by stage, parameters in `named_parameters()` order, so a receiver can follow it.
"""

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dppo.actor.model import global_parameter_name
from megatron_dppo.convert.mapping import find_row, hf_names_of
from megatron_dppo.platform import collectives


def is_export_source() -> bool:
    """The rank that receives the full HF tensors: TP rank 0, PP rank 0, DP rank 0."""
    return (parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_pipeline_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def _gather_tp(tensor: torch.Tensor, dim: int | None) -> list[torch.Tensor]:
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if dim is None or tp_size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(tp_size)]
    collectives.all_gather(shards, tensor.contiguous(), parallel_state.get_tensor_model_parallel_group(),
                           "a tensor-parallel shard of the weights")
    return shards


def _stage_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(global Megatron name, parameter) of this stage, without a tied output layer (its twin is the embedding)."""
    entries = []
    for local_name, param in model.named_parameters():
        name = global_parameter_name(model, local_name)
        if name == "output_layer.weight" and model.shape.tie_word_embeddings:
            continue
        entries.append((name, param))
    return entries


def _hf_manifest(model, entries) -> list[tuple[str, list[tuple[str, tuple, torch.dtype]]]]:
    """Per Megatron parameter, the HF tensors it becomes, with shapes: merged from meta tensors, no data moved."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    manifest = []
    for name, param in entries:
        row, layer = find_row(name, model.shape)
        shards = [torch.empty(param.shape, dtype=param.dtype, device="meta")] * (
            1 if row.layout.tp_dim is None else tp_size)
        merged = row.layout.merge(hf_names_of(row, layer), shards, model.shape)
        manifest.append((name, [(hf_name, tuple(t.shape), t.dtype) for hf_name, t in merged]))
    return manifest


@torch.no_grad()
def iter_hf_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every HF tensor of the model on the export source rank (see the module docstring)."""
    if parallel_state.get_data_parallel_rank() != 0:
        return
    shape = model.shape
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    entries = _stage_parameters(model)
    params = dict(entries)
    manifests = [_hf_manifest(model, entries)]
    if pp_size > 1:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(pp_group)
        manifests = [None] * pp_size
        dist.all_gather_object(manifests, _hf_manifest(model, entries), group=pp_group)
    for stage, manifest in enumerate(manifests):
        for name, hf_tensors in manifest:
            if stage == pp_rank:
                row, layer = find_row(name, shape)
                merged = row.layout.merge(hf_names_of(row, layer), _gather_tp(params[name], row.layout.tp_dim), shape)
                if tp_rank == 0 and stage != 0:
                    for _, tensor in merged:
                        collectives.send(tensor.contiguous(), pp_ranks[0], pp_group, "a pipeline stage's weight")
            elif pp_rank == 0 and tp_rank == 0:
                merged = []
                for hf_name, tensor_shape, dtype in hf_tensors:
                    tensor = torch.empty(tensor_shape, dtype=dtype, device=next(iter(params.values())).device)
                    collectives.recv(tensor, pp_ranks[stage], pp_group, f"weight {hf_name} of stage {stage}")
                    merged.append((hf_name, tensor))
            if pp_rank == 0 and tp_rank == 0:
                yield from merged

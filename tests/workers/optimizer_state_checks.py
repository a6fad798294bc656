"""Load two training checkpoints into the actor and compare what they restore, tensor for tensor, in memory.

Usage: torchrun --nproc-per-node N optimizer_state_checks.py --first DIR --second DIR --dtype bf16|fp16 --tp T
       [--use-distributed-optimizer]
       torchrun --nproc-per-node 1 optimizer_state_checks.py --step-count-layouts

The restored state is what a resume trains on (Actor.restorable_state): the model's weights, each parameter's
optimizer state as the torch optimizer holds it (fp32 main parameter, Adam moments, torch Adam's per-parameter step
count), the per-group step count where the optimizer keeps one (TE's and Apex's FusedAdam) and the loss scaler.
Comparing it here, rather than the files, leaves out what a checkpoint stores but never restores: the distributed
optimizer writes its flat buffers with the alignment gaps between parameters filled from uninitialised memory. Prints
`CHECK restored_state_equal ok <tensors>` on rank 0; any difference raises, naming it.

--step-count-layouts: a tiny bf16 actor with the distributed optimizer takes one step on the CPU; its restored state
must hold torch Adam's per-parameter step counts and, once its optimizer's state is laid out as TE's and Apex's
FusedAdam keep it (the count moved from each parameter's state into `param_groups[i]['step']`; neither imports
without CUDA), the per-group counts instead; a copy that lost or reset either must be named by
restored_state_differences. Prints `CHECK step_count_layouts ok`.
"""

import argparse

import torch
import torch.distributed as dist


def restored_state(checkpoint: str, args) -> dict[str, torch.Tensor]:
    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.checkpoint import read_hf_config, resolve_checkpoint
    from megatron_dppo.convert.mapping import model_shape

    path = resolve_checkpoint(checkpoint)
    optim = OptimConfig(use_distributed_optimizer=args.use_distributed_optimizer)
    actor = Actor(model_shape(read_hf_config(path)), args.tp, 1, args.dtype, optim)
    actor.load_sharded(path, with_optimizer=True)
    return actor.restorable_state()


def restored_state_differences(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[str]:
    """What differs between two restored states, bit for bit: a tensor one of them lacks (a step count a resume lost,
    per parameter or per group), or one whose dtype or values differ; and whether the first restores any Adam moment
    and any step count at all (a comparison of two empty optimizers proves nothing)."""
    problems = [f"{name} missing from the {'second' if name in first else 'first'}"
                for name in sorted(set(first) ^ set(second))]
    problems += [f"{name} differs" for name in sorted(set(first) & set(second))
                 if not (first[name].dtype == second[name].dtype and torch.equal(first[name], second[name]))]
    if not any(".exp_avg" in name for name in first):
        problems.append("no Adam moments were restored")
    if not any(name.endswith(".step") for name in first):
        problems.append("no Adam step count was restored (torch Adam's per parameter or FusedAdam's per group)")
    return problems


def one_step_actor():
    """A tiny bf16 actor with the distributed optimizer, after one optimizer step on one packed sequence."""
    from types import SimpleNamespace

    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.step import next_token_targets
    from megatron_dppo.convert.mapping import model_shape
    from megatron_dppo.convert.tiny import tiny_hf_config

    shape = model_shape(tiny_hf_config("qwen3", head_dim=16).to_dict())
    actor = Actor(shape, 1, 1, "bf16", OptimConfig(lr=1e-3, use_distributed_optimizer=True))
    tokens = torch.randint(0, shape.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    batch = SimpleNamespace(tokens=tokens, cu_seqlens=torch.tensor([0, 32], dtype=torch.int32), max_seqlen=32)

    def loss_fn(micro_batch, output):
        logprobs, _ = output.logprobs(next_token_targets(micro_batch))
        return -logprobs.float().mean(), {}

    grad_norm, _ = actor.train_step([batch], loss_fn)
    assert grad_norm is not None and grad_norm > 0, grad_norm
    return actor


def lost(state: dict[str, torch.Tensor], name: str, value: float | None) -> dict[str, torch.Tensor]:
    """`state` with the tensor `name` dropped (value None) or set to `value`: a resume that lost it."""
    changed = {key: tensor for key, tensor in state.items() if key != name or value is not None}
    if value is not None:
        changed[name] = torch.full_like(state[name], value)
    return changed


def check_step_count_layouts() -> None:
    actor = one_step_actor()
    state = actor.restorable_state()
    per_param = sorted(name for name in state if name.endswith(".step") and ".param" in name)
    assert per_param and all(state[name].item() == 1 for name in per_param), per_param
    assert not any(name.endswith(".step") and ".param" not in name for name in state), "a group count beside torch's"
    for value in (None, 0.0):
        problems = restored_state_differences(state, lost(state, per_param[0], value))
        assert problems and per_param[0] in problems[0], problems

    adam = actor._megatron_optimizers()[0].optimizer  # FusedAdam's layout: the count per group, none per parameter
    stepped = [index for index, group in enumerate(adam.param_groups) if group["params"]]
    for index in stepped:
        group = adam.param_groups[index]
        group["step"] = int(max(adam.state[param].pop("step").item() for param in group["params"]))
    fused = actor.restorable_state()
    groups = sorted(name for name in fused if name.endswith(".step"))
    assert groups == [f"optimizer0.group{index}.step" for index in stepped], groups
    assert all(fused[name].item() == 1 for name in groups), groups
    for value in (None, 0.0):
        problems = restored_state_differences(fused, lost(fused, groups[0], value))
        assert problems and groups[0] in problems[0], problems
    assert restored_state_differences(fused, dict(fused)) == []
    print("CHECK step_count_layouts ok", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-count-layouts", action="store_true")
    parser.add_argument("--first")
    parser.add_argument("--second")
    parser.add_argument("--dtype")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from megatron_dppo.actor.parallel import destroy_parallel, init_parallel

    init_parallel(args.tp, 1)
    if args.step_count_layouts:
        check_step_count_layouts()
        destroy_parallel()
        return
    first, second = restored_state(args.first, args), restored_state(args.second, args)
    problems = restored_state_differences(first, second)
    assert not problems, f"rank {dist.get_rank()}, {args.second} against {args.first}: {'; '.join(problems)}"
    if dist.get_rank() == 0:
        print(f"CHECK restored_state_equal ok {len(first)} tensors", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()

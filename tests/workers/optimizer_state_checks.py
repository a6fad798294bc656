"""Load two training checkpoints into the actor and compare what they restore, tensor for tensor, in memory.

Usage: torchrun --nproc-per-node N optimizer_state_checks.py --first DIR --second DIR --dtype bf16|fp16 --tp T
       [--use-distributed-optimizer]

The restored state is what a resume trains on (Actor.restorable_state): the model's weights, each parameter's
optimizer state as the torch optimizer holds it (fp32 main parameter, Adam moments, step count) and the loss scaler.
Comparing it here, rather than the files, leaves out what a checkpoint stores but never restores: the distributed
optimizer writes its flat buffers with the alignment gaps between parameters filled from uninitialised memory. Prints
`CHECK restored_state_equal ok <tensors>` on rank 0; any difference raises, naming it.
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--first", required=True)
    parser.add_argument("--second", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from megatron_dppo.actor.parallel import destroy_parallel, init_parallel

    init_parallel(args.tp, 1)
    first, second = restored_state(args.first, args), restored_state(args.second, args)
    assert first.keys() == second.keys(), sorted(set(first) ^ set(second))
    for name in first:
        assert first[name].dtype == second[name].dtype and torch.equal(first[name], second[name]), (
            f"rank {dist.get_rank()}: {name} differs between {args.first} and {args.second}")
    assert any(".exp_avg" in name for name in first), "no Adam moments were restored"
    if dist.get_rank() == 0:
        print(f"CHECK restored_state_equal ok {len(first)} tensors", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()

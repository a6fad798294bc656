"""Multi-process checks of the conversion tools: the trainer's side of a checkpoint, run under torchrun.

Usage: torchrun --nproc-per-node 2 convert_checks.py --models DIR --tp T --pp P --checks a,b
    [--converted DIR (a converter save dir of the qwen3 model)] [--save-trainer DIR] [--megatron-save DIR]
Each passing check prints `CHECK <name> ok <details>`; any failure raises.
"""


import torch
import torch.distributed as dist

from tests.workers.common import log, run_checks

LR, ADAM_EPS = 1e-2, 1e-3  # a step large enough to change every weight in fp32



def hf_state(model_dir):
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint

    checkpoint = HFCheckpoint(model_dir)
    return {name: checkpoint.read(name) for name in checkpoint.names()}


def build(model_dir, tp, pp):
    from megatron.core import parallel_state

    from megatron_dppo.actor.model import build_gpt_model, build_transformer_config, load_hf_weights
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    checkpoint = HFCheckpoint(model_dir)
    model = build_gpt_model(checkpoint.shape, build_transformer_config(checkpoint.shape, tp, pp))
    load_hf_weights(model, checkpoint)
    return model, checkpoint


def check_trainer_loads_converted(args):
    """The converter's checkpoint (written under another TP/PP) loads through the trainer's load_sharded into this
    layout, and the loaded weights are bit-identical to the HF model it was converted from."""
    from megatron_dppo.actor.checkpoint import load_module_state, load_sharded
    from megatron_dppo.actor.export import iter_hf_tensors

    model, _ = build(f"{args.models}/qwen3", args.tp, args.pp)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()  # whatever passes below came from the checkpoint
    state = load_sharded(args.converted, {"model": model.sharded_state_dict()})
    load_module_state(model, state["model"])
    loaded = dict(iter_hf_tensors(model))
    if loaded:
        original = hf_state(f"{args.models}/qwen3")
        assert set(loaded) == set(original), set(loaded) ^ set(original)
        for name, tensor in loaded.items():
            assert torch.equal(tensor, original[name]), f"{name} differs after loading the converted checkpoint"
        log(f"CHECK trainer_loads_converted ok tp={args.tp} pp={args.pp} {len(loaded)} tensors bit-identical")


def check_trainer_checkpoint(args):
    """One optimizer step of the trainer's Actor on the qwen2 model, saved with the trainer's save_checkpoint (model,
    optimizer and trainer state, as the trainer saves them); the HF view of the trained weights is kept next to it
    for the export test."""
    from megatron.core import parallel_state

    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.checkpoint import save_checkpoint
    from megatron_dppo.actor.step import next_token_targets
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
    from tests.workers.actor_checks import packed_batch, random_sequences

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    checkpoint = HFCheckpoint(f"{args.models}/qwen2")
    vocab = checkpoint.shape.vocab_size
    actor = Actor(checkpoint.shape, args.tp, args.pp, "fp32", OptimConfig(lr=LR, adam_eps=ADAM_EPS),
                  hf_checkpoint=checkpoint)

    def loss_fn(micro_batch, output):
        logprobs, _ = output.logprobs(next_token_targets(micro_batch))
        return -logprobs.sum() / logprobs.numel(), {}

    actor.train_step([packed_batch(random_sequences([7, 4, 10, 6], vocab, seed=5))], loss_fn)
    save_checkpoint(args.save_trainer, 1, actor.sharded_state_dict(), checkpoint.config, trainer_state={"step": 1})
    trained = dict(actor.hf_tensors())
    if trained:
        original = hf_state(f"{args.models}/qwen2")
        changed = sum(not torch.equal(trained[name], original[name]) for name in original)
        assert changed == len(original), f"only {changed} of {len(original)} tensors changed in the optimizer step"
        torch.save(trained, f"{args.save_trainer}/trained_hf_state.pt")
        log(f"CHECK trainer_checkpoint ok tp={args.tp} pp={args.pp} {changed} tensors trained and saved")
    dist.barrier()


def check_megatron_save(args):
    """Megatron's own `dist_checkpointing.save` of the qwen2 model (HF weights loaded into a real model of this
    layout), the reference the streaming converter's files are compared with."""
    from pathlib import Path

    from megatron.core import dist_checkpointing

    model, _ = build(f"{args.models}/qwen2", args.tp, args.pp)
    if dist.get_rank() == 0:
        Path(args.megatron_save).mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, args.megatron_save)
    log(f"CHECK megatron_save ok tp={args.tp} pp={args.pp}")


def te_style_layer_spec(shape, transformer_impl="local"):
    """The CPU layer spec, with core attention carrying `_extra_state` as Transformer Engine's DotProductAttention
    does (its FP8 metadata): a checkpoint written by the converter (local spec) has no such key."""
    from dataclasses import replace

    from megatron_dppo.actor.model import SDPACoreAttention, local_layer_spec

    class ExtraStateCoreAttention(SDPACoreAttention):
        def get_extra_state(self) -> torch.Tensor:
            return torch.empty(0, dtype=torch.uint8)  # what TE returns without FP8

        def set_extra_state(self, state) -> None:
            self.restored_extra_state = state

    spec = local_layer_spec(shape)
    attention = spec.submodules.self_attention
    submodules = replace(attention.submodules, core_attention=ExtraStateCoreAttention)
    return replace(spec, submodules=replace(spec.submodules, self_attention=replace(attention, submodules=submodules)))


def check_converted_loads_into_extra_state_model(args):
    """The trainer's Actor.load_sharded loads the converter's checkpoint into a model whose attention carries
    Transformer Engine style `_extra_state` (absent from the checkpoint) with weights bit-identical to the HF model;
    a model needing a tensor the checkpoint truly lacks (an untied output layer) fails naming that key."""
    import dataclasses

    import pytest

    from megatron_dppo.actor import model as model_module
    from megatron_dppo.actor.actor import Actor, OptimConfig
    from megatron_dppo.actor.export import iter_hf_tensors
    from megatron_dppo.convert.hf_checkpoint import HFCheckpoint

    shape = HFCheckpoint(f"{args.models}/qwen3").shape
    default_spec, model_module.layer_spec = model_module.layer_spec, te_style_layer_spec  # for this Actor only
    try:
        actor = Actor(shape, args.tp, args.pp, "fp32", OptimConfig())
    finally:
        model_module.layer_spec = default_spec
    extra_state_keys = [key for key in actor.model.state_dict() if key.endswith("core_attention._extra_state")]
    assert extra_state_keys, "the TE-style spec must give core attention an _extra_state"
    actor.load_sharded(args.converted, with_optimizer=False)
    loaded = dict(iter_hf_tensors(actor.model))
    if loaded:
        original = hf_state(f"{args.models}/qwen3")
        assert set(loaded) == set(original), set(loaded) ^ set(original)
        for name, tensor in loaded.items():
            assert torch.equal(tensor, original[name]), f"{name} differs after loading into the TE-style model"

    untied = Actor(dataclasses.replace(shape, tie_word_embeddings=False), args.tp, args.pp, "fp32", OptimConfig())
    with pytest.raises(KeyError, match="output_layer.weight") as error:
        untied.load_sharded(args.converted, with_optimizer=False)
    assert "damaged" not in str(error.value), error.value
    log(f"CHECK converted_loads_into_extra_state_model ok tp={args.tp} pp={args.pp} {len(extra_state_keys)} "
        f"_extra_state keys tolerated; missing key named: {str(error.value)[:120]}")


CHECKS = {"converted_loads_into_extra_state_model": check_converted_loads_into_extra_state_model,
          "trainer_loads_converted": check_trainer_loads_converted, "trainer_checkpoint": check_trainer_checkpoint,
          "megatron_save": check_megatron_save}


def main():
    run_checks(CHECKS, ("--converted", "--save-trainer", "--megatron-save"))


if __name__ == "__main__":
    main()

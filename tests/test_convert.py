"""The HF <-> Megatron tables: bit-exact shard/merge round trips, slice-only reads, and clear errors."""

import json
import shutil

import pytest
import torch

from megatron_dppo.convert.hf_checkpoint import HFCheckpoint
from megatron_dppo.convert.mapping import expected_hf_names, model_shape, padded_vocab_size, parameter_rows


def shard_and_merge(checkpoint: HFCheckpoint, tp_size: int):
    """Every Megatron parameter built per TP rank from HF slices, then merged back to HF tensors."""
    shape = checkpoint.shape
    padded = padded_vocab_size(shape.vocab_size, tp_size)
    rebuilt = {}
    for row in parameter_rows(shape):
        for layer in (range(shape.num_layers) if "{i}" in row.megatron else [None]):
            names = tuple(n.format(i=layer) for n in row.hf)
            shards = [row.layout.shard(names, checkpoint.read, shape, rank, tp_size, padded, checkpoint.tensor_shape)
                      for rank in range(tp_size)]
            if row.layout.tp_dim is None:
                assert all(torch.equal(s, shards[0]) for s in shards)
            rebuilt.update(row.layout.merge(names, shards, shape))
    return rebuilt


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_shard_then_merge_round_trips_every_hf_tensor_bit_exactly(tiny_models, arch, tp_size):
    checkpoint = HFCheckpoint(tiny_models / arch)
    rebuilt = shard_and_merge(checkpoint, tp_size)
    assert sorted(rebuilt) == sorted(expected_hf_names(checkpoint.shape))
    assert set(rebuilt) == set(checkpoint.names())
    for name, tensor in rebuilt.items():
        assert torch.equal(tensor, checkpoint.read(name)), name


def test_each_tp_rank_reads_only_its_slices(tiny_models):
    checkpoint = HFCheckpoint(tiny_models / "qwen2")
    shape, tp_size = checkpoint.shape, 2
    read_elements = [0] * tp_size
    for rank in range(tp_size):
        def counting_read(name, dim=None, start=None, stop=None, rank=rank):
            tensor = checkpoint.read(name, dim, start, stop)
            read_elements[rank] += tensor.numel()
            return tensor

        for row in parameter_rows(shape):
            for layer in (range(shape.num_layers) if "{i}" in row.megatron else [None]):
                names = tuple(n.format(i=layer) for n in row.hf)
                row.layout.shard(names, counting_read, shape, rank, tp_size,
                                 padded_vocab_size(shape.vocab_size, tp_size), checkpoint.tensor_shape)
    total = sum(checkpoint.read(name).numel() for name in checkpoint.names())
    replicated = sum(checkpoint.read(name).numel() for name in checkpoint.names() if "norm" in name)
    # Every element of a split tensor is read by exactly one rank; only the small replicated norms by all.
    assert sum(read_elements) == total - replicated + tp_size * replicated
    assert max(read_elements) < 0.6 * total


def test_sharded_checkpoint_with_index_reads_like_a_single_file(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models / "qwen2")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single, sharded = HFCheckpoint(tiny_models / "qwen2"), HFCheckpoint(tmp_path / "sharded")
    assert len({*json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
                .values()}) > 1
    for name in single.names():
        assert torch.equal(single.read(name, 0, 1, 3), sharded.read(name, 0, 1, 3))


def test_missing_shard_named_in_index_is_a_clear_error(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_models / "qwen2").save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {victim}.*missing"):
        HFCheckpoint(tmp_path)


def test_unsupported_architecture_lists_supported_ones(tiny_models, tmp_path):
    shutil.copytree(tiny_models / "qwen2", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*mistral.*Supported: qwen2.*qwen3.*llama"):
        HFCheckpoint(tmp_path / "m")


def test_tp_size_that_does_not_divide_heads_or_groups_is_a_clear_error(tiny_models):
    shape = HFCheckpoint(tiny_models / "qwen2").shape  # 4 heads, 2 kv groups
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide num_attention_heads=4"):
        shape.check_parallel(3)
    with pytest.raises(ValueError, match=r"size 4 does not divide num_key_value_heads \(query groups\)=2"):
        shape.check_parallel(4)
    with pytest.raises(ValueError, match="pipeline parallel size 3 does not divide num_hidden_layers=2"):
        shape.check_parallel(1, 3)


def test_llama3_rope_scaling_matches_transformers(tiny_models):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_dppo.actor.model import llama3_inv_freq

    config = json.loads((tiny_models / "llama" / "config.json").read_text())
    shape = model_shape(config)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(tiny_models / "llama"), "cpu")
    assert torch.allclose(llama3_inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling), expected, rtol=1e-6)


def test_padded_vocab_is_the_same_for_tp_1_2_4_so_checkpoints_reshard():
    assert {padded_vocab_size(151936, tp) for tp in (1, 2, 4, 8)} == {151936}
    assert {padded_vocab_size(100, tp) for tp in (1, 2, 4)} == {128}
    assert padded_vocab_size(100, 3) == 384

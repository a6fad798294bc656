"""The checkpoint conversion tools (tools/convert_*.py): round trips, trainer checkpoints, and bad input.

Everything runs on the CPU. HF → Megatron spawns tp x pp gloo ranks that stream the weights into Megatron's file
format (compared byte for byte with Megatron's own save); Megatron → HF runs in this process.
Round trips are compared bit for bit (torch.equal), never with a tolerance.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from megatron_dppo.actor.conversion import hf_to_megatron, megatron_to_hf
from megatron_dppo.convert.hf_checkpoint import INDEX_FILE, HFCheckpoint
from tests.launch import run_torchrun
from tools import convert_hf_to_megatron, convert_megatron_to_hf

WORKER = Path(__file__).parent / "workers" / "convert_checks.py"
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
SMALL_SHARD_BYTES = 60_000  # splits a tiny model (~350 kB in fp32) into several safetensors shards


@pytest.fixture(scope="module")
def hf_inputs(tiny_models, tmp_path_factory):
    """The tiny models, Qwen2 re-saved as an indexed, sharded safetensors directory (the other input form)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf_inputs")
    for arch in ("qwen3", "llama"):
        shutil.copytree(tiny_models / arch, root / arch)
    model = AutoModelForCausalLM.from_pretrained(tiny_models / "qwen2", dtype=torch.float32)
    model.save_pretrained(root / "qwen2", max_shard_size="100KB")
    assert (root / "qwen2" / INDEX_FILE).is_file()
    return root


@pytest.fixture(scope="module")
def megatron_checkpoint(hf_inputs, tmp_path_factory):
    """convert(arch, layout) → a converter save dir, made once per module."""
    root = tmp_path_factory.mktemp("megatron")
    made = {}

    def convert(arch, layout):
        if (arch, layout) not in made:
            tp, pp = LAYOUTS[layout]
            made[arch, layout] = hf_to_megatron(hf_inputs / arch, root / f"{arch}_{layout}", tp=tp, pp=pp)
        return made[arch, layout]

    return convert


def hf_state(model_dir) -> dict:
    checkpoint = HFCheckpoint(model_dir)
    return {name: checkpoint.read(name) for name in checkpoint.names()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_round_trip_hf_megatron_hf_is_bit_exact_and_loads_in_transformers(arch, layout, hf_inputs,
                                                                         megatron_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    save_dir = megatron_checkpoint(arch, layout)
    assert (save_dir / "latest").read_text() == "iter_0000000" and (save_dir / "iter_0000000" / "complete").is_file()
    out = megatron_to_hf(save_dir, tmp_path / "hf", max_shard_bytes=SMALL_SHARD_BYTES)
    assert (out / INDEX_FILE).is_file() and len(list(out.glob("model-*-of-*.safetensors"))) > 1
    original, exported = hf_state(hf_inputs / arch), hf_state(out)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == json.loads((hf_inputs / arch / "config.json").read_text())["architectures"][0]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original.get(name, original["model.embed_tokens.weight"])), name
    assert (out / "generation_config.json").is_file() and not list(tmp_path.glob(".*partial*"))


def test_megatron_to_hf_reads_an_iter_dir_and_casts_to_the_requested_dtype(megatron_checkpoint, hf_inputs, tmp_path):
    out = megatron_to_hf(megatron_checkpoint("qwen3", "pp2") / "iter_0000000", tmp_path / "hf", dtype="bf16")
    exported = load_file(out / "model.safetensors")
    for name, tensor in hf_state(hf_inputs / "qwen3").items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.fixture(scope="module")
def trainer_run(hf_inputs, megatron_checkpoint, tmp_path_factory):
    """One torchrun launch (TP=2): load the converter's PP=2 Qwen3 checkpoint through the trainer's load_sharded
    (into the CPU model, and into one whose attention carries Transformer Engine style extra state),
    save a trainer checkpoint of Qwen2 after one optimizer step of the Actor, and save the Qwen2 HF weights with
    Megatron's own dist_checkpointing.save (the reference for the streaming converter's files)."""
    root = tmp_path_factory.mktemp("trainer")
    save, megatron_save = root / "save", root / "megatron_save"
    output = run_torchrun(WORKER, 2, ["--models", hf_inputs, "--tp", 2, "--pp", 1,
                                      "--checks", "trainer_loads_converted,converted_loads_into_extra_state_model,"
                                      "trainer_checkpoint,megatron_save",
                                      "--converted", megatron_checkpoint("qwen3", "pp2"), "--save-trainer", save,
                                      "--megatron-save", megatron_save])
    return save, output, megatron_save


def test_streaming_converter_writes_the_files_megatron_save_writes(trainer_run, megatron_checkpoint):
    """HF → Megatron never builds the weights, yet at TP=2 it writes byte for byte the .distcp files, common.pt and
    metadata.json that Megatron's dist_checkpointing.save writes for a real TP=2 model holding the same HF weights,
    and a .metadata with the same tensors, chunks, file offsets and per-rank plans (only the storage_meta, which
    names the directory and a random save id, differs)."""
    _, output, reference = trainer_run
    assert "CHECK megatron_save ok tp=2 pp=1" in output, output[-6000:]
    converted = megatron_checkpoint("qwen2", "tp2") / "iter_0000000"
    files = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in converted.iterdir()) == sorted([*files, "complete", "hf_config.json"])
    assert {"__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", "common.pt", "metadata.json"} < set(files)
    for name in files:
        if name != ".metadata":
            assert (converted / name).read_bytes() == (reference / name).read_bytes(), name
    ours, theirs = (FileSystemReader(str(path)).read_metadata() for path in (converted, reference))
    assert set(vars(ours)) == set(vars(theirs)) and "all_local_plans" in vars(theirs)
    for field in vars(theirs):
        if field != "storage_meta":
            assert getattr(ours, field) == getattr(theirs, field), field


def test_converted_checkpoint_loads_through_trainer_load_under_another_layout(trainer_run):
    _, output, _ = trainer_run
    assert "CHECK trainer_loads_converted ok tp=2 pp=1" in output, output[-6000:]


def test_converted_checkpoint_loads_into_a_model_with_te_extra_state_and_a_missing_key_is_named(trainer_run):
    """Transformer Engine layers carry `_extra_state` the converter's local-spec checkpoint lacks: tolerated. A key the
    model truly needs (an untied output layer from a tied checkpoint) fails naming it, not as a damaged shard."""
    _, output, _ = trainer_run
    assert "CHECK converted_loads_into_extra_state_model ok tp=2 pp=1" in output, output[-6000:]
    assert "has no ['output_layer.weight']" in output


def test_trainer_checkpoint_exports_and_transformers_greedy_equals_embedded_engine(trainer_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dppo.data.tokenizer import SYNTHETIC_ALPHABET, CharTokenizer
    from megatron_dppo.rollout.client import RolloutClient, SamplingParams
    from megatron_dppo.rollout.launcher import launch_embedded_engine

    save, output, _ = trainer_run
    assert "CHECK trainer_checkpoint ok" in output, output[-6000:]
    tokenizer_dir = tmp_path / "tokenizer"
    CharTokenizer(SYNTHETIC_ALPHABET).save_pretrained(tokenizer_dir)
    (tokenizer_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [97, 98]}))
    out = tmp_path / "hf"
    assert convert_megatron_to_hf.main(["--megatron-dir", str(save), "--out", str(out),
                                        "--tokenizer-dir", str(tokenizer_dir)]) == 0
    trained = torch.load(save / "trained_hf_state.pt")
    exported = hf_state(out)
    assert set(exported) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name
    assert AutoTokenizer.from_pretrained(out)("12+3")["input_ids"] == CharTokenizer(SYNTHETIC_ALPHABET).encode("12+3")

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.generation_config.eos_token_id == [97, 98]  # the base model's, copied with the tokenizer
    prompts, max_new_tokens = [[5, 17, 42, 8], [99, 3], [60, 61, 62, 63, 64, 65]], 12
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                                   attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                    for p in prompts]
    with launch_embedded_engine(str(out), startup_timeout_s=120) as handle:
        completions = RolloutClient([handle.url]).generate(prompts, SamplingParams(temperature=0.0,
                                                                                  max_new_tokens=max_new_tokens))
    assert [c.output_ids for c in sorted(completions, key=lambda c: c.prompt_index)] == expected


# ---- bad input: a clear error naming the input, and nothing left behind -------------------------------------


def assert_nothing_left(parent: Path, before: set):
    assert set(parent.iterdir()) == before, set(parent.iterdir()) - before


def run_tool(tool, argv, capsys) -> str:
    assert tool.main([str(a) for a in argv]) == 1
    return capsys.readouterr().err


def test_unknown_architecture_is_rejected_by_both_tools(hf_inputs, megatron_checkpoint, tmp_path, capsys):
    bad_hf = tmp_path / "gpt2"
    shutil.copytree(hf_inputs / "llama", bad_hf)
    config = json.loads((bad_hf / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (bad_hf / "config.json").write_text(json.dumps(config))
    bad_megatron = tmp_path / "megatron_gpt2"
    shutil.copytree(megatron_checkpoint("llama", "tp1"), bad_megatron)
    (bad_megatron / "iter_0000000" / "hf_config.json").write_text(json.dumps(config))
    before = set(tmp_path.iterdir())

    error = run_tool(convert_hf_to_megatron, ["--hf-dir", bad_hf, "--out", tmp_path / "out"], capsys)
    assert "unsupported architecture" in error and "gpt2" in error and "Supported: qwen2" in error
    error = run_tool(convert_megatron_to_hf, ["--megatron-dir", bad_megatron, "--out", tmp_path / "out"], capsys)
    assert str(bad_megatron / "iter_0000000") in error and "unsupported architecture" in error
    assert_nothing_left(tmp_path, before)


def test_vocab_mismatch_is_rejected_by_both_tools(hf_inputs, megatron_checkpoint, tmp_path, capsys):
    bad_hf = tmp_path / "qwen3_vocab"
    shutil.copytree(hf_inputs / "qwen3", bad_hf)
    config = json.loads((bad_hf / "config.json").read_text())
    (bad_hf / "config.json").write_text(json.dumps({**config, "vocab_size": 96}))  # the weights have 100 rows
    bad_megatron = tmp_path / "megatron_vocab"
    shutil.copytree(megatron_checkpoint("qwen3", "pp2"), bad_megatron)
    (bad_megatron / "iter_0000000" / "hf_config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    before = set(tmp_path.iterdir())

    error = run_tool(convert_hf_to_megatron, ["--hf-dir", bad_hf, "--out", tmp_path / "out"], capsys)
    assert str(bad_hf) in error and "model.embed_tokens.weight has shape (100, 64)" in error
    assert "(96, 64)" in error
    error = run_tool(convert_megatron_to_hf, ["--megatron-dir", bad_megatron, "--out", tmp_path / "out"], capsys)
    assert str(bad_megatron) in error and "128 vocabulary rows, fewer than vocab_size=200" in error
    assert_nothing_left(tmp_path, before)


def test_missing_shard_is_rejected_by_both_tools(hf_inputs, megatron_checkpoint, tmp_path, capsys):
    bad_hf = tmp_path / "qwen2_missing"
    shutil.copytree(hf_inputs / "qwen2", bad_hf)
    missing_hf = sorted(bad_hf.glob("model-*.safetensors"))[-1]
    missing_hf.unlink()
    bad_megatron = tmp_path / "megatron_missing"
    shutil.copytree(megatron_checkpoint("qwen2", "tp2"), bad_megatron)
    (bad_megatron / "iter_0000000" / "__1_0.distcp").unlink()
    before = set(tmp_path.iterdir())

    error = run_tool(convert_hf_to_megatron, ["--hf-dir", bad_hf, "--out", tmp_path / "out"], capsys)
    assert f"shard {missing_hf.name}" in error and str(bad_hf) in error
    error = run_tool(convert_megatron_to_hf, ["--megatron-dir", bad_megatron, "--out", tmp_path / "out"], capsys)
    assert str(bad_megatron / "iter_0000000") in error and "__1_0.distcp" in error
    assert_nothing_left(tmp_path, before)


def test_tp_that_does_not_divide_the_heads_is_rejected(hf_inputs, tmp_path, capsys):
    before = set(tmp_path.iterdir())
    error = run_tool(convert_hf_to_megatron, ["--hf-dir", hf_inputs / "qwen2", "--out", tmp_path / "out",
                                              "--tp", 3], capsys)
    assert str(hf_inputs / "qwen2") in error and "--tp 3" in error and "num_attention_heads=4" in error
    assert_nothing_left(tmp_path, before)


def test_existing_output_is_never_overwritten(hf_inputs, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("user data")
    error = run_tool(convert_hf_to_megatron, ["--hf-dir", hf_inputs / "qwen2", "--out", tmp_path / "out"], capsys)
    assert "--out" in error and "already exists" in error
    assert (tmp_path / "out" / "keep.txt").read_text() == "user data"


def test_damaged_shard_found_mid_export_removes_the_partial_output(megatron_checkpoint, tmp_path, capsys):
    """The metadata is intact, so the export starts writing; the truncated data file fails it part way through."""
    bad_megatron = tmp_path / "megatron_truncated"
    shutil.copytree(megatron_checkpoint("llama", "tp1"), bad_megatron)
    data = bad_megatron / "iter_0000000" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    before = set(tmp_path.iterdir())
    error = run_tool(convert_megatron_to_hf, ["--megatron-dir", bad_megatron, "--out", tmp_path / "out"], capsys)
    assert str(bad_megatron / "iter_0000000") in error and "damaged" in error
    assert_nothing_left(tmp_path, before)

"""Models by their Hub name (megatron_dppo.hub), offline from a Hugging Face cache built on disk (tests/hub_cache.py):
every flag that names a model resolves ORG/NAME to the cached snapshot through the one resolver, and a name that is
not cached is one line naming the model, the cache and the fix."""

import os
import subprocess
import sys

import pytest

from megatron_dppo.hub import is_repo_id, resolve_model
from tests.hub_cache import hub_cache_of, place_in_hub_cache
from tests.launch import REPO_ROOT

MODEL = "tiny-org/tiny-chat"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An HF_HOME whose cache holds MODEL (the tiny chat model of tests/tiny_chat.py), offline, for this process."""
    from huggingface_hub import constants

    from tests.tiny_chat import save_tiny_chat_model

    hf_home = tmp_path / "hf_home"
    save_tiny_chat_model(tmp_path / "model")
    snapshot = place_in_hub_cache(hf_home, MODEL, tmp_path / "model")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache_of(hf_home)))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home, snapshot


def test_hub_names_are_org_slash_name_that_is_not_a_path_on_disk(tmp_path, monkeypatch):
    assert is_repo_id("Qwen/Qwen3-4B") and is_repo_id("meta-llama/Llama-3.1-8B-Instruct")
    assert not is_repo_id("Qwen3-4B") and not is_repo_id("./Qwen/Qwen3-4B") and not is_repo_id("/models/qwen")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen3-4B").mkdir(parents=True)  # a local folder of that name stays local
    assert not is_repo_id("Qwen/Qwen3-4B")
    assert resolve_model("Qwen/Qwen3-4B", "--hf-checkpoint") == (tmp_path / "Qwen" / "Qwen3-4B").relative_to(tmp_path)


def test_hf_checkpoint_evaluate_and_converter_flags_resolve_a_hub_name_offline_to_its_cached_snapshot(
        offline_hub, tmp_path):
    from megatron_dppo.launch.arguments import parse_args
    from tools import convert_hf_to_megatron, convert_megatron_to_hf, evaluate

    _, snapshot = offline_hub
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2+2?", "label": "4"}\n')
    args = parse_args(["--hf-checkpoint", MODEL, "--prompt-data", str(prompts), "--eval-prompt-data", str(prompts)])
    assert args.hf_checkpoint == str(snapshot)
    evaluation = evaluate.parse_args(["--urls", "http://127.0.0.1:1", "--tokenizer-dir", MODEL, "--output-dir", "x"])
    assert evaluation.tokenizer_dir == str(snapshot)
    assert evaluate.parse_args(["--model-dir", MODEL, "--output-dir", "x"]).model_dir == str(snapshot)

    assert convert_hf_to_megatron.main(["--hf-dir", MODEL, "--out", str(tmp_path / "megatron")]) == 0
    assert convert_megatron_to_hf.main(["--megatron-dir", str(tmp_path / "megatron"), "--out", str(tmp_path / "hf"),
                                        "--tokenizer-dir", MODEL]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (snapshot / "tokenizer.json").read_bytes()


def test_a_hub_name_missing_offline_is_one_line_naming_the_model_and_the_cache(offline_hub, tmp_path, capsys):
    from tools import convert_hf_to_megatron

    hf_home, _ = offline_hub
    cache = hub_cache_of(hf_home)
    absent = "tiny-org/absent"
    assert convert_hf_to_megatron.main(["--hf-dir", absent, "--out", str(tmp_path / "out")]) == 1
    expected = (f"--hf-dir {absent}: the Hugging Face model is not in the cache {cache} and HF_HUB_OFFLINE=1 "
                f"forbids downloading it: run `hf download {absent}` where the Hub is reachable, with the same "
                "HF_HOME (or copy its models--tiny-org--absent folder into that cache), or pass a local folder")
    assert capsys.readouterr().err.splitlines() == [f"error: {expected}"]
    # the trainer's entry point says the same in one line, exit status 2, as for any bad flag
    finished = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "pretrain_dppo.py"), "--hf-checkpoint",
                               absent], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HOME": str(hf_home),
                                   "HF_HUB_OFFLINE": "1"})
    assert finished.returncode == 2
    trainer_line = expected.replace("--hf-dir", "--hf-checkpoint")
    assert finished.stderr.splitlines()[0] == f"pretrain_dppo.py: error: {trainer_line}"


def prepare_data(tmp_path, out: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "prepare_data.py"), "--out", str(tmp_path / out),
                           *flags], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", **env})


def test_prepare_data_fetches_each_built_in_set_without_a_local_copy_from_its_public_source_as_the_local_copy_reads(
        tmp_path):
    """Offline, from a Hugging Face cache holding tiny copies of the public sources (their files, paths and field
    types): every set is written, each line names the source and its commit, and each Parquet file equals the one
    written from local copies of the same rows. Without the cache, one line names the set and the ways to get it."""
    import pyarrow.parquet as pq

    from megatron_dppo.data.datasets import DATASETS
    from megatron_dppo.data.public_sources import PUBLIC_SOURCES
    from tests.hub_cache import place_public_sources, write_local_copies

    hf_home, local = tmp_path / "hf_home", tmp_path / "local"
    place_public_sources(hf_home, tmp_path / "staging")
    write_local_copies(local)
    nowhere = str(tmp_path / "nowhere")
    from_hub = prepare_data(tmp_path, "from_hub", "--skip-bad-rows", HF_HOME=str(hf_home), DPPO_DATA_DIR=nowhere)
    assert from_hub.returncode == 0, from_hub.stderr[-3000:]
    from_local = prepare_data(tmp_path, "from_local", "--skip-bad-rows", HF_HOME=str(tmp_path / "empty"),
                              DPPO_DATA_DIR=str(local))
    assert from_local.returncode == 0, from_local.stderr[-3000:]
    hub_lines, local_lines = from_hub.stdout.splitlines(), from_local.stdout.splitlines()
    assert len(hub_lines) == len(local_lines) == len(DATASETS)
    for name, hub_line, local_line in zip(DATASETS, hub_lines, local_lines, strict=True):
        commit = next((hf_home / "hub" / f"datasets--{PUBLIC_SOURCES[name].repo_id.replace('/', '--')}" /
                       "snapshots").iterdir()).name
        assert hub_line.startswith(name) and hub_line.endswith(
            f"from https://huggingface.co/datasets/{PUBLIC_SOURCES[name].repo_id} at commit {commit})"), hub_line
        assert local_line.endswith(f"from {local / DATASETS[name].relative_path})"), local_line
        rows = pq.read_table(tmp_path / "from_hub" / f"{name}.parquet").to_pylist()
        assert rows and rows == pq.read_table(tmp_path / "from_local" / f"{name}.parquet").to_pylist(), name
    math_train = pq.read_table(tmp_path / "from_hub" / "math_train.parquet").to_pylist()
    assert [row["label"] for row in math_train] == ["0", "2", "0", "2"]  # algebra's rows, then geometry's
    assert pq.read_table(tmp_path / "from_hub" / "gsm8k_train.parquet").to_pylist()[0]["label"] == "1002"

    offline = prepare_data(tmp_path, "offline", "--sets", "aime24", HF_HOME=str(tmp_path / "empty"),
                           DPPO_DATA_DIR=nowhere)
    assert offline.returncode == 1
    assert offline.stderr.splitlines() == [
        "prepare_data.py: error: aime24 (no local copy; its public source) HuggingFaceH4/aime_2024: the Hugging Face "
        f"dataset is not in the cache {tmp_path / 'empty' / 'hub'} and HF_HUB_OFFLINE=1 forbids downloading it: run "
        "`hf download HuggingFaceH4/aime_2024 --repo-type dataset` where the Hub is reachable, with the same HF_HOME "
        "(or copy its datasets--HuggingFaceH4--aime_2024 folder into that cache), or put bench/aime24.jsonl under "
        "DPPO_DATA_DIR (docs/data_and_rewards.md lists the files)",
        "prepare_data.py: error: 1 of 1 sets not written (aime24): see their lines above"]

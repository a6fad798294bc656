import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "shared_data: reads the built-in data sets (DPPO_DATA_DIR or ../shared/data)")


def _shared_data_problem() -> tuple[bool, str] | None:
    """(skip, message) when built-in data files are missing, None when all are there. Without any data directory the
    tests that need it are skipped and say how to get it; a data directory that lacks a file fails them."""
    from megatron_dppo.data.datasets import missing_data_files
    from megatron_dppo.data.paths import data_dir, where_data_is

    missing = missing_data_files()
    if not missing:
        return None
    names = ", ".join(str(path.relative_to(data_dir())) for path in missing)
    how = ("put them there or set DPPO_DATA_DIR to the folder holding them (docs/data_and_rewards.md lists the files "
           "and their public sources)")
    return not data_dir().is_dir(), f"needs the built-in data sets, missing: {names} ({where_data_is()}); {how}"


def pytest_collection_modifyitems(config, items):
    problem = _shared_data_problem()
    if problem is None or not problem[0]:
        return
    for item in items:
        if item.get_closest_marker("shared_data"):
            item.add_marker(pytest.mark.skip(reason=problem[1]))


def pytest_runtest_setup(item):
    """A data directory with a file missing is a broken setup (CI has them all): fail with the reason, never skip."""
    if item.get_closest_marker("shared_data"):
        problem = _shared_data_problem()
        if problem is not None and not problem[0]:
            pytest.fail(problem[1], pytrace=False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random HF models saved with save_pretrained: Qwen2 (qkv bias), Qwen3 (q/k norm, head_dim 24 != hidden /
    heads, tied embeddings) and Llama 3 (llama3 rope scaling active inside the test lengths). Vocabulary 100 is not
    a multiple of 128, so vocab padding is exercised; norms and biases are perturbed away from HF's 1/0 init."""
    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config

    root = tmp_path_factory.mktemp("tiny_models")
    configs = {
        "qwen2": tiny_hf_config("qwen2", vocab_size=100),
        "qwen3": tiny_hf_config("qwen3", vocab_size=100, head_dim=24, tie_word_embeddings=True),
        "llama": tiny_hf_config("llama", vocab_size=100, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    }
    for name, config in configs.items():
        save_random_hf_model(config, root / name, seed=0, perturb_norms=0.1)
    return root

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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

"""Tiny randomly initialised HF decoder models built from a config (no downloads), for tests and the CPU default."""

from pathlib import Path

import torch

ARCH_CONFIGS = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig"}


def tiny_hf_config(architecture: str = "qwen2", vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, ffn_hidden_size: int = 128,
                   tie_word_embeddings: bool = False, max_position_embeddings: int = 512, **extra):
    """An HF config object of the given architecture and size."""
    import transformers

    if architecture not in ARCH_CONFIGS:
        raise ValueError(f"unknown architecture {architecture!r}: choose one of {sorted(ARCH_CONFIGS)}")
    config_class = getattr(transformers, ARCH_CONFIGS[architecture])
    extra.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    return config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings, **extra,
    )


def save_random_hf_model(config, out_dir: str | Path, seed: int = 0, perturb_norms: float = 0.0) -> Path:
    """Initialise an HF causal LM from `config` with `seed` and `save_pretrained` it (safetensors).

    perturb_norms > 0 adds noise of that scale to norm weights and biases (which HF initialises to 1 and 0), so that
    a mapping that mixes them up cannot pass a comparison test."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if perturb_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    param.add_(torch.randn_like(param) * perturb_norms)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir

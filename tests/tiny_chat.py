"""A tiny Hugging Face tokenizer with a chat template, and a tiny model that uses it, built locally (no downloads).

The tokenizer is the character tokenizer's vocabulary as a `PreTrainedTokenizerFast` whose post-processor adds
<bos> to every encoding that asks for special tokens, and whose chat template writes <bos> itself: a prompt
rendered by the template and then encoded with special tokens would carry two, which the tests can see.
"""

from pathlib import Path

# Qwen3's thinking switch as Qwen3's template has it: `enable_thinking` false writes an empty think block after the
# assistant's turn (the character tokenizer keeps no whitespace, so the block has none); unset, nothing changes. The
# shipped Qwen3 recipes pass it (--apply-chat-template-kwargs), and this model stands in for Qwen3 in their test.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"
)


def save_chat_tokenizer(directory: Path):
    """Save the tokenizer to `directory` and return it as transformers loads it back."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megatron_dppo.data.tokenizer import CharTokenizer

    characters = CharTokenizer.for_text()
    raw = characters.tokenizer
    raw.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", characters.bos_token_id)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def save_tiny_chat_model(directory: Path) -> None:
    """A random one-layer Qwen2 model (config.json + safetensors) with the chat tokenizer beside it."""
    from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config

    tokenizer = save_chat_tokenizer(directory)
    config = tiny_hf_config("qwen2", vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, ffn_hidden_size=64, max_position_embeddings=2048,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    save_random_hf_model(config, directory)

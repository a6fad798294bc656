"""CharTokenizer: saved in HF format, loaded by transformers and tokenizers with identical ids."""

import pytest
from tokenizers import Tokenizer

from megatron_dppo.data.datasets import load_dataset
from megatron_dppo.data.tokenizer import SYNTHETIC_ALPHABET, CharTokenizer


def test_synthetic_tokenizer_has_one_id_per_character_and_dollar_as_eos():
    tokenizer = CharTokenizer.for_synthetic_task()
    assert tokenizer.vocab_size == len(SYNTHETIC_ALPHABET) + 4
    ids = tokenizer.encode("Q:37+58-12=?A:83$")
    assert len(ids) == len("Q:37+58-12=?A:83$")
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids) == "Q:37+58-12=?A:83$"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Q:37+58-12=?A:83"
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3


@pytest.mark.shared_data
def test_saved_tokenizer_loads_offline_in_transformers_and_tokenizers_with_identical_ids(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = CharTokenizer.for_text()
    tokenizer.save_pretrained(tmp_path)
    saved_files = {path.name for path in tmp_path.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= saved_files
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    raw_tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    reloaded = CharTokenizer.from_pretrained(tmp_path)
    texts = [e.solution for e in load_dataset("math500", limit=50)] + ["  spaces\n\nand <eos> tokens<pad>"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert hf_tokenizer.encode(text, add_special_tokens=True) == ids
        assert raw_tokenizer.encode(text).ids == ids
        assert reloaded.encode(text) == ids
        assert hf_tokenizer.decode(ids) == tokenizer.decode(ids)
    assert (hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert len(hf_tokenizer) == tokenizer.vocab_size


@pytest.mark.shared_data
def test_text_without_unknown_characters_round_trips_exactly():
    tokenizer = CharTokenizer.for_text()
    for example in load_dataset("math500"):
        if not tokenizer.unknown_characters(example.solution):
            assert tokenizer.decode(tokenizer.encode(example.solution)) == example.solution


def test_unknown_characters_map_to_unk_and_are_listed():
    tokenizer = CharTokenizer.for_text()
    ids = tokenizer.encode("Janet\u2019s \u03c0")
    assert ids.count(tokenizer.unk_token_id) == 2
    assert tokenizer.unknown_characters("Janet\u2019s \u03c0") == ["\u03c0", "\u2019"]


def test_alphabet_clashing_with_a_special_token_is_a_clear_error():
    with pytest.raises(ValueError, match="must not contain a special token"):
        CharTokenizer("0123$", eos_token="$")

"""Character-level tokenizer stored in Hugging Face `tokenizers` format.

    alphabet ──► vocabulary [<pad>, <bos>, <eos>, <unk>, c1, c2, ...] ──► tokenizers.Tokenizer
             ──► save_pretrained(dir): tokenizer.json + tokenizer_config.json + special_tokens_map.json

The saved directory loads offline with `transformers.AutoTokenizer.from_pretrained(dir)` and
`tokenizers.Tokenizer.from_file(dir/tokenizer.json)`, and both give the same ids as `CharTokenizer.encode`,
because `encode` is that very `tokenizers.Tokenizer` (a BPE model with no merges is one token per character).

Unknown characters map to `<unk>` (in all three loaders alike) rather than raising: prompts from real data
(GSM8K has curly quotes, MATH has a few non-ASCII symbols) must not stop training or evaluation.
`unknown_characters(text)` lists them for callers that want to refuse such text.
Special tokens are matched in text, so a special token may be a visible character: the synthetic task uses
`$` as its end-of-sequence token, and `decode(ids)` of an answer shows it ("5+37=42#42$").
"""

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers.models import BPE

from megatron_dppo.answers import ANSWER_MARKER, END_MARKER, STEP_SEPARATOR

# the synthetic prompts ("Q:5+37=?A:") and both tasks' targets (worked steps joined by ",", "#" before the answer)
SYNTHETIC_ALPHABET = "0123456789+-=?QA:" + STEP_SEPARATOR + ANSWER_MARKER
SYNTHETIC_EOS = END_MARKER
TEXT_ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")  # printable ASCII, space, newline

_TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_TOKENS_FILE = "special_tokens_map.json"


class CharTokenizer:
    """One token per character of `alphabet`, plus pad, bos, eos and unk special tokens (ids 0-3)."""

    def __init__(
        self,
        alphabet: str,
        pad_token: str = "<pad>",
        bos_token: str = "<bos>",
        eos_token: str = "<eos>",
        unk_token: str = "<unk>",
    ):
        special_tokens = [pad_token, bos_token, eos_token, unk_token]
        if len(set(special_tokens)) != 4:
            raise ValueError(f"special tokens must be distinct, got {special_tokens}")
        characters = list(dict.fromkeys(alphabet))  # unique, in the given order
        clashes = [c for c in characters if c in special_tokens]
        if not characters or clashes:
            raise ValueError(
                f"alphabet must be non-empty and must not contain a special token; got {alphabet!r} "
                f"(clashes: {clashes})"
            )
        vocab = {token: index for index, token in enumerate(special_tokens + characters)}
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=unk_token))
        tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special_tokens])
        tokenizer.decoder = decoders.Fuse()
        self._init_from(tokenizer, pad_token, bos_token, eos_token, unk_token)

    def _init_from(self, tokenizer: Tokenizer, pad_token: str, bos_token: str, eos_token: str, unk_token: str):
        self.tokenizer = tokenizer
        self.pad_token, self.bos_token, self.eos_token, self.unk_token = pad_token, bos_token, eos_token, unk_token
        self.pad_token_id = tokenizer.token_to_id(pad_token)
        self.bos_token_id = tokenizer.token_to_id(bos_token)
        self.eos_token_id = tokenizer.token_to_id(eos_token)
        self.unk_token_id = tokenizer.token_to_id(unk_token)

    @classmethod
    def for_synthetic_task(cls) -> "CharTokenizer":
        """The embedded default: digits, + - = ? Q A : , #, and `$` as eos."""
        return cls(SYNTHETIC_ALPHABET, eos_token=SYNTHETIC_EOS)

    @classmethod
    def for_text(cls) -> "CharTokenizer":
        """Printable ASCII and newline, for MATH-style text."""
        return cls(TEXT_ALPHABET)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def save_random_model(self, out_dir: str | Path, architecture: str, seed: int = 0, **shape) -> Path:
        """A randomly initialised tiny HF model over this vocabulary (its bos/eos/pad ids), saved to `out_dir` with
        this tokenizer beside it: an HF model directory the trainer, the converter and the engines all take.
        `shape`: convert.tiny.tiny_hf_config's sizes (hidden_size, num_layers, head_dim, ...)."""
        from megatron_dppo.convert.tiny import save_random_hf_model, tiny_hf_config

        config = tiny_hf_config(architecture, vocab_size=self.vocab_size, bos_token_id=self.bos_token_id,
                                eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, **shape)
        model_dir = save_random_hf_model(config, out_dir, seed=seed)
        self.save_pretrained(model_dir)
        return model_dir

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def unknown_characters(self, text: str) -> list[str]:
        vocab = self.tokenizer.get_vocab()
        return sorted({c for c in text if c not in vocab})

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / _TOKENIZER_FILE))
        special_tokens = {
            "pad_token": self.pad_token,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_tokens,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000,
        }
        (directory / _CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (directory / _SPECIAL_TOKENS_FILE).write_text(json.dumps(special_tokens, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "CharTokenizer":
        directory = Path(directory)
        missing = [name for name in (_TOKENIZER_FILE, _CONFIG_FILE) if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} is not a saved CharTokenizer: missing {missing}")
        config = json.loads((directory / _CONFIG_FILE).read_text())
        instance = cls.__new__(cls)
        instance._init_from(
            Tokenizer.from_file(str(directory / _TOKENIZER_FILE)),
            config["pad_token"],
            config["bos_token"],
            config["eos_token"],
            config["unk_token"],
        )
        return instance

"""Tokenizers for the text datamodules: bytes, a BPE trained here, or a pretrained one.

The byte tokenizer needs no files, the BPE is trained on the training text, and the pretrained one
is a Hugging Face tokenizer from a local folder (e.g. a Qwen checkpoint's).

All three share one small interface: `encode`, `encode_batch` (many texts at once, as flat
arrays), `decode`, `vocab_size`, `eos_token_id`,
`pad_token_id`, `fingerprint` (identifies the vocabulary, for caches) and `save(folder)`.
The trained and pretrained ones are `tokenizers.Tokenizer` objects, read from and written to a
`tokenizer.json` that `transformers.AutoTokenizer` also loads. `tokenizer_state` turns any of
them into plain strings, which the text datamodules keep in every checkpoint.
"""

import hashlib
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from src.utils.errors import CheckpointError, ConfigError, MissingFileError
from src.utils.files import write_atomically

log = logging.getLogger(__name__)

TOKENIZER_KINDS = ("auto", "byte", "bpe", "pretrained")
END_OF_TEXT = "<|endoftext|>"


class ByteTokenizer:
    """Token ids 0-255 are UTF-8 bytes and 256 ends a document, so any text round-trips."""

    vocab_size = 257
    eos_token_id = 256
    pad_token_id = 256
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """(token ids back to back, one length per text) of `texts`.

        An Arrow array's UTF-8 buffer is the answer already, read without a copy.
        """
        texts = _as_large_strings(texts)
        offsets = np.frombuffer(texts.buffers()[1], np.int64)[texts.offset :][: len(texts) + 1]
        data = texts.buffers()[2]
        values = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        return values[offsets[0] : offsets[-1]], np.diff(offsets)

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special ids are dropped and broken UTF-8 shows as U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, folder: Path) -> None:
        """Nothing to save: the byte tokenizer needs no files."""


class FileTokenizer:
    """A `tokenizers.Tokenizer` with the id that ends a document (or a turn, for chat models)."""

    def __init__(self, tokenizer: Tokenizer, eos_token: str):
        eos_token_id = tokenizer.token_to_id(eos_token)
        if eos_token_id is None:
            raise ConfigError(f"The tokenizer has no token {eos_token!r} to end documents with")
        self.tokenizer = tokenizer
        self.eos_token = eos_token
        self.eos_token_id = eos_token_id
        self.pad_token_id = eos_token_id  # padding is never a target, any id does
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """(token ids back to back, one length per text), encoded in parallel by `tokenizers`."""
        if isinstance(texts, pa.Array | pa.ChunkedArray):
            texts = texts.to_pylist()
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))
        ids = itertools.chain.from_iterable(encoding.ids for encoding in encodings)
        return np.fromiter(ids, np.int64, int(lengths.sum())), lengths

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save(self, folder: Path) -> None:
        """`tokenizer.json` and the `tokenizer_config.json` naming its end-of-text token."""
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / "tokenizer.json", self.tokenizer.to_str().encode())
        config = {"eos_token": self.eos_token, "tokenizer_class": "PreTrainedTokenizerFast"}
        write_atomically(folder / "tokenizer_config.json", json.dumps(config, indent=2).encode())


def load_pretrained(folder: str | Path, eos_token: str | None = None) -> FileTokenizer:
    """The tokenizer saved in a Hugging Face model folder (`tokenizer.json`).

    It ends documents with `eos_token`, or else with the one its `tokenizer_config.json` names.
    """
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise MissingFileError(
            f"data.tokenizer.path={str(folder)!r} has no tokenizer.json. Point it at a Hugging "
            f"Face model folder that holds one (e.g. a downloaded Qwen3 checkpoint)"
        )
    if eos_token is None:
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        eos_token = config.get("eos_token")
        eos_token = eos_token.get("content") if isinstance(eos_token, dict) else eos_token
    if not eos_token:
        raise ConfigError(
            f"{folder} does not say which token ends a document: set data.tokenizer.eos_token"
        )
    return FileTokenizer(Tokenizer.from_file(str(path)), eos_token)


def train_bpe(texts: Callable[[], Iterator[str]], vocab_size: int) -> FileTokenizer:
    """A byte-level BPE (GPT-2 style: every byte is a token, merges on top) trained on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    return FileTokenizer(tokenizer, END_OF_TEXT)


def build_tokenizer(
    kind: str = "auto",
    path: str | None = None,
    vocab_size: int = 1024,
    eos_token: str | None = None,
    training_texts: Callable[[], Iterator[str]] | None = None,
    cache_dir: Path | None = None,
    cache_key: str = "",
):
    """The tokenizer `kind` names: `byte`, `bpe`, `pretrained` or `auto`.

    `bpe` is trained on `training_texts`, or loaded from the cache when the same texts trained one
    before; `pretrained` is the folder `path`; `auto` is pretrained when `path` is set, else byte.
    """
    if kind not in TOKENIZER_KINDS:
        raise ConfigError(f"data.tokenizer.kind={kind!r} is not one of {TOKENIZER_KINDS}")
    if kind == "auto":
        kind = "pretrained" if path else "byte"
    if kind == "pretrained":
        if not path:
            raise ConfigError("data.tokenizer.kind=pretrained needs data.tokenizer.path=<folder>")
        return load_pretrained(path, eos_token)
    if kind == "byte":
        return ByteTokenizer()
    if vocab_size <= 256:
        raise ConfigError(f"data.tokenizer.vocab_size={vocab_size} must exceed the 256 bytes")
    folder = None
    if cache_dir is not None:
        key = hashlib.sha256(f"{cache_key}|bpe|{vocab_size}".encode()).hexdigest()[:16]
        folder = cache_dir / f"bpe-{key}"
        if (folder / "tokenizer.json").is_file():
            return load_pretrained(folder)
    log.info("Training a BPE tokenizer with %d tokens on the training text", vocab_size)
    assert training_texts is not None, "a BPE tokenizer is trained on training_texts"
    tokenizer = train_bpe(training_texts, vocab_size)
    if folder is not None:
        tokenizer.save(folder)
    return tokenizer


def _as_large_strings(texts: list[str] | pa.Array) -> pa.LargeStringArray:
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    if not isinstance(texts, pa.Array):
        texts = pa.array(texts, pa.large_string())
    return texts.cast(pa.large_string())


def tokenizer_state(tokenizer: ByteTokenizer | FileTokenizer) -> dict[str, str]:
    """The tokenizer as plain strings, for a checkpoint (it still loads with `weights_only`)."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte"}
    return {"kind": "file", "json": tokenizer.tokenizer.to_str(), "eos_token": tokenizer.eos_token}


def tokenizer_from_state(state: dict[str, str]) -> ByteTokenizer | FileTokenizer:
    """The tokenizer that `tokenizer_state` described."""
    if state.get("kind") == "byte":
        return ByteTokenizer()
    if state.get("kind") == "file":
        return FileTokenizer(Tokenizer.from_str(state["json"]), state["eos_token"])
    raise CheckpointError(f"The checkpoint holds a tokenizer of unknown kind {state.get('kind')!r}")

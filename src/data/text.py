"""Pretraining text: local files or folders cut into documents, each trained on alone."""

import re
from pathlib import Path

import torch

from src.data.packed_text import PackedTextDataModule
from src.data.packing import Sample
from src.data.token_cache import file_fingerprint
from src.utils.errors import ConfigError, DataError, MissingFileError

# Named rules for cutting a file into documents; any other value is a regular expression.
DOCUMENT_SPLITS = {"blank_line": r"\n[ \t]*\n", "line": r"\n", "file": None}


class TextDataModule(PackedTextDataModule):
    """Documents from text files (`paths`: files, or folders whose `*.txt` files are read in
    name order), cut by `document_split`: `blank_line` (paragraphs; Tiny Shakespeare's
    speeches), `line`, `file` (one document per file) or a regular expression. Each document
    is followed by the tokenizer's end-of-text token, the last target it is trained on.

    Over-long documents are split by default: every token is trained on, and a continuation
    keeps its positions though it cannot attend to the piece before it.
    """

    default_overlong = "split"

    def __init__(self, paths: str | list[str], document_split: str = "blank_line", **options):
        super().__init__(**options)
        self.paths = [Path(p) for p in ([paths] if isinstance(paths, str | Path) else paths)]
        self.document_split = document_split
        pattern = DOCUMENT_SPLITS.get(document_split, document_split)
        try:
            self.separator = None if pattern is None else re.compile(pattern)
        except re.error as error:
            raise ConfigError(
                f"data.document_split={document_split!r} is neither one of "
                f"{list(DOCUMENT_SPLITS)} nor a regular expression ({error})"
            ) from error

    def files(self) -> list[Path]:
        found = []
        for path in self.paths:
            if path.is_dir():
                found.extend(sorted(path.glob("*.txt")))
            elif path.is_file():
                found.append(path)
            else:
                raise MissingFileError(f"data.paths: {str(path)!r} is neither a file nor a folder")
        if not found:
            raise DataError(f"data.paths={[str(p) for p in self.paths]} holds no .txt files")
        return found

    def load_documents(self) -> list[str]:
        documents = []
        for path in self.files():
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path} is not UTF-8 text ({error})") from error
            pieces = [text] if self.separator is None else self.separator.split(text)
            documents.extend(piece.strip() for piece in pieces if piece.strip())
        if not documents:
            raise DataError(f"{[str(p) for p in self.paths]} contain no text")
        return documents

    def tokenize(self, document: str) -> Sample:
        tokens = torch.tensor(self.tokenizer.encode(document) + [self.tokenizer.eos_token_id])
        return Sample(tokens, torch.ones(len(tokens), dtype=torch.bool))

    def document_text(self, document: str) -> str:
        return document

    def source_fingerprint(self) -> str:
        return f"text|{file_fingerprint(self.files())}|{self.document_split}"

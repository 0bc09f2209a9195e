"""Byte-level language modelling on one text file: UTF-8 bytes are the tokens, nothing to train.

The bytes are read from the file as rows are drawn, so that a file of any size trains in the
same memory.
"""

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.corpus.tokenizers import (
    ByteTokenizer,
    FileTokenizer,
    tokenizer_from_state,
    tokenizer_state,
)
from src.data.sampler import SplitLoaders, resumable_loader
from src.data.splits import check_fractions, check_loader_options
from src.utils.contracts import TOKENS
from src.utils.errors import ConfigError, DataError, MissingFileError
from src.utils.files import PositionalReader

log = logging.getLogger(__name__)


class TokenWindows(Dataset):
    """Consecutive, non-overlapping windows of the token stream [begin, end) of a text file.

    The stream is the file's UTF-8 bytes, then the end-of-text token, read from the file on
    demand, never held.

    Example i covers tokens [begin + i*T, begin + (i+1)*T]: `input_ids` are its first T tokens
    and `labels` its last T, already shifted, so labels[t] is the target at position t.
    """

    def __init__(self, path: Path, begin: int, end: int, seq_len: int):
        self.file = PositionalReader(path)
        self.size = path.stat().st_size  # the stream is one token longer: the end-of-text
        self.begin, self.end = begin, end
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (self.end - self.begin - 1) // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = self.begin + index * self.seq_len
        stop = start + self.seq_len + 1
        window = torch.frombuffer(bytearray(self.file.read(start, stop - start)), dtype=torch.uint8)
        window = window.long()
        if stop > self.size:  # the window ends with the end-of-text token
            window = torch.cat((window, torch.tensor([ByteTokenizer.eos_token_id])))
        return {"input_ids": window[:-1], "labels": window[1:]}


class ByteTextDataModule(SplitLoaders, LightningDataModule):
    """A text file as bytes, cut into fixed-length rows.

    Batches are dicts of `input_ids` and `labels` [B, max_seq_len].

    The split is contiguous and deterministic: the file's first part trains, then come
    `val_fraction` for validation and `test_fraction` for testing, so no evaluated text sits
    inside a training row. As in every datamodule here, rows come from a resumable
    DistributedSampler (shuffled by `shuffle_seed` + epoch, sharded across DDP ranks).
    """

    batch_kind = TOKENS

    def __init__(
        self,
        path: str,
        max_seq_len: int = 256,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
        shuffle_seed: int | None = None,
        seq_len: int | None = None,
    ):
        super().__init__()
        if seq_len is not None:
            log.warning("data.seq_len is deprecated: it is data.max_seq_len=%d now", seq_len)
            max_seq_len = seq_len
        if max_seq_len < 1:
            raise ConfigError(f"data.max_seq_len must be a positive integer, got {max_seq_len}")
        check_loader_options(batch_size, eval_batch_size)
        check_fractions(val_fraction, test_fraction)
        self.path = Path(path)
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.fractions = {"val": val_fraction, "test": test_fraction}
        self.num_workers = num_workers
        self.shuffle_seed = shuffle_seed
        self.tokenizer: ByteTokenizer | FileTokenizer = ByteTokenizer()  # or a checkpoint's
        self.datasets: dict[str, TokenWindows] = {}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        if not self.path.is_file():
            raise MissingFileError(f"data.path={str(self.path)!r} is not a file")
        length = self.path.stat().st_size + 1  # the bytes, then the end-of-text token
        val_start = int(length * (1 - self.fractions["val"] - self.fractions["test"]))
        test_start = int(length * (1 - self.fractions["test"]))
        bounds = {
            "train": (0, val_start),
            "val": (val_start, test_start),
            "test": (test_start, length),
        }
        for split, (start, end) in bounds.items():
            self.datasets[split] = TokenWindows(self.path, start, end, self.max_seq_len)
            if split != "test" and not len(self.datasets[split]):
                raise DataError(
                    f"The {split} split of {self.path} ({end - start} bytes) is "
                    f"shorter than one row of max_seq_len + 1 = {self.max_seq_len + 1} tokens"
                )

    def state_dict(self) -> dict[str, Any]:
        """What checkpoints keep of the datamodule: its tokenizer (bytes).

        Every text datamodule keeps its tokenizer in checkpoints.
        """
        return {"tokenizer": tokenizer_state(self.tokenizer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "tokenizer" in state_dict:  # older checkpoints have none: bytes all the same
            self.tokenizer = tokenizer_from_state(state_dict["tokenizer"])

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> StatefulDataLoader:
        return resumable_loader(self, self.datasets[split], batch_size, shuffle)

"""Byte-level language modelling on one text file: UTF-8 bytes are the tokens, nothing to train."""

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.sampler import SplitLoaders, resumable_loader
from src.data.splits import check_fractions, check_loader_options
from src.data.tokenizers import ByteTokenizer, tokenizer_from_state, tokenizer_state
from src.utils.contracts import TOKENS
from src.utils.errors import ConfigError, DataError, MissingFileError

log = logging.getLogger(__name__)


class TokenWindows(Dataset):
    """Consecutive, non-overlapping windows of a token stream, as next-token examples.

    Example i covers tokens [i*T, (i+1)*T]: `input_ids` are its first T tokens and `labels`
    its last T, already shifted, so labels[t] is the target at position t.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return {"input_ids": window[:-1], "labels": window[1:]}


class ByteTextDataModule(SplitLoaders, LightningDataModule):
    """A text file as bytes, cut into fixed-length rows; batches are dicts of `input_ids` and
    `labels` [B, max_seq_len].

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
        self.tokenizer = ByteTokenizer()
        self.datasets: dict[str, TokenWindows] = {}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        if not self.path.is_file():
            raise MissingFileError(f"data.path={str(self.path)!r} is not a file")
        raw = bytearray(self.path.read_bytes())
        tokens = torch.cat(
            (
                torch.frombuffer(raw, dtype=torch.uint8).long(),
                torch.tensor([ByteTokenizer.eos_token_id]),
            )
        )
        val_start = int(len(tokens) * (1 - self.fractions["val"] - self.fractions["test"]))
        test_start = int(len(tokens) * (1 - self.fractions["test"]))
        bounds = {
            "train": (0, val_start),
            "val": (val_start, test_start),
            "test": (test_start, None),
        }
        for split, (start, end) in bounds.items():
            self.datasets[split] = TokenWindows(tokens[start:end], self.max_seq_len)
            if split != "test" and not len(self.datasets[split]):
                raise DataError(
                    f"The {split} split of {self.path} ({len(tokens[start:end])} bytes) is "
                    f"shorter than one row of max_seq_len + 1 = {self.max_seq_len + 1} tokens"
                )

    def state_dict(self) -> dict[str, Any]:
        """What checkpoints keep of the datamodule: its tokenizer (bytes), as every text
        datamodule's checkpoints do."""
        return {"tokenizer": tokenizer_state(self.tokenizer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "tokenizer" in state_dict:  # older checkpoints have none: bytes all the same
            self.tokenizer = tokenizer_from_state(state_dict["tokenizer"])

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> StatefulDataLoader:
        return resumable_loader(self, self.datasets[split], batch_size, shuffle)

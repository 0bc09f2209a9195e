"""The sampler behind every datamodule: sharded, shuffled by seed and epoch, and resumable."""

import warnings
from collections.abc import Callable, Iterator, Sized
from typing import Any, Protocol, cast

import torch
from lightning.pytorch import Trainer
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from src.utils.errors import DataError

# Raised inside torchdata by its own use of a deprecated torch call; nothing for users to do.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

CHUNK = 4096  # indices turned into Python ints at a time


class HasTrainer(Protocol):
    """A datamodule as `resumable_sampler` reads it: the trainer that runs it, if any."""

    @property
    def trainer(self) -> Trainer | None: ...


class LoaderOwner(HasTrainer, Protocol):
    """A datamodule as `resumable_loader` reads it: its trainer, shuffle seed and worker count."""

    @property
    def shuffle_seed(self) -> int | None: ...

    @property
    def num_workers(self) -> int: ...


class SplitLoaderOwner(Protocol):
    """A datamodule as `SplitLoaders` reads it: its batch sizes and how it builds a loader."""

    @property
    def batch_size(self) -> int: ...

    @property
    def eval_batch_size(self) -> int: ...

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> StatefulDataLoader: ...


class ResumableDistributedSampler(StatefulDistributedSampler):
    """torchdata's stateful DistributedSampler, with the epoch in its state and its order a tensor.

    Lightning builds the training iterator before it sets the sampler's epoch on resume, so
    without the epoch in the checkpoint a run resumed in epoch 3 would replay epoch 0's order.
    torch's sampler lists every index as a Python int (about 40 bytes each: 160 MB for the 4
    million rows of a 1 GB corpus); this one yields the same indices from an int64 tensor.
    """

    # The loader yields no more batches this epoch once fewer samples than this are left: its
    # batch size when it drops the last partial batch (set by `resumable_loader`), else 1.
    smallest_batch = 1
    next_yielded: int | None  # the position a loaded state resumes at, None once resumed

    def __iter__(self) -> Iterator[int]:
        self.yielded, self.next_yielded = self.next_yielded or 0, None
        for chunk in self.rank_indices()[self.yielded :].split(CHUNK):
            for index in chunk.tolist():
                self.yielded += 1
                yield index

    def rank_indices(self) -> torch.Tensor:
        """This rank's indices this epoch, in the order torch's DistributedSampler gives them.

        That is the epoch's indices (`epoch_indices`: the permutation by seed + epoch), padded
        cyclically (or cut) to a multiple of the ranks, then every `num_replicas`-th from `rank`.
        """
        indices = self.epoch_indices()
        count = len(indices)
        if count and self.total_size > count:
            indices = indices.repeat(-(-self.total_size // count))
        return indices[: self.total_size][self.rank :: self.num_replicas]

    def epoch_indices(self) -> torch.Tensor:
        """Every rank's indices this epoch, `len(dataset)` of them, before they are dealt out."""
        count = len(self.dataset)
        if not self.shuffle:
            return torch.arange(count)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(count, generator=generator)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.epoch = state_dict["epoch"]
        if self.num_samples - state_dict[self._YIELDED] < self.smallest_batch:
            self._start_next_epoch()

    def _start_next_epoch(self) -> None:
        """Resume a state whose epoch has no batch left as the start of the next epoch.

        Such a state comes from a checkpoint saved after the epoch's last batch (a periodic
        one that falls there). Lightning resumes it as the start of the next epoch, iterating
        the loader restored from it: left at the end of its epoch, that loader would yield
        nothing and the run would end there. It yields the next epoch instead, in the order the
        uninterrupted run draws for it (seed + epoch).
        """
        self.epoch += 1
        self.next_yielded = None


def resumable_sampler(
    datamodule: HasTrainer,
    dataset: Dataset,
    shuffle: bool,
    shuffle_seed: int | None,
    kind: Callable[..., ResumableDistributedSampler] = ResumableDistributedSampler,
) -> ResumableDistributedSampler:
    """The sampler for one split of `datamodule`: this rank's slice of a seeded permutation.

    The permutation is seeded by `shuffle_seed` + epoch (the process's torch seed when None);
    there is one rank when not distributed. `kind` builds it (a data mixture's draws by weight).
    """
    trainer = datamodule.trainer
    world_size, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
    seed = torch.initial_seed() if shuffle_seed is None else shuffle_seed
    return kind(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed % 2**63)


def resumable_loader(
    datamodule: LoaderOwner,
    dataset: Dataset,
    batch_size: int | None,
    shuffle: bool,
    unit: str = "samples",
    sampler_kind: Callable[..., ResumableDistributedSampler] = ResumableDistributedSampler,
    **options: Any,
) -> StatefulDataLoader:
    """A loader over `dataset` whose position and shuffle order go into checkpoints.

    A resumed run therefore continues exactly. Shuffled (training) loaders drop the last partial
    batch: every optimizer step has the same size, on every rank; one that would have no batch
    at all is refused (`check_one_batch`, which names `dataset`'s items as `unit`). Uses the
    datamodule's `shuffle_seed` and `num_workers`; `sampler_kind` builds the sampler.
    """
    sampler = resumable_sampler(datamodule, dataset, shuffle, datamodule.shuffle_seed, sampler_kind)
    drop_last = False
    if shuffle and batch_size is not None:
        check_one_batch(len(cast(Sized, dataset)), batch_size, sampler.num_replicas, unit)
        drop_last = True
        sampler.smallest_batch = batch_size
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=datamodule.num_workers,
        persistent_workers=datamodule.num_workers > 0,
        **options,
    )


def check_one_batch(count: int, batch_size: int, ranks: int = 1, unit: str = "samples") -> None:
    """Refuse a training split of `count` items that gives a rank no full batch.

    Lightning would end such a fit at once ("No training batches") and the run would go on to
    test an untrained model.
    """
    per_rank = -(-count // ranks)  # the sampler pads every rank to the same count
    if per_rank >= batch_size:
        return
    held = f"{count} {unit}" + (f" ({per_rank} per rank of {ranks})" if ranks > 1 else "")
    fix = f"lower data.batch_size to {per_rank} or less, or " if per_rank else ""
    raise DataError(
        f"The training split has {held}, fewer than one batch of data.batch_size={batch_size}: "
        f"every epoch drops its last partial batch, so not one step would train. To train, "
        f"{fix}add data."
    )


class SplitLoaders:
    """`train_dataloader`, `val_dataloader` and `test_dataloader`; only training shuffles.

    For a datamodule with `batch_size`, `eval_batch_size` and `_loader(split, batch_size,
    shuffle)` (`SplitLoaderOwner`).
    """

    def train_dataloader(self: SplitLoaderOwner) -> StatefulDataLoader:
        return self._loader("train", self.batch_size, shuffle=True)

    def val_dataloader(self: SplitLoaderOwner) -> StatefulDataLoader:
        return self._loader("val", self.eval_batch_size, shuffle=False)

    def test_dataloader(self: SplitLoaderOwner) -> StatefulDataLoader:
        return self._loader("test", self.eval_batch_size, shuffle=False)

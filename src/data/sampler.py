"""The sampler behind every datamodule: sharded, shuffled by seed and epoch, and resumable."""

import warnings
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

# Raised inside torchdata by its own use of a deprecated torch call; nothing for users to do.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class ResumableDistributedSampler(StatefulDistributedSampler):
    """torchdata's stateful DistributedSampler, with the epoch in its state too.

    Lightning builds the training iterator before it sets the sampler's epoch on resume, so
    without the epoch in the checkpoint a run resumed in epoch 3 would replay epoch 0's order.
    """

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.epoch = state_dict["epoch"]


def resumable_sampler(
    datamodule: LightningDataModule, dataset: Dataset, shuffle: bool, shuffle_seed: int | None
) -> ResumableDistributedSampler:
    """The sampler for one split of `datamodule`: this rank's slice of a permutation seeded by
    `shuffle_seed` + epoch (the process's torch seed when None), one rank when not distributed."""
    trainer = datamodule.trainer
    world_size, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
    seed = torch.initial_seed() if shuffle_seed is None else shuffle_seed
    return ResumableDistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed % 2**63
    )

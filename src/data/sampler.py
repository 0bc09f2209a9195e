"""The sampler behind every datamodule: sharded, shuffled by seed and epoch, and resumable."""

import warnings
from typing import Any

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

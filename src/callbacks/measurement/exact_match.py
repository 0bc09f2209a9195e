"""Exact-match accuracy of greedy answers on held-out prompts.

It says what validation loss cannot say about a fine-tuned model.
"""

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from src.utils.contracts import AnswersPrompts, ExactMatchData


class ExactMatch(Callback):
    """Logs `val/exact_match` and `test/exact_match` after each validation and test.

    They are the share of the datamodule's held-out prompts that the model answers exactly
    (decoding greedily).

    Active when the datamodule offers such prompts (`ExactMatchData`, e.g. SFT data) and the
    model answers them (`AnswersPrompts`); a no-op otherwise and during the sanity check. Each
    rank answers its share of the prompts; one all-reduce per evaluation adds up the counts.
    """

    def metric_keys(self, pl_module: LightningModule, datamodule: object) -> set[str]:
        """The metrics it logs for this model and data (src/run/metric_keys.py)."""
        if isinstance(pl_module, AnswersPrompts) and isinstance(datamodule, ExactMatchData):
            return {"val/exact_match", "test/exact_match"}
        return set()

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._score("val", trainer, pl_module)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._score("test", trainer, pl_module)

    def _score(self, split: str, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
        if trainer.sanity_checking or not isinstance(pl_module, AnswersPrompts):
            return
        if not isinstance(datamodule, ExactMatchData):
            return
        examples = datamodule.exact_match_examples(split)
        if not examples:
            return
        mine = examples[trainer.global_rank :: trainer.world_size]
        correct = pl_module.count_exact_matches(datamodule.tokenizer, mine)
        counts = torch.tensor([correct, len(mine)], dtype=torch.float32, device=pl_module.device)
        correct, asked = trainer.strategy.reduce(counts, reduce_op="sum")
        pl_module.log(f"{split}/exact_match", correct / asked.clamp_min(1), prog_bar=split == "val")

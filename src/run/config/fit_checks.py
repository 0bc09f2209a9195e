"""Checks that the model and the data of a run fit each other, once both are set up."""

from lightning.pytorch import Callback, LightningModule, Trainer

from src.utils.contracts import HasVocabulary
from src.utils.errors import ConfigError


class ModelFitsData(Callback):
    """Stop before the first batch when the data has token ids the model has no embedding for."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning calls this after the datamodule's own `setup`: its tokenizer is known now.
        check_vocabulary(trainer.datamodule, pl_module)  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer


def check_vocabulary(datamodule: object, model: object) -> None:
    if not (isinstance(datamodule, HasVocabulary) and isinstance(model, HasVocabulary)):
        return
    if datamodule.vocab_size > model.vocab_size:
        raise ConfigError(
            f"The data has {datamodule.vocab_size} token ids but the model's vocab_size is "
            f"{model.vocab_size}: raise model.config.vocab_size to at least "
            f"{datamodule.vocab_size}"
        )

"""A failed run's DataLoader workers stop with it, not when the garbage collector frees them."""

import multiprocessing

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from src.callbacks.training.loader_workers import StopLoaderWorkersOnError
from src.run.trainer import build_trainer
from tests.helpers import compose_config


class FailsAtItem(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        if index == 20:
            raise ValueError(f"item {index} is unreadable")
        return torch.full((4,), float(index))


class Linear(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_failing_in_a_worker(callbacks):
    loader = StatefulDataLoader(FailsAtItem(), batch_size=4, num_workers=2, persistent_workers=True)
    trainer = Trainer(
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match="item 20 is unreadable"):
        trainer.fit(Linear(), loader)


@pytest.mark.parametrize("stopped", [True, False])
def test_a_worker_error_stops_every_worker_before_the_error_reaches_the_caller(stopped):
    fit_failing_in_a_worker([StopLoaderWorkersOnError()] if stopped else [])
    workers = multiprocessing.active_children()
    for worker in workers:  # without the callback: stop them here, not in a later test
        worker.terminate()
    assert (workers == []) == stopped


def test_every_trainer_stops_its_loader_workers_on_error_even_with_callbacks_off(tmp_path):
    trainer = build_trainer(compose_config(tmp_path, ["callbacks=none"]))
    assert any(isinstance(callback, StopLoaderWorkersOnError) for callback in trainer.callbacks)

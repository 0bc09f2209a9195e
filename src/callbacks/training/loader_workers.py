"""Stop the DataLoader worker processes as soon as a run fails, not when they are collected."""

from collections.abc import Iterator
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


def loaders(iterables: Any) -> Iterator[Any]:
    """Each DataLoader in what a Trainer's `*_dataloader(s)` property gives: one, a list, a dict."""
    if isinstance(iterables, dict):
        iterables = list(iterables.values())
    if isinstance(iterables, list | tuple):
        for item in iterables:
            yield from loaders(item)
    elif iterables is not None:
        yield iterables


def stop_workers(loader: Any) -> None:
    """Stop the worker processes of `loader`'s live iterator, if it keeps one (persistent workers).

    DataLoader has no public call for this; `_shutdown_workers` is what its iterator runs when it
    is deleted, and what Lightning runs for torch's own iterator (but not torchdata's
    StatefulDataLoader's) when a fit ends.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


class StopLoaderWorkersOnError(Callback):
    """Stops every loader's workers when a fit, validation, test or prediction raises.

    Otherwise a failed run keeps them: the exception's traceback holds the loader's iterator in
    a reference cycle, and when the garbage collector frees it, its workers' queues may be
    finalised first, so that each worker waits out a 5 s timeout before it is killed (10 s
    with two workers, in a sweep's next job or a notebook's next cell).
    """

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        for iterables in (
            trainer.train_dataloader,
            trainer.val_dataloaders,
            trainer.test_dataloaders,
            trainer.predict_dataloaders,
        ):
            for loader in loaders(iterables):
                stop_workers(loader)

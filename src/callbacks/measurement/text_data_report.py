"""What a text run's data looks like before it trains: sample lengths, token accounting, tokenizer.

A no-op for datamodules without token accounting (`ReportsTokenAccounting`: images).
"""

import json
import logging
from pathlib import Path

import numpy
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.figure import Figure

from src.utils.contracts import ReportsTokenAccounting, TokenizedData

log = logging.getLogger(__name__)


class TextDataReport(Callback):
    """Reports the training data a text run fits on: its tokens, its packing, its lengths.

    At the start of fitting, on rank 0, it:

    - logs the training split's token accounting (`data/tokens_input`, `_kept`, `_truncated`,
      `_dropped`, samples truncated, dropped, split) and the packing (`data/rows`,
      `data/padding_fraction`, `data/documents_per_row`) to the loggers and to
      `<dirpath>/data_report.json`;
    - draws the histogram of sample lengths before and after the over-long policy as
      `<dirpath>/plots/sample_lengths.png`, and as TensorBoard histograms;
    - saves a copy of the tokenizer in `<dirpath>/tokenizer/` (nothing for the byte
      tokenizer), for tools that read a `tokenizer.json` (transformers' AutoTokenizer). The
      checkpoints carry the tokenizer themselves, in the datamodule's state.
    """

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
        if not trainer.is_global_zero or not isinstance(datamodule, ReportsTokenAccounting):
            return
        accounting = datamodule.accounting["train"]
        metrics = {**accounting.as_metrics("data"), **datamodule.packing_metrics()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)
            if isinstance(logger, TensorBoardLogger):
                for when in ("before", "after"):
                    lengths = numpy.asarray(getattr(accounting, f"lengths_{when}"))
                    logger.experiment.add_histogram(f"data/sample_lengths_{when}", lengths)
        (self.dirpath / "data_report.json").write_text(json.dumps(metrics, indent=2) + "\n")
        path = self.dirpath / "plots" / "sample_lengths.png"
        plot_lengths(
            accounting.lengths_before, accounting.lengths_after, datamodule.max_seq_len, path
        )
        assert isinstance(datamodule, TokenizedData)  # text data: it has a tokenizer
        datamodule.tokenizer.save(self.dirpath / "tokenizer")
        log.info(
            "Training data: %d tokens, %d kept, %d truncated, %d dropped; %d rows, %.1f%% "
            "padding (%s)",
            accounting.input,
            accounting.kept,
            accounting.truncated,
            accounting.dropped,
            metrics["data/rows"],
            100 * metrics["data/padding_fraction"],
            path,
        )


def plot_lengths(before: list[int], after: list[int], max_seq_len: int, path: Path) -> None:
    figure = Figure(figsize=(7, 3.5), layout="constrained")
    axes = figure.subplots()
    bins = numpy.histogram_bin_edges(before or [0], bins=50).tolist()  # shared, so the bars compare
    axes.hist(before, bins=bins, alpha=0.6, label=f"before ({len(before)} samples)")
    axes.hist(after, bins=bins, alpha=0.6, label=f"after the over-long policy ({len(after)})")
    axes.axvline(max_seq_len, color="black", linestyle="--", label=f"max_seq_len={max_seq_len}")
    axes.set(xlabel="tokens per sample", ylabel="samples", yscale="log", title="Sample lengths")
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)

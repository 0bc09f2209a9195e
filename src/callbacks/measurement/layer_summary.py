"""A torchsummary-style table: each layer's output shape and parameter count, for one input."""

import logging
from pathlib import Path

import torch
import torchinfo
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torchinfo.model_statistics import ModelStatistics

log = logging.getLogger(__name__)


class LayerSummary(Callback):
    """Prints the table at the start of fitting and saves it as `<dirpath>/model_summary.txt`.

    Needs `input_shape` (one sample, e.g. [1, 28, 28]); without it (text models) only the
    parameter counts are reported. The forward pass runs in eval mode under
    `torch.random.fork_rng`, so the summary changes neither batch-norm statistics nor what the
    run draws.
    """

    def __init__(self, dirpath: str, input_shape: list[int] | None = None, depth: int = 3):
        self.path = Path(dirpath) / "model_summary.txt"
        self.input_shape = input_shape
        self.depth = depth

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        input_size = None if self.input_shape is None else (1, *self.input_shape)
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            summary = torchinfo.summary(
                pl_module,
                input_size=input_size,
                depth=self.depth,
                verbose=0,
                device=pl_module.device,
                # Output sizes need an input; without one, parameters only.
                col_names=("output_size", "num_params", "trainable")
                if input_size
                else ("num_params", "trainable"),
            )
        count_shared_weights_once(summary, pl_module)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(str(summary) + "\n")
        log.info("Layer summary (also in %s):\n%s", self.path, summary)


def count_shared_weights_once(summary: ModelStatistics, module: nn.Module) -> None:
    """Set the summary's totals from the module's parameters, each counted once.

    torchinfo adds up its layers, so a weight two layers share (a language model's embedding
    tied to its head) is counted twice; `parameters()` yields it once.
    """
    parameters = list(module.parameters())
    summary.total_params = sum(p.numel() for p in parameters)
    summary.trainable_params = sum(p.numel() for p in parameters if p.requires_grad)
    summary.total_param_bytes = sum(p.numel() * p.element_size() for p in parameters)

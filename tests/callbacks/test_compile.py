"""torch.compile through a callback: clean checkpoint keys, compile time, recompile warnings."""

import json
import logging

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

from src.callbacks.training.compile import Compile
from tests.helpers import FAST, compose_config, quiet_trainer
from train import train


@pytest.mark.slow
def test_compiled_run_keeps_plain_checkpoint_keys_and_reports_compile_figures(tmp_path):
    # The eager backend runs the compile machinery (tracing, guards) without code generation.
    train(
        compose_config(
            tmp_path,
            ["+compile=default", "callbacks.compile.backend=eager", *FAST, "trainer.max_epochs=2"],
        )
    )
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert "net.fc1.weight" in state
    assert not any("_orig_mod" in key for key in state)
    record = json.loads((tmp_path / "metrics.json").read_text())
    metrics = record["metrics"]
    # Tracing makes the first step the slowest, by less than the whole run took.
    assert 0 < metrics["perf/compile_time_s"] < record["wall_time_s"]
    # Validation runs under no_grad, training with grad: the grad-mode guard fails at least once.
    recompiles = metrics["perf/recompiles"]
    assert recompiles >= 1, recompiles
    assert recompiles == int(recompiles), recompiles


def test_callbacks_compile_keeps_the_default_callbacks(tmp_path):
    cfg = compose_config(tmp_path, ["callbacks=compile"])
    assert {"model_checkpoint", "throughput", "compile"} <= set(cfg.callbacks)


class ShapeShifter(LightningModule):
    """Feeds the network a different batch size every step: a recompilation each time."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0][: batch_idx + 1]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_recompilation_storm_is_reported_with_its_reason(caplog):
    callback = Compile(backend="eager", dynamic=False, max_recompiles=2)
    trainer = quiet_trainer(max_steps=5, callbacks=[callback])
    loader = DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=8)
    with caplog.at_level(logging.WARNING, logger="src.callbacks.training.compile"):
        trainer.fit(ShapeShifter(), loader)
    assert len(callback.recorder.reasons) == 4  # batch sizes 2, 3, 4 and 5 are new shapes
    storm = [r.getMessage() for r in caplog.records if "Recompilation storm" in r.getMessage()]
    assert storm
    assert "size mismatch" in storm[0]

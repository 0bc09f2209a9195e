"""Training aids: `+tune=lr_find` (the range test before fitting, training from its suggestion)
and `callbacks=[default,ema]` (validation and checkpoints with averaged weights)."""

import csv
import json

import hydra
import pytest
import torch

from src.callbacks.training.lr_find import LRFinder
from src.run.trainer import build_trainer
from src.utils.weights import load_checkpoint
from tests.helpers import FAST, compose_config
from train import train

LR_FIND = ["+tune=lr_find", "callbacks.lr_find.num_training_steps=20", "logger=csv"]


def fit(run_dir, overrides):
    """Fit a digits run; return its trainer and its learning-rate finder."""
    cfg = compose_config(run_dir, [*FAST, *LR_FIND, *overrides])
    trainer = build_trainer(cfg)
    trainer.fit(hydra.utils.instantiate(cfg.model), datamodule=hydra.utils.instantiate(cfg.data))
    finder = next(callback for callback in trainer.callbacks if isinstance(callback, LRFinder))
    return trainer, finder


def first_logged_lr(run_dir):
    with open(run_dir / "csv" / "metrics.csv") as file:
        return next(float(row["lr-Adam"]) for row in csv.DictReader(file) if row.get("lr-Adam"))


def test_training_starts_from_the_suggested_learning_rate(tmp_path):
    trainer, finder = fit(tmp_path, ["scheduler=cosine"])
    suggestion = finder.optimal_lr.suggestion()
    assert suggestion is not None
    assert suggestion != pytest.approx(1e-3)
    assert len(finder.optimal_lr.results["lr"]) == 20
    assert first_logged_lr(tmp_path) == pytest.approx(suggestion)
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [suggestion]
    png = (tmp_path / "plots" / "lr_find.png").read_bytes()
    assert png[:4] == b"\x89PNG"
    assert len(png) > 10_000


def test_update_lr_false_only_suggests(tmp_path):
    _, finder = fit(tmp_path, ["callbacks.lr_find.update_lr=false"])
    suggestion = finder.optimal_lr.suggestion()
    assert suggestion in finder.optimal_lr.results["lr"], "not a rate the range test tried"
    assert suggestion != pytest.approx(1e-3)  # so that keeping 1e-3 below is visible
    assert first_logged_lr(tmp_path) == pytest.approx(1e-3)  # optimizer.lr of conf/optimizer/adam


def test_a_resumed_run_keeps_its_learning_rate_without_a_new_range_test(tmp_path):
    trainer, finder = fit(tmp_path, [])
    suggestion = finder.optimal_lr.suggestion()
    (tmp_path / "plots" / "lr_find.png").unlink()
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    cfg = compose_config(tmp_path, [*FAST, *LR_FIND, "trainer.max_epochs=2"])
    trainer = build_trainer(cfg)
    model = hydra.utils.instantiate(cfg.model)
    trainer.fit(model, datamodule=hydra.utils.instantiate(cfg.data), ckpt_path=checkpoint)
    resumed_finder = next(c for c in trainer.callbacks if isinstance(c, LRFinder))
    assert resumed_finder.optimal_lr is None
    assert not (tmp_path / "plots" / "lr_find.png").exists()
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(suggestion)


def accuracy(cfg, state_dict, split: str) -> float:
    model = hydra.utils.instantiate(cfg.model)
    model.load_state_dict(state_dict)
    model.eval()
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup()
    loader = getattr(datamodule, f"{split}_dataloader")()
    with torch.no_grad():
        hits = [model(x).argmax(dim=1) == y for x, y in loader]
    return torch.cat(hits).float().mean().item()


def test_ema_validates_and_checkpoints_the_averaged_weights(tmp_path):
    cfg = compose_config(tmp_path, [*FAST, "callbacks=[default,ema]", "logger=csv"])
    record = train(cfg)
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    averaged, raw = checkpoint["state_dict"], checkpoint["current_model_state"]
    assert averaged.keys() == raw.keys()
    assert checkpoint["averaging_state"]["n_averaged"] == checkpoint["global_step"]
    gap = max((averaged[key] - raw[key]).abs().max().item() for key in raw)
    assert gap > 1e-3, f"the averaged weights equal the raw ones (largest difference {gap})"
    logged = json.loads((tmp_path / "metrics.json").read_text())["metrics"]["val/acc"]
    assert accuracy(cfg, averaged, "val") == pytest.approx(logged, abs=1e-6)
    # The test after fitting scores the best checkpoint's averaged weights too.
    best = load_checkpoint(record["best_model_path"])["state_dict"]
    assert accuracy(cfg, best, "test") == pytest.approx(record["metrics"]["test/acc"], abs=1e-6)

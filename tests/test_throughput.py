"""The throughput callback's figures against values computed by hand on controlled runs."""

import json

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset

from src.callbacks import peak_flops
from src.callbacks.throughput import Throughput, measure_flops_per_batch
from src.models.classifier import ImageClassifier
from src.models.simplenet import SimpleNet
from tests.helpers import FAST, compose_config, quiet_trainer
from train import train

BATCH, SEQ, REAL = 4, 10, 7  # every row: 7 real tokens, 3 padding


class PaddedText(Dataset):
    """Rows of SEQ token slots of which REAL are real; the first real token is not supervised."""

    def __init__(self, rows=32):
        self.rows = rows

    def __len__(self):
        return self.rows

    def __getitem__(self, index):
        mask = torch.tensor([1] * REAL + [0] * (SEQ - REAL))
        labels = torch.where(mask.bool(), torch.arange(SEQ), -100)
        labels[0] = -100
        return {"input_ids": torch.arange(SEQ), "attention_mask": mask, "labels": labels}


class TinyLM(LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(SEQ, 8)
        self.head = torch.nn.Linear(8, SEQ)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def flops_per_batch(self, batch):
        return 1e6

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module, loader, callback, **trainer_args):
    trainer = quiet_trainer(callbacks=[callback], **trainer_args)
    trainer.fit(module, loader)
    return trainer


def test_text_figures_match_the_batches(tmp_path):
    callback = Throughput(warmup_steps=2, peak_flops=1e9)
    fit(
        TinyLM(),
        DataLoader(PaddedText(), batch_size=BATCH),
        callback,
        max_epochs=1,
        accumulate_grad_batches=2,
    )
    summary = callback.summary()
    assert summary["perf/padding_fraction"] == pytest.approx(1 - REAL / SEQ)
    assert summary["perf/effective_batch_samples"] == BATCH * 2
    assert summary["perf/effective_batch_tokens"] == BATCH * SEQ * 2
    steps_per_s = summary["perf/steps_per_s"]  # per batch (micro-step) here
    assert summary["perf/samples_per_s"] == pytest.approx(BATCH * steps_per_s)
    assert summary["perf/tokens_per_s"] == pytest.approx(BATCH * SEQ * steps_per_s)
    assert summary["perf/real_tokens_per_s"] == pytest.approx(BATCH * REAL * steps_per_s)
    assert summary["perf/supervised_tokens_per_s"] == pytest.approx(
        BATCH * (REAL - 1) * steps_per_s
    )
    assert summary["perf/flops_per_s"] == pytest.approx(1e6 * steps_per_s)
    assert summary["perf/mfu"] == pytest.approx(1e6 * steps_per_s / 1e9)
    assert summary["perf/step_time_p50_ms"] <= summary["perf/step_time_p90_ms"]
    assert len(callback.step_times) == 32 // BATCH - 2  # warm-up batches excluded


class SlowImages(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, index):
        import time

        time.sleep(0.05)
        return torch.randn(1, 4, 4), index % 2


def test_a_slow_dataset_shows_as_data_wait(tmp_path):
    module = ImageClassifier(
        SimpleNet([1, 4, 4], 2), num_classes=2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)
    )
    callback = Throughput(warmup_steps=1, peak_flops=1e9)
    fit(module, DataLoader(SlowImages(), batch_size=4), callback, max_epochs=1, limit_val_batches=0)
    assert callback.summary()["perf/data_wait_fraction"] > 0.8


def test_flops_of_simplenet_are_counted_exactly_without_touching_its_weights():
    net = SimpleNet([1, 28, 28], 10)
    module = ImageClassifier(net, num_classes=10, optimizer=torch.optim.Adam)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    batch = (torch.randn(64, 1, 28, 28), torch.zeros(64, dtype=torch.long))
    rng = torch.get_rng_state()
    flops = measure_flops_per_batch(module, batch)
    assert flops == 3 * 2 * 64 * (784 * 128 + 128 * 10)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(
        peak_flops, "measure_matmul_flops", lambda dtype: calls.append(dtype) or 123e9
    )
    cache = tmp_path / "peak.json"
    assert peak_flops.cpu_peak_flops(torch.bfloat16, cache) == 123e9
    assert peak_flops.cpu_peak_flops(torch.bfloat16, cache) == 123e9
    assert calls == [torch.bfloat16] and cache.exists()


def test_every_run_writes_perf_metrics_to_metrics_json(tmp_path):
    train(
        compose_config(
            tmp_path, [*FAST, "trainer.max_epochs=2", "callbacks.throughput.peak_flops=1e11"]
        )
    )
    record = json.loads((tmp_path / "metrics.json").read_text())
    metrics = record["metrics"]
    assert metrics["perf/effective_batch_samples"] == 64  # data.batch_size, no accumulation
    assert metrics["perf/steps_per_s"] > 0
    # Samples per step: 64, less the short batch that ends each epoch of the digits split.
    assert 0.9 * 64 < metrics["perf/samples_per_s"] / metrics["perf/steps_per_s"] <= 64
    assert 0 < metrics["perf/step_time_p50_ms"] <= metrics["perf/step_time_p90_ms"]
    assert 0 < metrics["perf/time_to_first_step_s"] < record["wall_time_s"]
    assert 0 < metrics["perf/data_wait_fraction"] < 1
    assert 0 < metrics["perf/mfu"] < 1

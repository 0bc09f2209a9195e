"""The throughput callback's figures against values computed by hand on controlled runs."""

import json
import logging

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset

from src.callbacks.measurement import peak_flops, throughput
from src.callbacks.measurement.throughput import Throughput, measure_flops_per_batch
from src.models.language.language_model import LanguageModel
from src.models.vision.classifier import ImageClassifier
from src.models.vision.simplenet import SimpleNet
from tests.helpers import FAST, compose_config, quiet_trainer, tiny_config
from train import train

BATCH, SEQ, REAL = 4, 10, 7  # every row: 7 real tokens, 3 padding
# A peak FLOP/s no run here comes near, so that perf/mfu stays below 1 (and is reported) on any
# machine: reaching it would take a billion of TinyLM's 1e6-FLOP batches a second, or twenty
# million of the largest batch of VaryingFlops, and each batch is a Python training step.
UNREACHABLE_PEAK = 1e15


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
    callback = Throughput(warmup_steps=2, peak_flops=UNREACHABLE_PEAK)
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
    assert summary["perf/mfu"] == pytest.approx(1e6 * steps_per_s / UNREACHABLE_PEAK)
    assert summary["perf/step_time_p50_ms"] <= summary["perf/step_time_p90_ms"]
    assert len(callback.step_times) == 32 // BATCH - 2  # warm-up batches excluded


class Clock:
    """The callback's clock, moved on only by the test: loading a sample takes `load_s`, a
    training step `step_s`, whatever the machine's speed."""

    def __init__(self, load_s: float, step_s: float):
        self.now, self.load_s, self.step_s = 0.0, load_s, step_s

    def perf_counter(self) -> float:
        return self.now


class SlowImages(Dataset):
    def __init__(self, clock: Clock):
        self.clock = clock

    def __len__(self):
        return 24

    def __getitem__(self, index):
        self.clock.now += self.clock.load_s
        return torch.randn(1, 4, 4), index % 2


class TimedClassifier(ImageClassifier):
    def __init__(self, clock: Clock):
        super().__init__(
            SimpleNet([1, 4, 4], 2), num_classes=2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)
        )
        self.clock = clock

    def training_step(self, batch, batch_idx):
        self.clock.now += self.clock.step_s
        return super().training_step(batch, batch_idx)


def test_a_slow_dataset_shows_as_data_wait(monkeypatch):
    clock = Clock(load_s=0.25, step_s=0.1)
    monkeypatch.setattr(throughput, "time", clock)
    callback = Throughput(warmup_steps=1, peak_flops=UNREACHABLE_PEAK)
    loader = DataLoader(SlowImages(clock), batch_size=4)
    fit(TimedClassifier(clock), loader, callback, max_epochs=1, limit_val_batches=0)
    # Each steady batch waits for its 4 samples, then trains: 1 s of wait to 0.1 s of step.
    fraction = callback.summary()["perf/data_wait_fraction"]
    assert fraction == pytest.approx(4 * 0.25 / (4 * 0.25 + 0.1)), f"data wait {fraction:.3f}"


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
    assert calls == [torch.bfloat16]
    assert cache.exists()


def test_the_cpu_peak_cache_is_keyed_by_machine_so_another_hosts_probe_is_never_reused(
    tmp_path, monkeypatch
):
    cache = tmp_path / "peak.json"
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda dtype: 92.6e9)
    monkeypatch.setattr(peak_flops.platform, "node", lambda: "laptop")
    assert peak_flops.cpu_peak_flops(torch.float32, cache) == 92.6e9
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda dtype: 246e9)
    monkeypatch.setattr(peak_flops.platform, "node", lambda: "workstation")
    assert peak_flops.cpu_peak_flops(torch.float32, cache) == 246e9  # probed again
    monkeypatch.setattr(peak_flops.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda dtype: 900e9)
    assert peak_flops.cpu_peak_flops(torch.float32, cache) == 900e9  # more cores: again


def test_an_mfu_above_one_is_never_reported_and_says_which_peak_was_wrong():
    callback = Throughput(warmup_steps=1, peak_flops=1.0)  # far below any real machine
    with pytest.warns(UserWarning, match=r"perf/mfu came out at .* above 1: the peak of 0\.0"):
        fit(TinyLM(), DataLoader(PaddedText(16), batch_size=BATCH), callback, max_epochs=1)
    summary = callback.summary()
    assert "perf/mfu" not in summary
    assert summary["perf/flops_per_s"] > 1.0
    assert all("perf/mfu" not in rates for _, rates in callback.windows)


def test_every_run_writes_perf_metrics_to_metrics_json(tmp_path):
    train(
        compose_config(
            tmp_path,
            [*FAST, "trainer.max_epochs=2", f"callbacks.throughput.peak_flops={UNREACHABLE_PEAK}"],
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
    assert record["mfu_peak"] == {
        "flops_per_s": UNREACHABLE_PEAK,
        "source": "callbacks.throughput.peak_flops",
    }


# -- peak FLOP/s of GPUs, by exact device name ----------------------------------------------------

CUDA = torch.device("cuda", 0)  # never used: the device name is mocked


def peak_of(monkeypatch, name, dtype=torch.bfloat16):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak = peak_flops.device_peak(CUDA, dtype)
    return None if peak is None else peak.flops


@pytest.mark.parametrize(
    ("name", "dense_bf16"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),  # SXM
        ("NVIDIA H100 PCIe", 756.5e12),  # not the SXM's 989 of a substring match
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989.5e12),  # SXM
        ("NVIDIA H200 NVL", 835.5e12),  # not the SXM's 989, nor Lightning's sparse 1,671
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362.05e12),  # Lightning's substring match gives the L4's 121
        ("NVIDIA GeForce RTX 4090", 165.2e12),  # Lightning lists its non-tensor 82.6
    ],
)
def test_each_gpu_sku_gets_its_own_dense_bf16_peak(monkeypatch, name, dense_bf16):
    assert peak_of(monkeypatch, name) == dense_bf16, name


def test_fp32_peaks_follow_the_matmul_precision(monkeypatch):
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak_of(monkeypatch, "NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
        torch.set_float32_matmul_precision("high")  # tf32 tensor cores
        assert peak_of(monkeypatch, "NVIDIA A100-SXM4-80GB", torch.float32) == 156e12
    finally:
        torch.set_float32_matmul_precision(previous)


def test_unlisted_gpus_fall_back_to_lightnings_table(monkeypatch):
    assert peak_of(monkeypatch, "Tesla V100-SXM2-16GB", torch.float16) == 125e12


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA Imaginary X1",
        "NVIDIA H200 SXM1 141GB",  # a Hopper name Lightning would give its sparse peak
    ],
)
def test_unknown_gpus_get_no_peak_and_one_info_line(monkeypatch, caplog, name):
    with caplog.at_level(logging.INFO, logger=peak_flops.__name__):
        assert peak_of(monkeypatch, name) is None
    lines = [r.getMessage() for r in caplog.records if r.name == peak_flops.__name__]
    assert len(lines) == 1, lines
    assert name in lines[0], lines
    assert "perf/mfu" in lines[0], lines


def test_without_a_peak_mfu_is_left_out_while_flops_are_still_logged(monkeypatch):
    monkeypatch.setattr(throughput, "device_peak", lambda device, dtype: None)
    callback = Throughput(warmup_steps=1)
    fit(TinyLM(), DataLoader(PaddedText(16), batch_size=BATCH), callback, max_epochs=1)
    summary = callback.summary()
    assert "perf/mfu" not in summary
    assert summary["perf/flops_per_s"] > 0
    assert all("perf/mfu" not in rates for _, rates in callback.windows)


# -- FLOPs of packed rows, per document -----------------------------------------------------------


def lm_batch(rows, length, document_lengths=None):
    batch = {"input_ids": torch.zeros(rows, length, dtype=torch.long)}
    if document_lengths is not None:
        batch["document_lengths"] = torch.tensor(document_lengths)
    return batch


@pytest.fixture(scope="module")
def hybrid_lm():
    """Gated DeltaNet and full-attention layers: only the latter depend on the length."""
    return LanguageModel(tiny_config("qwen3_next").to_dict())


def test_a_padded_batch_counts_every_token_slot_at_the_row_length(hybrid_lm):
    flops = hybrid_lm.flops_per_batch(lm_batch(3, 32))
    assert flops == 3 * 32 * hybrid_lm.net.flops_per_token(32)


def test_packed_rows_count_attention_per_document_by_its_own_length(hybrid_lm):
    f = hybrid_lm.net.flops_per_token
    one_document = hybrid_lm.flops_per_batch(lm_batch(2, 32, [[32, 0, 0], [32, 0, 0]]))
    assert float(one_document) == pytest.approx(2 * 32 * f(32), rel=1e-12)
    # Row 1 ends in 2 padding slots, which its last document's attention span absorbs.
    packed = hybrid_lm.flops_per_batch(lm_batch(2, 32, [[8, 8, 16], [20, 10, 0]]))
    segments = [8, 8, 16, 20, 12]
    # Each token's share of attention is that of its own document: f(n) per token of it.
    assert float(packed) == pytest.approx(sum(n * f(n) for n in segments), rel=1e-12)
    attention_difference = sum(n * (f(32) - f(n)) for n in segments)
    assert attention_difference > 0
    assert float(one_document - packed) == pytest.approx(attention_difference, rel=1e-9)


# -- MFU over every batch of every window ---------------------------------------------------------


class VaryingFlops(Dataset):
    """Padded text rows whose batches carry their (made-up) FLOPs: 1e6 x the row index."""

    def __len__(self):
        return 24

    def __getitem__(self, index):
        return {**PaddedText()[index], "flops": torch.tensor(1e6 * index, dtype=torch.float64)}


class VaryingFlopsLM(TinyLM):
    def flops_per_batch(self, batch):
        return batch["flops"].sum()  # a tensor, as a packed LanguageModel batch gives


def test_mfu_adds_up_the_flops_of_every_batch_of_every_window():
    callback = Throughput(warmup_steps=2, peak_flops=UNREACHABLE_PEAK)
    fit(
        VaryingFlopsLM(),
        DataLoader(VaryingFlops(), batch_size=2),
        callback,
        max_epochs=1,
        log_every_n_steps=3,
    )
    batch_flops = [1e6 * (2 * b + 2 * b + 1) for b in range(12)]
    assert len(callback.windows) == 4
    for number, (_, rates) in enumerate(callback.windows):
        window = batch_flops[3 * number : 3 * number + 3]
        per_batch = rates["perf/flops_per_s"] / rates["perf/steps_per_s"]
        assert per_batch == pytest.approx(sum(window) / 3), f"window {number}"
        assert rates["perf/mfu"] == pytest.approx(rates["perf/flops_per_s"] / UNREACHABLE_PEAK)
    summary = callback.summary()
    steady = batch_flops[2:]
    assert summary["perf/flops_per_s"] / summary["perf/steps_per_s"] == pytest.approx(
        sum(steady) / len(steady)
    )

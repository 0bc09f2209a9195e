"""Always-on, cheap training throughput: rates, step-time percentiles, data wait, MFU, cold start.

Lightning's `ThroughputMonitor` synchronises the device after every batch and reports nothing
about data wait, step-time spread or cold start, so this callback keeps its own host-side
clock. It still uses Lightning's FLOP counting and peak tables (through
`src.callbacks.measurement.peak_flops`).

What it costs per step: two `perf_counter` calls and, for text batches, a few tensor sums kept
on the device, the batch's FLOPs among them (counted for every batch, since packed rows of
different documents differ). The device is synchronised only on logging steps, so windowed
rates are exact while single step times on a GPU are host-side (launch) times. `perf/mfu` is
left out where the device's peak is unknown.
"""

import logging
import statistics
import time
from collections import deque
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.flop_counter import FlopCounterMode

from src.callbacks.measurement.peak_flops import Peak, device_peak, dtype_of_precision
from src.utils.contracts import IGNORE_INDEX, CountsFlops
from src.utils.lightning import is_logging_step

log = logging.getLogger(__name__)


def batch_counts(batch: Any) -> dict[str, Any]:
    """Samples, and for text batches token slots, real (non-padding) and supervised tokens.

    Image batches are `(inputs, targets)`; text batches are dicts with `input_ids`, optionally
    `document_lengths` (the packed rows' documents; their sum is the real tokens) or
    `attention_mask` (1 = real token), and `labels` (IGNORE_INDEX: not supervised). Token counts
    stay tensors so that counting never waits for the device.
    """
    if isinstance(batch, dict) and "input_ids" in batch:
        input_ids = batch["input_ids"]
        labels = batch.get("labels")
        counts = {
            "samples": int(input_ids.shape[0]),
            "tokens": int(input_ids.numel()),
            "real_tokens": int(input_ids.numel()),
            "supervised_tokens": (labels != IGNORE_INDEX).sum() if labels is not None else None,
        }
        if "document_lengths" in batch:
            lengths = batch["document_lengths"]
            counts["real_tokens"] = lengths.sum()
            counts["documents"] = (lengths > 0).sum()
        elif "attention_mask" in batch:
            counts["real_tokens"] = batch["attention_mask"].sum()
        return counts
    first = batch[0] if isinstance(batch, list | tuple) else batch
    return {"samples": int(first.shape[0])}


class Throughput(Callback):
    """Logs `perf/*` rates on logging steps and a steady-state summary at every epoch end.

    Steady state starts after `warmup_steps` training batches, so compilation, allocator
    warm-up and first-iterator costs are reported separately as cold start
    (`perf/time_to_first_step_s`). Validation and checkpointing are excluded from the rates.
    `peak_flops` overrides the device peak used for `perf/mfu` (FLOP/s). On a GPU the summary
    also holds the peak memory allocated (`perf/peak_memory_gib`).
    """

    def __init__(
        self, warmup_steps: int = 10, window: int = 10_000, peak_flops: float | None = None
    ):
        self.warmup_steps = warmup_steps
        self.step_times: deque[float] = deque(maxlen=window)
        self.peak = (
            None if peak_flops is None else Peak(peak_flops, "callbacks.throughput.peak_flops")
        )
        self.flops_per_sample: float | None = None  # counted once, for modules not CountsFlops
        self.steady = _Totals()
        self.window = _Totals()
        self.windows: list[tuple[int, dict[str, float]]] = []  # (step, rates) per logging step
        self.batches = 0
        self._fit_start = self._batch_start = 0.0  # set by the hooks before any use
        self._last_end: float | None = None  # None: no training batch ended since the last wait
        self._data_wait = 0.0
        self.time_to_first_step: float | None = None
        self.effective_batch: dict[str, int] = {}
        self.batches_per_step = 1  # micro-batches x devices per optimizer step
        self.device = torch.device("cpu")
        self._warned_mfu = False

    # -- hooks -------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self.device = pl_module.device
        if self.peak is None:
            self.peak = device_peak(pl_module.device, dtype_of_precision(trainer.precision))

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._data_wait = now - self._last_end if self._last_end is not None else 0.0
        if not self.effective_batch:  # the first training batch: measured once
            if not isinstance(pl_module, CountsFlops):
                flops = measure_flops_per_batch(pl_module, batch)
                self.flops_per_sample = flops / batch_counts(batch)["samples"] if flops else None
            self._log_effective_batch(trainer, pl_module, batch)
        self._batch_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        should_log = is_logging_step(trainer)
        if should_log and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # only here, so the window's clock is exact
        self._last_end = end = time.perf_counter()
        step_time = end - self._batch_start
        self.batches += 1
        if self.time_to_first_step is None:
            self.time_to_first_step = end - self._fit_start
        counts = batch_counts(batch)
        if isinstance(pl_module, CountsFlops):
            counts["flops"] = pl_module.flops_per_batch(batch)
        elif self.flops_per_sample:
            counts["flops"] = self.flops_per_sample * counts["samples"]
        self.window.add(counts, step_time, self._data_wait)
        if self.batches > self.warmup_steps:
            self.steady.add(counts, step_time, self._data_wait)
            self.step_times.append(step_time)
        if should_log:
            metrics = self._without_impossible_mfu(self.window.rates(trainer.world_size))
            self.windows.append((trainer.global_step, metrics))
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            self.window = _Totals()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None  # the wait for the next training batch is not a data wait

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for key, value in self.summary(trainer.world_size).items():
            # Rank 0's per-device figures. No collective: ranks may hold different sets of keys
            # (e.g. one has no FLOP count yet), and mismatched all-reduces would hang.
            pl_module.log(key, value, on_step=False, on_epoch=True, rank_zero_only=True)

    # -- results -----------------------------------------------------------------------------

    def summary(self, world_size: int = 1) -> dict[str, float]:
        """Steady-state figures so far (cumulative rates; step-time percentiles in ms)."""
        totals = self.steady if self.steady.batches else self.window
        metrics = self._without_impossible_mfu(totals.rates(world_size))
        if self.step_times:
            ordered = sorted(self.step_times)
            metrics["perf/step_time_p50_ms"] = 1e3 * statistics.median(ordered)
            metrics["perf/step_time_p90_ms"] = 1e3 * ordered[int(0.9 * (len(ordered) - 1))]
        if self.time_to_first_step is not None:
            metrics["perf/time_to_first_step_s"] = self.time_to_first_step
        if "perf/real_tokens_per_batch" in metrics and self.effective_batch:
            # Real (non-padding) tokens per optimizer step, over every device and micro-batch.
            metrics["perf/effective_batch_real_tokens"] = (
                metrics["perf/real_tokens_per_batch"] * self.batches_per_step
            )
        if self.device.type == "cuda":
            # Weights, gradients, optimizer states and activations at their peak on this GPU.
            metrics["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return {**metrics, **self.effective_batch}

    def _without_impossible_mfu(self, metrics: dict[str, float]) -> dict[str, float]:
        """`metrics` with `perf/mfu` against the peak, unless it exceeds 1.

        Above 1 the peak is wrong (e.g. measured while the machine was busy), and a wrong MFU is
        worse than none.
        """
        if self.peak is None or "perf/flops_per_s" not in metrics:
            return metrics
        mfu = metrics["perf/flops_per_s"] / self.peak.flops
        if mfu <= 1.0:
            return {**metrics, "perf/mfu": mfu}
        if not self._warned_mfu:
            rank_zero_warn(
                f"perf/mfu came out at {mfu:.2f}, above 1: the peak of "
                f"{self.peak.flops / 1e9:,.1f} GFLOP/s ({self.peak.source}) is too low for this "
                f"machine, so MFU is not reported. Set callbacks.throughput.peak_flops=<FLOP/s>."
            )
            self._warned_mfu = True
        return metrics

    def _log_effective_batch(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any
    ) -> None:
        counts = batch_counts(batch)
        per_step = trainer.accumulate_grad_batches * trainer.world_size
        message = (
            f"Effective batch: {counts['samples'] * per_step} samples per optimizer step "
            f"({counts['samples']} per device x {trainer.world_size} devices x "
            f"{trainer.accumulate_grad_batches} accumulation)"
        )
        if "tokens" in counts:
            message += f", {counts['tokens'] * per_step} token slots"
        rank_zero_info(message)
        self.batches_per_step = per_step
        self.effective_batch["perf/effective_batch_samples"] = counts["samples"] * per_step
        if "tokens" in counts:
            self.effective_batch["perf/effective_batch_tokens"] = counts["tokens"] * per_step


class _Totals:
    """Running sums over a span of training batches."""

    def __init__(self):
        self.batches = 0
        self.samples = 0
        self.tokens = 0
        self.real_tokens: Any = 0
        self.supervised_tokens: Any = 0
        self.documents: Any = 0
        self.flops: Any = 0
        self.has_tokens = self.has_supervised = self.has_documents = self.has_flops = False
        self.step_time = 0.0
        self.data_wait = 0.0

    def add(self, counts: dict[str, Any], step_time: float, data_wait: float) -> None:
        self.batches += 1
        self.samples += counts["samples"]
        self.step_time += step_time
        self.data_wait += data_wait
        if counts.get("flops") is not None:
            self.has_flops = True
            self.flops = self.flops + counts["flops"]
        if "tokens" in counts:
            self.has_tokens = True
            self.tokens += counts["tokens"]
            self.real_tokens = self.real_tokens + counts["real_tokens"]
            if counts["supervised_tokens"] is not None:
                self.has_supervised = True
                self.supervised_tokens = self.supervised_tokens + counts["supervised_tokens"]
            if "documents" in counts:
                self.has_documents = True
                self.documents = self.documents + counts["documents"]

    def rates(self, world_size: int) -> dict[str, float]:
        """Per-device rates over the span (host time of steps plus the waits between them)."""
        elapsed = self.step_time + self.data_wait
        if not self.batches or elapsed <= 0:
            return {}
        metrics = {
            "perf/samples_per_s": self.samples / elapsed,
            "perf/steps_per_s": self.batches / elapsed,
            "perf/data_wait_fraction": self.data_wait / elapsed,
        }
        if world_size > 1:
            metrics["perf/global_samples_per_s"] = world_size * self.samples / elapsed
        if self.has_tokens:
            real = float(self.real_tokens)
            metrics["perf/tokens_per_s"] = self.tokens / elapsed
            metrics["perf/real_tokens_per_s"] = real / elapsed
            metrics["perf/padding_fraction"] = 1.0 - real / self.tokens
            metrics["perf/real_tokens_per_batch"] = real / self.batches
            if self.has_supervised:
                metrics["perf/supervised_tokens_per_s"] = float(self.supervised_tokens) / elapsed
            if self.has_documents:
                metrics["perf/documents_per_row"] = float(self.documents) / self.samples
        if self.has_flops:
            flops_per_s = float(self.flops) / elapsed
            metrics["perf/flops_per_s"] = flops_per_s
        return metrics


def measure_flops_per_batch(pl_module: LightningModule, batch: Any) -> float | None:
    """Training FLOPs of one batch: the module's own estimate, else 3x a counted forward pass.

    The forward pass runs on the meta device (no compute, no memory, no random numbers drawn)
    and eagerly even when the network is compiled, so measuring changes nothing else.
    Backward costs about twice the forward, hence the factor 3.
    """
    if isinstance(pl_module, CountsFlops):
        return pl_module.flops_per_batch(batch)
    if not isinstance(batch, list | tuple):
        return None
    tensors = {**dict(pl_module.named_parameters()), **dict(pl_module.named_buffers())}
    meta = {name: tensor.to("meta") for name, tensor in tensors.items()}
    inputs = batch[0].to("meta")
    was_training = pl_module.training
    pl_module.eval()
    try:
        with (
            torch.compiler.set_stance("force_eager"),
            FlopCounterMode(display=False) as counter,
            torch.no_grad(),
        ):
            torch.func.functional_call(pl_module, meta, (inputs,), strict=False)
    except Exception as error:  # noqa: BLE001 - MFU is optional; never fail a run over it
        log.warning("Could not count FLOPs of %s: %s", type(pl_module).__name__, error)
        return None
    finally:
        pl_module.train(was_training)
    return 3.0 * counter.get_total_flops()

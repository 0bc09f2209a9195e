"""The device's peak FLOP/s, the denominator of model FLOPs utilisation (MFU).

GPUs: dense (not "with sparsity") datasheet peaks per dtype, looked up by the exact device name,
since one name can be a prefix of another SKU's (an "H100 PCIe" is not an "H100 SXM"). Devices
not listed here fall back to Lightning's table, except the families where that table holds sparse
peaks; a device with no known peak gets no MFU rather than a wrong one. CPUs: no datasheet covers
them, so the peak is measured once by a short matmul probe and cached per machine (host, CPU
model, cores, threads), dtype and torch version: two machines with the same CPU model can differ
severalfold (shared hosts, power limits), so a probe is never reused on another one.
"""

import json
import logging
import os
import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.utilities import rank_zero_only

from src.utils.hardware import cpu_name

log = logging.getLogger(__name__)

CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    "pytorch-template/peak_flops.json"
)

CPU = torch.device("cpu")
TF32 = "tfloat32"  # fp32 matmuls on tensor cores: Lightning's key, torch has no such dtype


def _peaks(half: float, tf32: float, fp32: float) -> dict[torch.dtype | str, float]:
    return {torch.bfloat16: half, torch.float16: half, TF32: tf32, torch.float32: fp32}


# Dense tensor-core peaks in FLOP/s (bf16 and fp16 with fp32 accumulation, tf32) and the fp32
# (non-tensor) peak, keyed by `torch.cuda.get_device_name()` lower-cased. Where a datasheet gives
# only the "with sparsity" figure, the dense one is half of it.
_H100_SXM = _peaks(989.4e12, 494.7e12, 66.9e12)  # NVIDIA H100 Tensor Core GPU whitepaper
_H100_PCIE = _peaks(756.5e12, 378e12, 51.2e12)  # H100 whitepaper
_H100_NVL = _peaks(835.5e12, 417.5e12, 60e12)  # H100 datasheet: 1,671 / 835 TF with sparsity
_H200_SXM = _peaks(989.5e12, 494.5e12, 67e12)  # H200 datasheet: 1,979 / 989 TF with sparsity
_H200_NVL = _peaks(835.5e12, 417.5e12, 60e12)  # H200 datasheet: 1,671 / 835 TF with sparsity
_A100 = _peaks(312e12, 156e12, 19.5e12)  # A100 datasheet: the same for SXM/PCIe, 40/80GB
_L4 = _peaks(121e12, 60e12, 30.3e12)  # L4 datasheet: 242 / 120 TF with sparsity
_L40 = _peaks(181.05e12, 90.5e12, 90.5e12)  # L40 datasheet (dense | sparse columns)
_L40S = _peaks(362.05e12, 183e12, 91.6e12)  # L40S datasheet (dense | sparse columns)
_A10 = _peaks(125e12, 62.5e12, 31.2e12)  # A10 datasheet (dense | sparse columns)
_RTX_4090 = _peaks(165.2e12, 82.6e12, 82.6e12)  # Ada architecture whitepaper, appendix
DENSE_GPU_PEAKS: dict[str, dict[torch.dtype | str, float]] = {
    "nvidia h100 80gb hbm3": _H100_SXM,
    "nvidia h100 pcie": _H100_PCIE,
    "nvidia h100 nvl": _H100_NVL,
    "nvidia h200": _H200_SXM,
    "nvidia h200 nvl": _H200_NVL,
    "nvidia a100-sxm4-40gb": _A100,
    "nvidia a100-sxm4-80gb": _A100,
    "nvidia a100-pcie-40gb": _A100,
    "nvidia a100 80gb pcie": _A100,
    "nvidia l4": _L4,
    "nvidia l40": _L40,
    "nvidia l40s": _L40S,
    "nvidia a10": _A10,
    "nvidia geforce rtx 4090": _RTX_4090,
}
# Families whose entries in Lightning's table are "with sparsity" figures: an unlisted SKU of
# these gets no peak rather than twice the true one.
_LIGHTNING_SPARSE = ("h200", "h100 nvl")


def dtype_of_precision(precision: str | int | None) -> torch.dtype:
    """The dtype matrix multiplies run in under a Lightning `precision` setting."""
    text = str(precision)
    if text.startswith("bf16"):
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    return torch.float32


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s and where the figure comes from (recorded in metrics.json)."""

    flops: float
    source: str


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak | None:
    """Peak FLOP/s of `device` for matmuls in `dtype`; None (and one info line) when unknown."""
    if device.type == "cpu":
        return Peak(cpu_peak_flops(dtype), f"matmul probe of {cpu_name()} ({dtype})")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    if device.type == "cuda":
        if (peak := gpu_peak_flops(name, dtype)) is not None:
            return Peak(peak, f"{name} datasheet, dense {dtype}")
        if not any(family in name.lower() for family in _LIGHTNING_SPARSE):
            with warnings.catch_warnings():  # its "FLOPs not found" warning: the line below says it
                warnings.simplefilter("ignore")
                if (peak := get_available_flops(device, dtype)) is not None:
                    return Peak(peak, f"{name}, Lightning's table ({dtype})")
    # Every rank asks; one line says it.
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # set by Lightning on the function
        log.info("No peak FLOP/s known for %r in %s: perf/mfu is not logged", name, dtype)
    return None


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of the GPU called `name` (as CUDA reports it) in `dtype`, if listed."""
    peaks = DENSE_GPU_PEAKS.get(name.strip().lower())
    if peaks is None:
        return None
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return peaks[TF32]  # every listed GPU is Ampere or later: fp32 matmuls run as tf32
    return peaks.get(dtype)


def cpu_peak_flops(dtype: torch.dtype, cache_file: Path = CACHE_FILE) -> float:
    """Measured CPU matmul peak in FLOP/s, cached on disk after the first measurement."""
    key = "|".join([
        platform.node(), cpu_name(), f"cores={os.cpu_count()}",
        f"threads={torch.get_num_threads()}", str(dtype), f"torch={torch.__version__}",
    ])  # fmt: skip
    cache = _read_cache(cache_file)
    if key not in cache:
        cache[key] = measure_matmul_flops(dtype)
        log.info(
            "Measured CPU peak: %.1f GFLOP/s (%s); cached in %s", cache[key] / 1e9, key, cache_file
        )
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            cache_file.write_text(json.dumps(cache, indent=2))
        except OSError as error:  # a read-only home must not stop training
            log.warning("Could not cache the CPU peak in %s: %s", cache_file, error)
    return cache[key]


def measure_matmul_flops(
    dtype: torch.dtype,
    size: int = 1024,
    seconds: float = 0.3,
    device: torch.device = CPU,
) -> float:
    """Measure the best FLOP/s of repeated square matmuls on `device`, after one warm-up."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    torch.mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work, so that a clock read after it covers that work.

    CUDA runs kernels asynchronously: without the wait a clock times only their launch.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _read_cache(cache_file: Path) -> dict[str, float]:
    try:
        return json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}

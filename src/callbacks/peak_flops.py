"""The device's peak FLOP/s, the denominator of model FLOPs utilisation (MFU).

GPUs: dense (not "with sparsity") datasheet peaks, since Lightning's table lists some recent
GPUs at their sparse peak. CPUs: no datasheet covers them, so the peak is measured once by a
short matmul probe and cached per CPU model, thread count, dtype and torch version.
"""

import json
import logging
import os
import platform
import time
from pathlib import Path

import torch
from lightning.fabric.utilities.throughput import get_available_flops

log = logging.getLogger(__name__)

CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    "pytorch-template/peak_flops.json"
)

# Dense bf16/fp16 tensor-core peaks in FLOP/s, matched by substring of the device name.
DENSE_GPU_PEAKS = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
}


def dtype_of_precision(precision: str | int | None) -> torch.dtype:
    """The dtype matrix multiplies run in under a Lightning `precision` setting."""
    text = str(precision)
    if text.startswith("bf16"):
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    return torch.float32


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of `device` for matmuls in `dtype`; None when unknown."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if dtype in (torch.bfloat16, torch.float16):
            for key, value in DENSE_GPU_PEAKS.items():
                if key in name:
                    return value
        return get_available_flops(device, dtype)
    if device.type == "cpu":
        return cpu_peak_flops(dtype)
    return None


def cpu_peak_flops(dtype: torch.dtype, cache_file: Path = CACHE_FILE) -> float:
    """Measured CPU matmul peak in FLOP/s, cached on disk after the first measurement."""
    key = f"{cpu_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"
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


def measure_matmul_flops(dtype: torch.dtype, size: int = 1024, seconds: float = 0.3) -> float:
    """Best FLOP/s over repeated square matmuls, after one warm-up."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def cpu_name() -> str:
    """The CPU model as the OS reports it (falls back to the architecture)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache(cache_file: Path) -> dict[str, float]:
    try:
        return json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}

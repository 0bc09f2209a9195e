"""What this machine's devices compute natively, and the training precision that follows.

bf16 runs on dedicated units where a device has them: NVIDIA GPUs from Ampere (compute 8.0)
on, AMD GPUs, and x86 CPUs with AVX-512 BF16 (Cooper Lake, Zen 4) or AMX (Sapphire Rapids).
Elsewhere it is emulated: on a CPU without those units bf16-mixed trains about 3x slower than
fp32, and older GPUs have fp16 tensor cores instead. `scripts/check_env.py` and
`trainer.precision=auto` both decide with `machine_precision`, so they agree.
"""

import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
# x86 flags of native bf16 arithmetic -> the units' name, the faster first.
CPU_BF16_UNITS = {"amx_bf16": "AMX", "avx512_bf16": "AVX-512 BF16"}


@dataclass(frozen=True)
class PrecisionChoice:
    """A Lightning `precision` value and why it suits the device."""

    precision: str
    reason: str


def cpuinfo_field(name: str, cpuinfo: Path = CPUINFO) -> str | None:
    """The first `name` field of /proc/cpuinfo (None off Linux or when absent)."""
    if platform.system() != "Linux" or not cpuinfo.is_file():
        return None
    for line in cpuinfo.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_name() -> str:
    """The CPU model as the OS reports it (falls back to the architecture)."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def read_cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The CPU's x86 feature flags (None where there are none to read: not Linux, not x86)."""
    flags = cpuinfo_field("flags", cpuinfo)
    return None if flags is None else frozenset(flags.split())


def cpu_bf16_units(flags: Iterable[str]) -> str | None:
    """The name of the native bf16 units among a CPU's `flags` (None without any)."""
    present = set(flags)
    return next((units for flag, units in CPU_BF16_UNITS.items() if flag in present), None)


def gpu_computes_bf16(index: int) -> bool:
    """Tell whether CUDA device `index` has bf16 units (any ROCm GPU, NVIDIA from compute 8.0).

    This is torch.cuda.is_bf16_supported's test, for any device rather than the current one, and
    without the emulation that it also counts as support.
    """
    return bool(torch.version.hip) or torch.cuda.get_device_capability(index) >= (8, 0)


def native_precision(
    device_type: str, gpus_bf16: Sequence[bool] = (), cpu_flags: Iterable[str] | None = None
) -> PrecisionChoice:
    """Pick the fastest precision that `device_type` ("cuda", "mps", "cpu") computes natively.

    `gpus_bf16` says whether each GPU has bf16 units; `cpu_flags` are the CPU's (None: unknown).
    """
    if device_type == "cuda":
        if all(gpus_bf16):
            return PrecisionChoice("bf16-mixed", "the GPU has bf16 units")
        return PrecisionChoice("16-mixed", "the GPU has fp16 but no bf16 units (before Ampere)")
    if device_type == "mps":
        # Autocast on Apple GPUs depends on the macOS version and is not tested here.
        return PrecisionChoice("32-true", "Apple GPU (MPS): mixed precision is opt-in there")
    if device_type != "cpu":
        return PrecisionChoice("32-true", f"no native-precision check for {device_type}")
    if cpu_flags is None:
        return PrecisionChoice("32-true", "the CPU's bf16 support cannot be read on this platform")
    if units := cpu_bf16_units(cpu_flags):
        return PrecisionChoice("bf16-mixed", f"the CPU has {units} bf16 units")
    return PrecisionChoice(
        "32-true", "the CPU has no AMX or AVX-512 BF16 units: bf16 would be emulated, ~3x slower"
    )


def device_type_of(accelerator: str) -> str:
    """Return the device type that a Lightning `accelerator` setting trains on here.

    "auto" and "gpu" pick MPS, else CUDA (else, for "auto", the CPU), in Lightning's order; other
    names are kept.
    """
    name = accelerator.lower()
    if name not in ("auto", "gpu"):
        return name
    if torch.backends.mps.is_available():
        return "mps"
    if torch.cuda.is_available() or name == "gpu":
        return "cuda"
    return "cpu"


def machine_precision(accelerator: str) -> PrecisionChoice:
    """`native_precision` of the device that `accelerator` trains on, on this machine."""
    device_type = device_type_of(accelerator)
    gpus = range(torch.cuda.device_count()) if device_type == "cuda" else ()
    return native_precision(device_type, [gpu_computes_bf16(i) for i in gpus], read_cpu_flags())

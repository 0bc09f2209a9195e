"""Check this machine for the template: `python scripts/check_env.py` (or `make check-env`).

Prints the versions that matter, the GPUs and the CPU (with whether it computes bf16 natively),
which optional kernels import, and the `trainer=` and `trainer.precision=` to train with here:
the precision that `trainer.precision=auto` picks on this machine (src/utils/hardware.py).
Nothing at module level needs torch (or the project, which imports it), so a broken install
still gets a clear message.
"""

import importlib
import os
import platform
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from src.utils.hardware import PrecisionChoice

PACKAGES = {
    "torchvision": "torchvision",
    "Lightning": "lightning",
    "Hydra": "hydra-core",
}
# Import name -> what to install: the fused kernels the Qwen-style models use when present.
OPTIONAL_KERNELS = {
    "fla": "fla-core",  # flash-linear-attention's ops; or pip install -e ".[gpu]"
    "causal_conv1d": "causal-conv1d",
    "triton": "triton",
}


@dataclass
class GPU:
    name: str
    memory_gib: float
    capability: tuple[int, int]


@dataclass
class CPU:
    model: str
    cores: int
    flags: frozenset[str] | None  # None: unknown on this platform
    bf16_units: str | None  # e.g. "AMX"; None without (or unknown)


def package_versions() -> dict[str, str | None]:
    """Python's, torch's (with its build, e.g. +cu124) and each package's installed version
    (None when not installed)."""
    import torch

    versions = {"Python": platform.python_version(), "torch": torch.__version__}
    for label, distribution in PACKAGES.items():
        try:
            versions[label] = version(distribution)
        except PackageNotFoundError:
            versions[label] = None
    return versions


def cuda_gpus() -> list[GPU]:
    """The CUDA devices torch can use (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        memory_gib, capability = props.total_memory / 2**30, (props.major, props.minor)
        gpus.append(GPU(props.name, memory_gib, capability))
    return gpus


def cpu_info() -> CPU:
    """The CPU's model, core count, feature flags and native bf16 units."""
    from src.utils.hardware import cpu_bf16_units, cpu_name, read_cpu_flags

    flags = read_cpu_flags()
    return CPU(cpu_name(), os.cpu_count() or 1, flags, cpu_bf16_units(flags or ()))


def optional_kernels() -> dict[str, str | None]:
    """Each optional kernel module: None when it imports, else why not."""
    status = {}
    for module in OPTIONAL_KERNELS:
        try:
            importlib.import_module(module)
            status[module] = None
        except ModuleNotFoundError as error:
            status[module] = "not installed" if error.name == module else _reason(error)
        except Exception as error:  # noqa: BLE001 - a broken build fails with anything
            status[module] = _reason(error)
    return status


def _reason(error: Exception) -> str:
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:100] if lines else ''}"


def recommendation(gpus: list[GPU]) -> tuple[str, "PrecisionChoice"]:
    """Pick the `trainer=` config for this machine, and the precision (with the reason) that
    `trainer.precision=auto` resolves to under it."""
    from src.utils.hardware import machine_precision

    trainer = ("ddp" if len(gpus) > 1 else "gpu") if gpus else "cpu"
    return trainer, machine_precision("gpu" if gpus else "cpu")


def print_report(
    versions: dict[str, str | None],
    gpus: list[GPU],
    cpu: CPU,
    kernels: dict[str, str | None],
) -> None:
    """Print everything found, then the verdict."""
    print("Versions")
    for label, installed in versions.items():
        print(f"  {label:<12} {installed or 'not installed'}")
    print(f"CUDA: {'available' if gpus else 'not available'}")
    for index, gpu in enumerate(gpus):
        major, minor = gpu.capability
        print(f"  cuda:{index} {gpu.name}, {gpu.memory_gib:.1f} GiB, compute {major}.{minor}")
    bf16 = "unknown" if cpu.flags is None else "yes" if cpu.bf16_units else "no"
    print(f"CPU: {cpu.model}, {cpu.cores} cores, native bf16 (AVX-512 BF16 / AMX): {bf16}")
    print("Optional kernels")
    for module, problem in kernels.items():
        state = "importable" if problem is None else f"{problem} (pip: {OPTIONAL_KERNELS[module]})"
        print(f"  {module:<14} {state}")
    trainer, precision = recommendation(gpus)
    print(f"Precision: {precision.precision} ({precision.reason}): what auto picks here")
    print(f"Verdict: python train.py trainer={trainer} trainer.precision={precision.precision}")


def main() -> int:
    try:
        import torch  # noqa: F401
    except ImportError as error:
        print(
            f"Error: PyTorch cannot be imported ({error}). Install the project with "
            f"`make install`, or `pip install -e '.[dev]'` in the environment you run this in.",
            file=sys.stderr,
        )
        return 1
    from src.utils.error_boundary import exit_in_one_line  # the project, importable with torch

    exit_in_one_line(
        lambda: print_report(package_versions(), cuda_gpus(), cpu_info(), optional_kernels())
    )()
    return 0


if __name__ == "__main__":
    sys.exit(main())

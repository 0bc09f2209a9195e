"""Check this machine for the template: `python scripts/check_env.py` (or `make check-env`).

Prints the versions that matter, the GPUs and the CPU (with whether it computes bf16 natively),
which optional kernels import, and the `trainer=` and `trainer.precision=` to train with here.
Nothing at module level needs torch, so a broken install still gets a clear message.
"""

import importlib
import os
import platform
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

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
# x86 flags of native bf16 arithmetic (Cooper Lake / Sapphire Rapids and later, Zen 4).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass
class GPU:
    name: str
    memory_gib: float
    capability: tuple[int, int]


@dataclass
class CPU:
    model: str
    cores: int
    fast_bf16: bool | None  # None: unknown on this platform


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
        gpus.append(GPU(props.name, props.total_memory / 2**30, (props.major, props.minor)))
    return gpus


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CPU:
    """The CPU's model and core count, and whether its flags include native bf16 arithmetic."""
    model = platform.processor() or platform.machine()
    flags = None
    if platform.system() == "Linux" and cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags" and flags is None:
                flags = set(value.split())
    fast_bf16 = None if flags is None else any(flag in flags for flag in BF16_FLAGS)
    return CPU(model, os.cpu_count() or 1, fast_bf16)


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


def recommendation(gpus: list[GPU], cpu: CPU) -> tuple[str, str]:
    """The `trainer=` config and `trainer.precision` that suit this machine."""
    if gpus:
        trainer = "ddp" if len(gpus) > 1 else "gpu"
        all_bf16 = all(gpu.capability >= (8, 0) for gpu in gpus)  # Ampere and later
        return trainer, "bf16-mixed" if all_bf16 else "16-mixed"
    return "cpu", "bf16-mixed" if cpu.fast_bf16 else "32-true"


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
    bf16 = {True: "yes", False: "no", None: "unknown"}[cpu.fast_bf16]
    print(f"CPU: {cpu.model}, {cpu.cores} cores, native bf16 (AVX-512 BF16 / AMX): {bf16}")
    print("Optional kernels")
    for module, problem in kernels.items():
        state = "importable" if problem is None else f"{problem} (pip: {OPTIONAL_KERNELS[module]})"
        print(f"  {module:<14} {state}")
    trainer, precision = recommendation(gpus, cpu)
    print(f"Verdict: python train.py trainer={trainer} trainer.precision={precision}")


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
    print_report(package_versions(), cuda_gpus(), cpu_info(), optional_kernels())
    return 0


if __name__ == "__main__":
    sys.exit(main())

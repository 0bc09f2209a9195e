"""scripts/check_env.py as users run it: what it reports about this machine (compared with what
this test finds for itself), its verdict (the precision `trainer.precision=auto` picks here), and
a Python without torch."""

import os
import platform
import re
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch

from src.utils.hardware import cpuinfo_field, machine_precision
from tests.helpers import run_script

SCRIPT = "scripts/check_env.py"


@pytest.fixture(scope="module")
def report() -> list[str]:
    return run_script(SCRIPT, timeout=120).stdout.splitlines()


def section(report: list[str], title: str) -> dict[str, str]:
    """The indented `name  value` lines under the line `title`, in order."""
    start = report.index(title) + 1
    entries = {}
    for line in report[start:]:
        if not line.startswith("  "):
            break
        name, value = line.split(maxsplit=1)
        entries[name] = value
    return entries


def native_cpu_bf16() -> bool | None:
    """Whether this CPU's flags include AVX-512 BF16 or AMX BF16 (None: no flags to read)."""
    flags = cpuinfo_field("flags")
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def test_versions_are_those_of_this_interpreter_and_its_packages(report):
    assert section(report, "Versions") == {
        "Python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": version("torchvision"),
        "Lightning": version("lightning"),
        "Hydra": version("hydra-core"),
    }


def test_cuda_devices_are_listed_with_memory_and_compute_capability(report):
    if not torch.cuda.is_available():
        assert "CUDA: not available" in report
        assert not [line for line in report if line.startswith("  cuda:")]
        return
    assert "CUDA: available" in report
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        line = (
            f"  cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB, "
            f"compute {props.major}.{props.minor}"
        )
        assert line in report, f"{line!r} not in:\n" + "\n".join(report)


def test_the_cpu_line_has_its_model_cores_and_bf16_support_from_cpuinfo(report):
    model = cpuinfo_field("model name") or platform.processor() or platform.machine()
    bf16 = {True: "yes", False: "no", None: "unknown"}[native_cpu_bf16()]
    expected = f"CPU: {model}, {os.cpu_count()} cores, native bf16 (AVX-512 BF16 / AMX): {bf16}"
    assert expected in report, f"{expected!r} not in:\n" + "\n".join(report)


def test_each_optional_kernel_is_reported_importable_or_with_what_to_install(report):
    kernels = section(report, "Optional kernels")
    install = {"fla": "fla-core", "causal_conv1d": "causal-conv1d", "triton": "triton"}
    assert list(kernels) == list(install)
    for module, package in install.items():
        # In a fresh interpreter, as the script runs: this one hides the GPU-only kernels from
        # transformers (tests/conftest.py).
        probe = f"import importlib.util as u, sys; sys.exit(u.find_spec({module!r}) is None)"
        found = subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0
        if not found:
            assert kernels[module] == f"not installed (pip: {package})"
        elif kernels[module] != "importable":  # installed but broken: the error, what to reinstall
            assert re.match(r"\w+: ", kernels[module]), kernels[module]
            assert kernels[module].endswith(f"(pip: {package})"), kernels[module]


def test_the_verdict_follows_the_gpus_then_the_cpus_bf16_support(report):
    capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    if capabilities:  # bf16 from Ampere (compute 8.0) on, on every GPU
        trainer = "ddp" if len(capabilities) > 1 else "gpu"
        precision = "bf16-mixed" if min(capabilities) >= (8, 0) else "16-mixed"
    else:
        trainer, precision = "cpu", "bf16-mixed" if native_cpu_bf16() else "32-true"
    assert report[-1] == f"Verdict: python train.py trainer={trainer} trainer.precision={precision}"


def test_the_advised_precision_is_what_trainer_precision_auto_picks_here(report):
    # The verdict's trainer: gpu or ddp on a CUDA machine, else cpu.
    choice = machine_precision("gpu" if torch.cuda.is_available() else "cpu")
    assert report[-2] == f"Precision: {choice.precision} ({choice.reason}): what auto picks here"
    assert report[-1].endswith(f" trainer.precision={choice.precision}")


def test_a_python_without_torch_gets_a_clear_message_and_a_non_zero_exit():
    # -S: no site-packages, so torch cannot be imported, as in an environment without it.
    result = run_script(SCRIPT, check=False, launcher=(sys.executable, "-S"), timeout=60)
    assert result.returncode == 1, result.stderr
    assert "Error: PyTorch cannot be imported (No module named 'torch')" in result.stderr
    assert "make install" in result.stderr
    assert "Traceback" not in result.stderr

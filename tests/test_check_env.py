"""scripts/check_env.py: what it finds on this machine, its advice, and a missing torch."""

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from scripts import check_env
from scripts.check_env import CPU, GPU
from tests.helpers import ROOT

SCRIPT = str(ROOT / "scripts" / "check_env.py")


def test_versions_name_python_and_every_package():
    versions = check_env.package_versions()
    assert list(versions) == ["Python", "torch", "torchvision", "Lightning", "Hydra"]
    assert versions["Python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["torch"] == torch.__version__


@pytest.mark.parametrize(
    ("flags", "fast_bf16"),
    [("fpu sse2 avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True), ("fpu avx2", False)],
)
def test_cpu_bf16_comes_from_the_cpuinfo_flags(tmp_path, monkeypatch, flags, fast_bf16):
    monkeypatch.setattr(check_env.platform, "system", lambda: "Linux")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: {flags}\n")
    cpu = check_env.cpu_info(cpuinfo)
    assert cpu == CPU("Test CPU 9000", cpu.cores, fast_bf16)
    assert cpu.cores >= 1


def test_cpu_bf16_is_unknown_off_linux(monkeypatch):
    monkeypatch.setattr(check_env.platform, "system", lambda: "Darwin")
    assert check_env.cpu_info().fast_bf16 is None


def test_gpus_are_listed_with_memory_and_compute_capability(monkeypatch):
    props = SimpleNamespace(name="Fake GPU", total_memory=80 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert check_env.cuda_gpus() == [GPU("Fake GPU", 80.0, (9, 0))] * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_env.cuda_gpus() == []


def test_optional_kernels_tell_missing_from_broken(tmp_path, monkeypatch):
    (tmp_path / "broken_kernel.py").write_text("raise RuntimeError('built for another CUDA')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    kernels = {"broken_kernel": "x", "absent_kernel_module": "y", "json": "z"}
    monkeypatch.setattr(check_env, "OPTIONAL_KERNELS", kernels)
    assert check_env.optional_kernels() == {
        "broken_kernel": "RuntimeError: built for another CUDA",
        "absent_kernel_module": "not installed",
        "json": None,
    }


@pytest.mark.parametrize(
    ("capabilities", "fast_cpu_bf16", "advice"),
    [
        ([], None, ("cpu", "32-true")),
        ([], False, ("cpu", "32-true")),
        ([], True, ("cpu", "bf16-mixed")),
        ([(8, 0)], False, ("gpu", "bf16-mixed")),
        ([(7, 5)], True, ("gpu", "16-mixed")),
        ([(9, 0), (9, 0)], None, ("ddp", "bf16-mixed")),
        ([(8, 6), (7, 0)], None, ("ddp", "16-mixed")),
    ],
)
def test_recommendation_follows_gpus_then_cpu_bf16(capabilities, fast_cpu_bf16, advice):
    gpus = [GPU("gpu", 16.0, capability) for capability in capabilities]
    assert check_env.recommendation(gpus, CPU("cpu", 2, fast_cpu_bf16)) == advice


def test_the_script_prints_everything_and_a_verdict():
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for section in ("Versions", "CUDA:", "CPU:", "Optional kernels", "fla", "causal_conv1d"):
        assert section in result.stdout, f"{section!r} missing from:\n{result.stdout}"
    verdict = r"Verdict: python train.py trainer=(cpu|gpu|ddp) trainer.precision=\S+"
    assert re.search(verdict, result.stdout), result.stdout


def test_without_torch_it_exits_non_zero_with_a_clear_message():
    blocked = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"runpy.run_path({SCRIPT!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True)
    assert result.returncode == 1
    assert "Error: PyTorch cannot be imported" in result.stderr
    assert "make install" in result.stderr and "Traceback" not in result.stderr

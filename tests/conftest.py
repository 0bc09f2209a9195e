import os
import shutil
import subprocess
import tempfile

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from src.utils.transformers_fallback import use_pytorch_kernels_in_transformers
from tests.helpers import ROOT, write_image_folder, write_mnist

# Before anything imports transformers' Qwen3-Next (the reference of the parity tests).
use_pytorch_kernels_in_transformers()


def pytest_configure(config):
    """Runs, downloads and caches of the tests (and of the processes they start) go to a
    temporary folder, never into the working tree's logs/ and data/."""
    if hasattr(config, "workerinput"):
        # A worker of `pytest -n`: it inherits the controller's folders, which the controller
        # alone removes and checks the working tree against once every worker is done.
        share_the_cores(int(config.workerinput["workercount"]))
        return
    config.outside_tree = tempfile.mkdtemp(prefix="tests-outputs-")
    os.environ["PROJECT_LOG_DIR"] = os.path.join(config.outside_tree, "logs")
    os.environ["PROJECT_DATA_DIR"] = os.path.join(config.outside_tree, "data")
    config.tree_before = working_tree_status()


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when the tests left anything new in the working tree."""
    config = session.config
    if not hasattr(config, "tree_before"):
        return
    shutil.rmtree(config.outside_tree, ignore_errors=True)
    left = sorted(working_tree_status() - config.tree_before)
    if left:
        print(f"\nThe tests wrote into the working tree: {', '.join(left)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def share_the_cores(workers: int) -> None:
    """Give this worker, and the processes its tests start, its share of the CPU cores: torch's
    default of one thread per core in every worker makes them thrash. The processes get the
    same count as the worker, so a run in a subprocess computes as the same run in-process."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def working_tree_status() -> set[str]:
    """`git status` of the working tree, ignored files included, caches and venv excepted."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    cache = ("__pycache__", ".pytest_cache", ".ruff_cache", ".venv/", ".egg-info")
    return {line for line in status if not any(part in line for part in cache)}


@pytest.fixture(autouse=True)
def _clear_hydra():
    yield
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory):
    """Folder holding a small learnable MNIST/raw (plain IDX files)."""
    return write_mnist(tmp_path_factory.mktemp("mnist"))


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("images"))

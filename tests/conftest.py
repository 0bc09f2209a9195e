import os
import shutil
import subprocess
import tempfile
from collections import Counter

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
    # pytest-xdist 3.8 would hand out the files with the most tests first: keep the order
    # pytest_collection_modifyitems sets (older versions keep it anyway).
    config.option.loadscopereorder = False
    config.outside_tree = tempfile.mkdtemp(prefix="tests-outputs-")
    os.environ["PROJECT_LOG_DIR"] = os.path.join(config.outside_tree, "logs")
    os.environ["PROJECT_DATA_DIR"] = os.path.join(config.outside_tree, "data")
    config.tree_before = working_tree_status()


# The slow suite's longest files, longest first (seconds of work on 2 cores, from `make test-slow
# ARGS=--durations=0`): 238, 220, 148, 125, 124, 100, 65, 56, 50, 47, 47, 47, 44.
LONGEST_FILES = (
    "tests/project/test_readme.py",
    "tests/run/test_distributed.py",
    "tests/checkpoints/test_resume.py",
    "tests/models/test_lora.py",
    "tests/checkpoints/test_chaos.py",
    "tests/scripts/test_gpu_check.py",
    "tests/run/test_optuna_search.py",
    "tests/run/test_expert_parallel.py",
    "tests/data/test_packing_ab.py",
    "tests/scripts/test_qwen_bench.py",
    "tests/models/test_kernels.py",
    "tests/scripts/test_bench.py",
    "tests/data/test_real_mnist.py",
)


def pytest_collection_modifyitems(items):
    """Longest files first, then those with the most tests.

    pytest-xdist hands out whole files in this order (`--dist loadfile`, see pytest_configure):
    short files fill the end of the run on both workers, where its own order (most tests first)
    left one worker alone with a 100-second file of one test.
    """
    tests_per_file = Counter(item.nodeid.split("::")[0] for item in items)

    def place(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        rank = LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)
        return rank, -tests_per_file[path]

    items.sort(key=place)  # stable: each file's tests keep their order


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

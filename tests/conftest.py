import pytest
from hydra.core.global_hydra import GlobalHydra

from src.utils.transformers_fallback import use_pytorch_kernels_in_transformers
from tests.helpers import write_image_folder, write_mnist

# Before anything imports transformers' Qwen3-Next (the reference of the parity tests).
use_pytorch_kernels_in_transformers()


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

"""The CNN on real MNIST digits: the first 8,000 test-set digits to train, the last 2,000 to test.

Needs `../shared/data/mnist-t10k` (or MNIST_T10K_DIR) with the two t10k IDX .gz files.
"""

import gzip
import os
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import FAST, ROOT, compose_config, write_idx_images, write_idx_labels
from train import train

T10K_DIR = Path(os.environ.get("MNIST_T10K_DIR", ROOT.parent / "shared" / "data" / "mnist-t10k"))


def read_idx(path: Path, header_ints: int) -> np.ndarray:
    with gzip.open(path, "rb") as file:
        data = file.read()
    return np.frombuffer(data, dtype=np.uint8, offset=4 * header_ints)


@pytest.fixture(scope="module")
def real_mnist_root(tmp_path_factory):
    images_gz = T10K_DIR / "t10k-images-idx3-ubyte.gz"
    if not images_gz.exists():
        pytest.skip(f"real MNIST digits not found at {T10K_DIR} (set MNIST_T10K_DIR)")
    images = read_idx(images_gz, 4).reshape(-1, 28, 28)
    labels = read_idx(T10K_DIR / "t10k-labels-idx1-ubyte.gz", 2)
    root = tmp_path_factory.mktemp("real_mnist")
    raw = root / "MNIST" / "raw"
    write_idx_images(raw / "train-images-idx3-ubyte", images[:8000])
    write_idx_labels(raw / "train-labels-idx1-ubyte", labels[:8000])
    write_idx_images(raw / "t10k-images-idx3-ubyte", images[8000:])
    write_idx_labels(raw / "t10k-labels-idx1-ubyte", labels[8000:])
    return root


@pytest.mark.slow
def test_cnn_reaches_97_percent_on_real_mnist_digits(tmp_path, real_mnist_root):
    cfg = compose_config(
        tmp_path,
        [
            "model=cnn",
            "data=mnist",
            f"data.data_dir={real_mnist_root}",
            "data.download=false",
            "data.val_fraction=0.05",
            *FAST,
            "trainer.max_epochs=4",
        ],
    )
    record = train(cfg)
    print(f"real MNIST test accuracy: {record['metrics']['test/acc']:.4f}")
    assert record["metrics"]["test/acc"] >= 0.97, record["metrics"]

"""The embedded default dataset: scikit-learn's bundled 8x8 handwritten digits (no download)."""

import gzip
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, random_split

from src.data.image.datamodule import ImageDataModule
from src.data.splits import check_fractions


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 images, shape [1797, 8, 8] with values 0 to 16, and their labels.

    Read from the file scikit-learn ships, as its `sklearn.datasets.load_digits` reads it, but
    without importing scikit-learn, which costs 0.5 s at start-up (pandas, joblib, scipy).
    """
    spec = find_spec("sklearn")  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "data=digits reads scikit-learn's digits: pip install scikit-learn"
        )
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, mode="rt", encoding="utf-8") as text:
        data = np.loadtxt(text, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


class DigitsDataModule(ImageDataModule):
    """1,797 real 8x8 grey-scale digits shipped inside scikit-learn, split train/val/test by seed.

    Images come out as float tensors of shape [1, 8, 8] scaled to [0, 1]; `transform` (by
    default a normalisation in `conf/data/digits.yaml`) is applied on top.
    """

    def __init__(self, test_fraction: float = 0.2, **kwargs):
        super().__init__(**kwargs)
        check_fractions(self.val_fraction, test_fraction)
        self.test_fraction = test_fraction

    def load_splits(self) -> dict[str, Dataset]:
        pixels, targets = load_digits()
        images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(targets, dtype=torch.long)
        fractions = [
            1.0 - self.val_fraction - self.test_fraction,
            self.val_fraction,
            self.test_fraction,
        ]
        generator = torch.Generator().manual_seed(self.split_seed)
        train, val, test = random_split(TensorDataset(images, labels), fractions, generator)
        return {"train": train, "val": val, "test": test}

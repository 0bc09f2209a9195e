"""The embedded default dataset: scikit-learn's bundled 8x8 handwritten digits (no download)."""

import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset, TensorDataset, random_split

from src.data.image.datamodule import ImageDataModule
from src.data.splits import check_fractions


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
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        fractions = [
            1.0 - self.val_fraction - self.test_fraction,
            self.val_fraction,
            self.test_fraction,
        ]
        generator = torch.Generator().manual_seed(self.split_seed)
        train, val, test = random_split(TensorDataset(images, labels), fractions, generator)
        return {"train": train, "val": val, "test": test}

"""A datamodule over users' own arrays: in-memory tensors, or a .npz / .pt file of them."""

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from src.data.image.datamodule import ImageDataModule
from src.data.splits import check_fractions, split_off
from src.utils.errors import ConfigError, DataError, MissingFileError

ARRAY_KEYS = "x and y (optionally x_val, y_val, x_test, y_test)"


class TensorDataModule(ImageDataModule):
    """Classify samples given as tensors: `x` of shape [N, *input_shape], integer labels `y`.

    Pass `x`/`y` directly (from Python) or `path` to a `.npz` (NumPy, no pickles) or `.pt`
    (loaded with `weights_only=True`) file holding arrays named x and y, and optionally
    x_val/y_val and x_test/y_test. Missing splits are split off the training arrays by seed.
    """

    def __init__(
        self,
        path: str | None = None,
        x: torch.Tensor | np.ndarray | None = None,
        y: torch.Tensor | np.ndarray | None = None,
        test_fraction: float = 0.1,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if (path is None) == (x is None or y is None):
            raise ConfigError("TensorDataModule needs either data.path=<file> or both x and y.")
        self.path = path
        self.arrays = {"x": x, "y": y} if path is None else None
        check_fractions(self.val_fraction, test_fraction)
        self.test_fraction = test_fraction

    def load_splits(self) -> dict[str, Dataset]:
        arrays: Mapping[str, torch.Tensor | np.ndarray | None]
        if self.arrays is not None:
            arrays = self.arrays
        else:
            assert self.path is not None  # __init__ keeps no arrays only when a path is given
            arrays = load_arrays(Path(self.path))
        check_finite(arrays, "the arrays given" if self.path is None else f"data.path={self.path}")
        given = _tensor_dataset(arrays, "x", "y")
        assert given is not None  # __init__ and load_arrays make sure that x and y are there
        train: Dataset = given
        test: Dataset | None = _tensor_dataset(arrays, "x_test", "y_test")
        if test is None:
            train, test = split_off(train, self.test_fraction, self.split_seed)
        val: Dataset | None = _tensor_dataset(arrays, "x_val", "y_val")
        if val is None:
            train, val = split_off(train, self.val_fraction, self.split_seed)
        return {"train": train, "val": val, "test": test}


def load_arrays(path: Path) -> dict[str, torch.Tensor]:
    """Read named arrays from a .npz or .pt file without ever unpickling objects."""
    if not path.is_file():
        raise MissingFileError(f"data.path={str(path)!r} does not exist.")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            try:
                arrays = {key: torch.from_numpy(archive[key]) for key in archive.files}
            except ValueError as error:  # object arrays need unpickling, which could run code
                raise DataError(
                    f"{path} holds arrays of Python objects ({error}); only numeric arrays "
                    f"are read (allow_pickle is never enabled)."
                ) from None
    elif path.suffix in (".pt", ".pth"):
        arrays = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"data.path must be a .npz or .pt file, got {path.name!r}.")
    if not isinstance(arrays, dict) or "x" not in arrays or "y" not in arrays:
        raise DataError(f"{path} must hold a mapping with arrays named {ARRAY_KEYS}.")
    return arrays


def check_finite(arrays: Mapping[str, torch.Tensor | np.ndarray | None], source: str) -> None:
    """Refuse samples holding NaN or Inf: a model trained on them reports a NaN loss."""
    for key in ("x", "x_val", "x_test"):
        if arrays.get(key) is None:
            continue
        x = torch.as_tensor(arrays[key])
        if not x.is_floating_point():
            continue
        finite = torch.isfinite(x)
        bad = ~(finite.flatten(1).all(1) if x.ndim > 1 else finite)
        if bad.any():
            first = int(bad.nonzero()[0, 0])
            raise DataError(
                f"{source}: {key} holds NaN or Inf in {int(bad.sum())} of its {len(x)} samples "
                f"(the first is sample {first}); fix or leave out those samples."
            )


def _tensor_dataset(
    arrays: Mapping[str, torch.Tensor | np.ndarray | None], x_key: str, y_key: str
) -> TensorDataset | None:
    if arrays.get(x_key) is None:
        return None
    x, y = torch.as_tensor(arrays[x_key]), torch.as_tensor(arrays[y_key]).long()
    if len(x) != len(y):
        raise DataError(f"{x_key} has {len(x)} samples but {y_key} has {len(y)}.")
    return TensorDataset(x, y)

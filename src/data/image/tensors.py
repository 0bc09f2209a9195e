"""A datamodule over users' own arrays: in-memory tensors, or a .npz / .pt file of them.

The arrays are checked where they enter, so that a wrong dtype, shape, key or label is named
for what it is instead of failing deep inside a layer or the loss.
"""

import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from src.data.image.datamodule import ImageDataModule
from src.data.splits import check_fractions, split_off
from src.utils.errors import ConfigError, DataError, MissingFileError, first_line

ARRAY_KEYS = "x and y (optionally x_val, y_val, x_test, y_test)"
SPLIT_KEYS = {"": ("x", "y"), "val": ("x_val", "y_val"), "test": ("x_test", "y_test")}


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
        source = "the arrays given" if self.path is None else f"data.path={self.path}"
        splits = {
            split: checked_split(arrays, x_key, y_key, source, self.num_classes)
            for split, (x_key, y_key) in SPLIT_KEYS.items()
        }
        check_same_sample_shape(splits, source)
        check_finite(arrays, source)
        given = splits[""]
        assert given is not None  # __init__ and load_arrays make sure that x and y are there
        train: Dataset = TensorDataset(*given)
        test: Dataset | None = TensorDataset(*splits["test"]) if splits["test"] else None
        if test is None:
            train, test = split_off(train, self.test_fraction, self.split_seed)
        val: Dataset | None = TensorDataset(*splits["val"]) if splits["val"] else None
        if val is None:
            train, val = split_off(train, self.val_fraction, self.split_seed)
        return {"train": train, "val": val, "test": test}


def load_arrays(path: Path) -> dict[str, torch.Tensor]:
    """Read named arrays from a .npz or .pt file without ever unpickling objects."""
    if not path.is_file():
        raise MissingFileError(f"data.path={str(path)!r} does not exist.")
    arrays: object
    if path.suffix == ".npz":
        arrays = _read_npz(path)
    elif path.suffix in (".pt", ".pth"):
        arrays = _read_pt(path)
    else:
        raise ConfigError(f"data.path must be a .npz or .pt file, got {path.name!r}.")
    if not isinstance(arrays, dict) or "x" not in arrays or "y" not in arrays:
        found = (
            f"arrays named {', '.join(map(str, arrays))}"
            if isinstance(arrays, dict)
            else f"a {type(arrays).__name__}"
        )
        raise DataError(
            f"{path} must hold a mapping with arrays named {ARRAY_KEYS}; it holds {found}."
        )
    return arrays


def _read_npz(path: Path) -> dict[str, torch.Tensor]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {key: _numeric(path, key, archive) for key in archive.files}
    except (zipfile.BadZipFile, EOFError, OSError) as error:
        raise _unreadable(path, error) from None


def _numeric(path: Path, key: str, archive: Mapping[str, np.ndarray]) -> torch.Tensor:
    """One array of an .npz file as a tensor, refusing strings and Python objects."""
    try:
        array = archive[key]
    except ValueError as error:  # object arrays need unpickling, which could run code
        raise DataError(
            f"{path}: {key} holds Python objects ({error}); only numeric arrays are read "
            f"(allow_pickle is never enabled)."
        ) from None
    if array.dtype.kind in "USV":
        raise DataError(
            f"{path}: {key} holds {array.dtype} values (text?); store numbers, labels as integer "
            f"class indices 0..data.num_classes-1."
        )
    return torch.from_numpy(array)


def _read_pt(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise DataError(
            f"{path} holds pickled Python objects, not only tensors; unpickling them could run "
            f"code. Save a dict of tensors, or the arrays with numpy.savez as .npz."
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as error:
        raise _unreadable(path, error) from None


def _unreadable(path: Path, error: Exception) -> DataError:
    return DataError(
        f"data.path={path} is not a readable {path.suffix} file (truncated or corrupt: "
        f"{first_line(error)}). Write it again."
    )


def checked_split(
    arrays: Mapping[str, torch.Tensor | np.ndarray | None],
    x_key: str,
    y_key: str,
    source: str,
    num_classes: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A split's samples as float32 and its labels as class indices, or None when not given.

    Refuses what a model or the loss would fail on later: inputs that are not floating point,
    labels that are not one class index per sample in 0..num_classes-1.
    """
    x, y = arrays.get(x_key), arrays.get(y_key)
    if x is None and y is None:
        return None
    if x is None or y is None:
        given, missing = (x_key, y_key) if y is None else (y_key, x_key)
        raise DataError(f"{source} holds {given} but no {missing}: give both or neither.")
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.ndim < 2:
        raise DataError(
            f"{source}: {x_key} has shape {list(x.shape)}; it needs one sample per row, "
            f"shape [N, *data.input_shape]."
        )
    if not x.is_floating_point():
        raise DataError(
            f"{source}: {x_key} is {x.dtype}, and the models take floating-point inputs. Convert "
            f"it (8-bit images: x.astype('float32') / 255)."
        )
    if y.ndim != 1:
        hint = " (one-hot? store y.argmax(1))" if y.ndim == 2 and y.shape[1] > 1 else ""
        raise DataError(
            f"{source}: {y_key} has shape {list(y.shape)}; labels are one class index per "
            f"sample, shape [{len(y)}]{hint}."
        )
    if len(x) != len(y):
        raise DataError(f"{source}: {x_key} has {len(x)} samples but {y_key} has {len(y)}.")
    if y.is_floating_point() and not torch.equal(y, y.round()):
        first = int((y != y.round()).nonzero()[0, 0])
        raise DataError(
            f"{source}: {y_key} holds non-integer labels (sample {first} is {y[first].item()}); "
            f"labels are class indices 0..data.num_classes-1."
        )
    y = y.long()
    outside = (y < 0) | (y >= num_classes)
    if outside.any():
        first = int(outside.nonzero()[0, 0])
        fix = (
            "class indices start at 0: fix the labels"
            if y.min() < 0
            else f"set data.num_classes={y.max().item() + 1} or fix the labels"
        )
        raise DataError(
            f"{source}: {y_key} holds labels outside 0..{num_classes - 1} (sample {first} is "
            f"{y[first].item()}; they range from {y.min().item()} to {y.max().item()}): {fix}."
        )
    return x.float(), y


def check_same_sample_shape(
    splits: Mapping[str, tuple[torch.Tensor, torch.Tensor] | None], source: str
) -> None:
    """Refuse validation or test samples of another shape than the training ones."""
    train = splits[""]
    assert train is not None  # x and y are there: checked by __init__ and load_arrays
    for split, given in splits.items():
        if given is not None and given[0].shape[1:] != train[0].shape[1:]:
            raise DataError(
                f"{source}: x_{split} samples have shape {list(given[0].shape[1:])}, but x "
                f"samples {list(train[0].shape[1:])}: every split needs the same sample shape."
            )


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

"""MNIST and its drop-in siblings (Fashion-MNIST, KMNIST) through torchvision."""

import contextlib
import gzip
import io
import logging
import shutil
import zlib
from pathlib import Path

import torchvision
from torch.utils.data import Dataset, TensorDataset

from src.data.image.datamodule import ImageDataModule
from src.data.splits import split_off
from src.utils.errors import ConfigError, DataError, MissingFileError, first_line
from src.utils.files import write_atomically

log = logging.getLogger(__name__)

RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class MNISTDataModule(ImageDataModule):
    """A torchvision MNIST-format dataset read from `<data_dir>/<dataset>/raw`.

    The four IDX files may be plain or gzipped. Missing files are downloaded when `download`
    is true; without a network, a clear error says which files to put where.
    """

    def __init__(self, data_dir: str, dataset: str = "MNIST", download: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.data_dir = Path(data_dir)
        dataset_class = getattr(torchvision.datasets, dataset, None)
        if dataset_class is None or not hasattr(dataset_class, "resources"):
            raise ConfigError(
                f"data.dataset={dataset!r} is not an MNIST-format torchvision dataset; "
                f"use MNIST, FashionMNIST or KMNIST."
            )
        self.dataset_class: type[torchvision.datasets.MNIST] = dataset_class
        self.download = download

    @property
    def raw_folder(self) -> Path:
        return self.data_dir / self.dataset_class.__name__ / "raw"

    def prepare_data(self) -> None:
        """Make the raw files available: unpack .gz files that are there, else download."""
        for name in self._missing_files():
            gz = self.raw_folder / f"{name}.gz"
            if gz.exists():
                unpack(gz)
        if self._missing_files() and self.download:
            self._try_download()
        if missing := self._missing_files():
            raise MissingFileError(
                f"{self.dataset_class.__name__} files not found: {', '.join(missing)} "
                f"(plain or .gz) are expected in {self.raw_folder.resolve()}. Copy them there, "
                f"point data.data_dir at the folder that holds "
                f"{self.dataset_class.__name__}/raw, or run once with network access and "
                f"data.download=true."
            )

    def load_splits(self) -> dict[str, Dataset]:
        self.prepare_data()
        data = self._tensor_dataset(train=True)
        test = self._tensor_dataset(train=False)
        train, val = split_off(data, self.val_fraction, self.split_seed)
        return {"train": train, "val": val, "test": test}

    def _tensor_dataset(self, train: bool) -> TensorDataset:
        try:
            data = self.dataset_class(str(self.data_dir), train=train, download=False)
        except Exception as error:  # torchvision fails on bad files with a bare AssertionError
            raise DataError(
                f"The {self.dataset_class.__name__} files in {self.raw_folder} are not valid IDX "
                f"files ({type(error).__name__}: {error}). Delete them to download them again, "
                f"or replace them with intact copies."
            ) from error
        return TensorDataset(data.data.unsqueeze(1), data.targets)  # uint8 [N, 1, H, W]

    def _missing_files(self) -> list[str]:
        return [name for name in RAW_FILES if not (self.raw_folder / name).exists()]

    def _try_download(self) -> None:
        # torchvision prints one line per failed mirror; keep them for the error, not the console.
        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                self.dataset_class(str(self.data_dir), train=True, download=True)
        except Exception as error:  # noqa: BLE001 - any network failure means "not available"
            reason = first_line(error)
            log.warning("Could not download %s: %s", self.dataset_class.__name__, reason)


def unpack(gz: Path) -> None:
    """Unpack `<name>.gz` to `<name>` beside it, whole or not at all.

    A truncated archive is named, and leaves no partial file that a later run would take for the
    data.
    """

    def copy(file) -> None:
        with gzip.open(gz, "rb") as archive:
            shutil.copyfileobj(archive, file)

    try:
        write_atomically(gz.with_suffix(""), copy, what="dataset file")
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise DataError(
            f"{gz} is truncated or corrupt ({error}). Delete it to download it again, or "
            f"replace it with an intact copy."
        ) from None

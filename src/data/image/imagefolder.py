"""Any folder of class sub-folders (torchvision ImageFolder), with ImageNet-style transforms."""

from pathlib import Path

from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import find_classes

from src.data.image.datamodule import ImageDataModule
from src.data.splits import check_fractions, split_off
from src.utils.errors import DataError, MissingFileError


class ImageFolderDataModule(ImageDataModule):
    """Images in `<data_dir>/<class>/*.jpg`, or in `train/`, `val/` and `test/` sub-folders of it.

    With split sub-folders each is used as given (a missing `val/` is split off `train/`, a
    missing `test/` reuses `val/`); with a flat folder of classes, validation and test are split
    off by seed. Class indices follow the sorted sub-folder names, as in torchvision.
    """

    def __init__(self, data_dir: str, test_fraction: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.data_dir = Path(data_dir)
        check_fractions(self.val_fraction, test_fraction)
        self.test_fraction = test_fraction

    def load_splits(self) -> dict[str, Dataset]:
        check_is_folder(self.data_dir)
        train_dir = self.data_dir / "train"
        if not train_dir.is_dir():
            everything = self._image_folder(self.data_dir)
            rest, test = split_off(everything, self.test_fraction, self.split_seed)
            train, val = split_off(rest, self.val_fraction, self.split_seed)
            return {"train": train, "val": val, "test": test}
        train = self._image_folder(train_dir)
        classes = train.classes
        if (self.data_dir / "val").is_dir():
            val = self._image_folder(self.data_dir / "val", classes)
        else:
            train, val = split_off(train, self.val_fraction, self.split_seed)
        test_dir = self.data_dir / "test"
        test = self._image_folder(test_dir, classes) if test_dir.is_dir() else val
        return {"train": train, "val": val, "test": test}

    def _image_folder(self, root: Path, classes: list[str] | None = None) -> ImageFolder:
        try:
            folder = ImageFolder(str(root), loader=read_image)
        except FileNotFoundError as error:  # no class folders, or no images in them
            raise no_classes_error(root, error) from None
        check_several_classes(root, folder.classes)
        if classes is not None and folder.classes != classes:
            raise DataError(
                f"{root} has classes {folder.classes} but the training folder has {classes}; "
                f"every split needs the same class sub-folders."
            )
        return folder


def image_classes(data_dir: str) -> int:
    """The number of classes of an image folder: its class sub-folders, or its `train/` folder's.

    The resolver behind `num_classes: ${image_classes:${.data_dir}}`.
    """
    root = Path(data_dir)
    check_is_folder(root)
    if (root / "train").is_dir():
        root = root / "train"
    try:
        classes, _ = find_classes(str(root))
    except FileNotFoundError as error:
        raise no_classes_error(root, error) from None
    check_several_classes(root, classes)
    return len(classes)


def check_is_folder(data_dir: Path) -> None:
    if not data_dir.is_dir():
        raise MissingFileError(
            f"data.data_dir={str(data_dir)!r} is not a folder. Point it at a folder of "
            f"class sub-folders (cat/, dog/, ...) or of train/ and val/ folders holding them."
        )


def no_classes_error(root: Path, error: FileNotFoundError) -> MissingFileError:
    return MissingFileError(
        f"{error} An image folder needs one sub-folder per class holding images "
        f"(e.g. {root}/cat/1.jpg, {root}/dog/2.jpg)."
    )


def check_several_classes(root: Path, classes: list[str]) -> None:
    if len(classes) < 2:
        raise DataError(
            f"{root} holds images of one class only ({classes[0]}/): a classifier "
            f"needs at least two, each in its own sub-folder (e.g. {root}/cat/, {root}/dog/)."
        )


def read_image(path: str) -> Image.Image:
    """ImageFolder's image loader, naming the file that cannot be read."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise DataError(
            f"{path} is not a readable image ({error}). Delete or replace it, or move it out of "
            f"data.data_dir."
        ) from None

"""Shared machinery of the image classification datamodules: transforms, splits and loaders."""

from abc import ABC, abstractmethod
from collections.abc import Callable, Sized
from typing import Any, cast

import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import Dataset, Subset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision import transforms as v1
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor

from src.data.sampler import resumable_sampler
from src.data.splits import check_fractions, check_loader_options
from src.utils.contracts import IMAGES
from src.utils.errors import ConfigError, DataError

Transform = Callable[[Any], torch.Tensor]
SPLITS = ("train", "val", "test")
# Steps that turn decoded image files (PIL images) into tensors.
PIL_TO_TENSOR = (v2.ToImage, v2.PILToTensor, v1.PILToTensor, v1.ToTensor)


class TransformedDataset(Dataset):
    """Applies `transform` to each image when it is read: the per-sample (augmentation) path."""

    def __init__(self, dataset: Dataset, transform: Transform):
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # the raw splits are map-style: they have a length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.dataset[index]
        return self.transform(image), label


def precompute(dataset: Dataset, transform: Transform | None) -> TensorDataset:
    """Run a deterministic `transform` once over a whole split and keep the result in memory.

    Tensor-backed splits are transformed as one batch; others (e.g. decoded image files) one
    image at a time, once, instead of once per image per epoch.
    """
    tensors = _backing_tensors(dataset)
    if tensors is not None:
        all_images, all_labels = tensors
        return TensorDataset(transform(all_images) if transform else all_images, all_labels)
    images: list[torch.Tensor] = []
    labels: list[int] = []
    for image, label in iter(dataset):  # by index until IndexError: Dataset has no __iter__
        images.append(transform(image) if transform else image)
        labels.append(label)
    return TensorDataset(torch.stack(images), torch.as_tensor(labels))


def _backing_tensors(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (images, labels) tensors behind a TensorDataset or a Subset of one, else None."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[0], dataset.tensors[1]
    if isinstance(dataset, Subset):
        inner = _backing_tensors(dataset.dataset)
        if inner is not None:
            index = torch.as_tensor(dataset.indices, dtype=torch.long)
            return inner[0][index], inner[1][index]
    return None


class ImageDataModule(LightningDataModule, ABC):
    """Base class: subclasses say where the raw splits come from, this class does the rest.

    - `transform` is deterministic preprocessing (e.g. scaling and normalisation). When
      `precompute` is true it runs once per split at set-up, not once per sample per epoch.
    - `train_transform`, when given, replaces `transform` for the training split and runs per
      sample every epoch: that is where random augmentation goes.
    - `input_shape` and `num_classes` are what models read through config interpolation; they
      are checked against the data at set-up so a wrong value fails with a clear message.
    - `class_names` are the names behind the label indices when the data has them (the folder
      names of `ImageFolder` data); checkpoints keep them, for predictions (`predict.py`).
    - Batches come from a `DistributedSampler` in every run, with one process or many: each
      epoch's order is a permutation seeded by `shuffle_seed` + epoch, and the ranks of a DDP
      run take interleaved slices of it, so 2 processes with batch B see exactly the batches
      1 process with batch 2B sees. (Set `trainer.use_distributed_sampler=false`, as the
      trainer configs do, so Lightning does not wrap it again.)
    """

    batch_kind = IMAGES

    def __init__(
        self,
        num_classes: int,
        input_shape: list[int],
        transform: Transform | None = None,
        train_transform: Transform | None = None,
        precompute: bool = True,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        shuffle_seed: int | None = None,
    ):
        super().__init__()
        check_loader_options(batch_size, eval_batch_size)
        check_fractions(val_fraction)
        self.num_classes = num_classes
        self.input_shape = list(input_shape)
        self.transform = transform
        self.train_transform = train_transform
        self.precompute = precompute
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.shuffle_seed = shuffle_seed
        self.datasets: dict[str, Dataset] = {}
        self.class_names: list[str] | None = None

    @abstractmethod
    def load_splits(self) -> dict[str, Dataset]:
        """Return the raw 'train', 'val' and 'test' datasets of (image, label) pairs."""

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        raw = self.load_splits()
        self.class_names = _class_names(raw["train"])
        for split in SPLITS:
            per_sample = split == "train" and self.train_transform is not None
            transform = self.train_transform if per_sample else self.transform
            if per_sample or not self.precompute:
                self.datasets[split] = TransformedDataset(raw[split], transform or _identity)
            else:
                self.datasets[split] = precompute(raw[split], transform)
        self._check_matches_config()

    def state_dict(self) -> dict[str, Any]:
        """What checkpoints keep of the datamodule: the class names, when known."""
        return {"class_names": self.class_names} if self.class_names else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.class_names = state_dict.get("class_names", self.class_names)

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """One decoded image file as a model input, prepared as the test split's images are.

        A `transform` that converts PIL images itself (as `ImageFolder` data's does) gets the
        image as it is. The others were written for tensors of `input_shape` in [0, 1], so the
        image is first converted to as many channels, resized and scaled to match.
        """
        if len(self.input_shape) != 3 or self.input_shape[0] not in (1, 3):
            raise ConfigError(
                f"Only images can be preprocessed: data.input_shape is {self.input_shape}, not "
                f"[channels, height, width] with 1 (grey-scale) or 3 (RGB) channels."
            )
        channels, height, width = self.input_shape
        image = image.convert("L" if channels == 1 else "RGB")
        transform = self.transform or _identity
        steps = getattr(transform, "transforms", [transform])
        if not any(isinstance(step, PIL_TO_TENSOR) for step in steps):
            image = pil_to_tensor(image.resize((width, height), Image.Resampling.BILINEAR)) / 255
        return transform(image)

    def train_dataloader(self) -> StatefulDataLoader:
        return self._loader("train", self.batch_size, shuffle=True)

    def val_dataloader(self) -> StatefulDataLoader:
        return self._loader("val", self.eval_batch_size)

    def test_dataloader(self) -> StatefulDataLoader:
        return self._loader("test", self.eval_batch_size)

    def predict_dataloader(self) -> StatefulDataLoader:
        return self._loader("test", self.eval_batch_size)

    def _loader(self, split: str, batch_size: int, shuffle: bool = False) -> StatefulDataLoader:
        # A DataLoader whose position and shuffle order go into checkpoints (exact resume).
        return StatefulDataLoader(
            self.datasets[split],
            batch_size=batch_size,
            sampler=resumable_sampler(self, self.datasets[split], shuffle, self.shuffle_seed),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
        )

    def _check_matches_config(self) -> None:
        for split, dataset in self.datasets.items():
            if len(cast(Sized, dataset)) == 0:  # every split is map-style, with a length
                raise DataError(
                    f"The {split} split of {type(self).__name__} is empty: the dataset has too "
                    f"few samples for data.val_fraction / data.test_fraction, or none at all."
                )
        image, _ = self.datasets["train"][0]
        if list(image.shape) != self.input_shape:
            raise ConfigError(
                f"data.input_shape is {self.input_shape} but the transformed images have shape "
                f"{list(image.shape)}: set data.input_shape={list(image.shape)} or change the "
                f"transforms."
            )
        labels = _labels(self.datasets["test"]) + _labels(self.datasets["val"])
        if labels and (max(labels) >= self.num_classes or min(labels) < 0):
            raise ConfigError(
                f"data.num_classes is {self.num_classes} but labels range from {min(labels)} to "
                f"{max(labels)}: set data.num_classes={max(labels) + 1}."
            )


def _identity(image: Any) -> Any:
    return image


def _class_names(dataset: Dataset) -> list[str] | None:
    """The names of the label indices, as torchvision's folder datasets give them, else None."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    classes = getattr(dataset, "classes", None)
    return [str(name) for name in classes] if classes else None


def _labels(dataset: Dataset) -> list[int]:
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[1].tolist()
    return []

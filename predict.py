"""Classify images with a checkpoint: `python predict.py ckpt_path=<.ckpt> input=<image or folder>`.

The model and its preprocessing are rebuilt from the run config stored in the checkpoint, so each
image is prepared as the test split's images were (e.g. grey-scale, resized to the training size,
normalised). Prints the `top_k` classes of each image; for a folder, also writes them to
`predictions.csv` in the run directory, skipping (and counting) the files that do not decode.
"""

import csv
import logging
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from omegaconf import DictConfig
from PIL import Image, UnidentifiedImageError
from torchvision.datasets.folder import IMG_EXTENSIONS

from src.checkpoints.restore import restore
from src.data.image.datamodule import ImageDataModule
from src.run.app import hydra_app
from src.utils.errors import ConfigError, DataError, MissingFileError

log = logging.getLogger(__name__)

Prediction = tuple[Path, list[tuple[str, float]]]  # an image, its top-k (label, probability)
NAMED_UNREADABLE = 3  # unreadable files named in the warning; the others are counted


def image_paths(input_path: Path) -> list[Path]:
    """The image file itself, or every image file under the folder (recursively), sorted."""
    if input_path.is_file():
        return [input_path]
    if not input_path.is_dir():
        raise MissingFileError(
            f"input={str(input_path)!r} does not exist. Pass an image file or a folder of images."
        )
    paths = sorted(
        path
        for path in input_path.rglob("*")
        if path.is_file() and path.suffix.lower() in IMG_EXTENSIONS
    )
    if not paths:
        raise MissingFileError(
            f"input={str(input_path)!r} holds no images ({', '.join(IMG_EXTENSIONS)})."
        )
    return paths


def read_image(path: Path) -> Image.Image:
    """The decoded image, or a DataError naming the file that is not one."""
    try:
        with Image.open(path) as image:
            image.load()
            return image
    except (UnidentifiedImageError, OSError) as error:
        raise DataError(f"{path} is not a readable image ({error}).") from None


def read_images(
    paths: list[Path], skip_unreadable: bool
) -> tuple[list[Path], list[Image.Image], list[Path]]:
    """The paths that decode and their images, and the paths that do not (with
    `skip_unreadable`; without, the first of those raises its DataError)."""
    read, images, unreadable = [], [], []
    for path in paths:
        try:
            images.append(read_image(path))
            read.append(path)
        except DataError:
            if not skip_unreadable:
                raise
            unreadable.append(path)
    return read, images, unreadable


def report_unreadable(unreadable: list[Path], total: int, folder: Path) -> None:
    """One warning naming the first few unreadable files; a DataError when none was readable."""
    if not unreadable:
        return
    names = ", ".join(str(path.relative_to(folder)) for path in unreadable[:NAMED_UNREADABLE])
    if len(unreadable) > NAMED_UNREADABLE:
        names += f" and {len(unreadable) - NAMED_UNREADABLE} more"
    if len(unreadable) == total:
        raise DataError(
            f"None of the {total} image files under {folder} is a readable image "
            f"({names}): check for truncated copies or wrong extensions, or pass another folder."
        )
    log.warning(
        "Skipped %d of %d image files under %s that are not readable images: %s",
        len(unreadable),
        total,
        folder,
        names,
    )


def top_k(
    model: LightningModule, datamodule: ImageDataModule, images: list[Image.Image], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities and class indices [len(images), k] of each image's k most likely classes."""
    inputs = torch.stack([datamodule.preprocess(image) for image in images])
    with torch.inference_mode():
        probabilities = model(inputs).softmax(dim=1)
    return probabilities.topk(min(k, probabilities.shape[1]), dim=1)


def predict(cfg: DictConfig) -> list[Prediction]:
    """The top-k predictions for every image of `cfg.input`, batch by batch; the files of a
    folder that do not decode are skipped with a warning."""
    if cfg.top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {cfg.top_k}.")
    input_path = Path(cfg.input)
    paths = image_paths(input_path)
    restored = restore(cfg.ckpt_path)
    model, datamodule = restored.model, restored.datamodule
    if not isinstance(datamodule, ImageDataModule):
        raise ConfigError(
            f"predict.py classifies images, but {cfg.ckpt_path} was trained on "
            f"{type(datamodule).__name__} data."
        )
    names = datamodule.class_names or [str(index) for index in range(datamodule.num_classes)]
    predictions, unreadable = [], []
    for start in range(0, len(paths), datamodule.eval_batch_size):
        batch = paths[start : start + datamodule.eval_batch_size]
        batch, images, skipped = read_images(batch, skip_unreadable=input_path.is_dir())
        unreadable += skipped
        if not images:
            continue
        probabilities, indices = top_k(model, datamodule, images, cfg.top_k)
        for path, row, classes in zip(batch, probabilities.tolist(), indices.tolist(), strict=True):
            predictions.append((path, [(names[i], p) for i, p in zip(classes, row, strict=True)]))
    report_unreadable(unreadable, len(paths), input_path)
    return predictions


def write_csv(predictions: list[Prediction], path: Path) -> None:
    """One row per image: path, then label_i and probability_i for i = 1..k."""
    header = ["path"]
    for rank in range(1, len(predictions[0][1]) + 1):
        header += [f"label_{rank}", f"probability_{rank}"]
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        for image, ranked in predictions:
            cells = [str(image)]
            for label, probability in ranked:
                cells += [label, f"{probability:.6f}"]
            writer.writerow(cells)


def report(predictions: list[Prediction], input_path: Path, output_dir: Path) -> None:
    """Print each image's top-k; for a folder, also write them to `output_dir`/predictions.csv."""
    for image, ranked in predictions:
        print(f"{image}: " + ", ".join(f"{label} ({p:.3f})" for label, p in ranked))
    if input_path.is_dir():
        csv_path = output_dir / "predictions.csv"
        write_csv(predictions, csv_path)
        print(f"Predictions written to {csv_path}")


@hydra_app("predict")
def main(cfg: DictConfig) -> None:
    report(predict(cfg), Path(cfg.input), Path(cfg.paths.output_dir))


if __name__ == "__main__":
    main()

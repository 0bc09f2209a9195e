"""Small data and config builders shared by the tests; nothing here touches the network."""

import gzip
import os
import signal
import socket
import struct
from pathlib import Path

import numpy as np
from lightning.pytorch import Callback
from omegaconf import DictConfig

from src.run.compose import ROOT, compose_run_config

os.environ.setdefault("PROJECT_ROOT", str(ROOT))

# Keep in-process runs short and quiet: no progress bar, no model summary table.
FAST = [
    "trainer.max_epochs=1",
    "trainer.enable_progress_bar=false",
    "callbacks.rich_progress_bar=null",
    "callbacks.model_summary=null",
]


def compose_config(run_dir: Path, overrides: list[str], config_name: str = "train") -> DictConfig:
    """Compose a config as `python train.py <overrides>` would, with its run dir at `run_dir`
    (the autouse fixture in conftest.py clears Hydra after each test)."""
    return compose_run_config(run_dir, overrides, config_name)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_idx_images(path: Path, images: np.ndarray) -> None:
    """Write uint8 images [N, H, W] in MNIST's IDX format (gzipped when the name ends in .gz)."""
    header = struct.pack(">IIII", 2051, *images.shape)
    _write(path, header + images.astype(np.uint8).tobytes())


def write_idx_labels(path: Path, labels: np.ndarray) -> None:
    _write(path, struct.pack(">II", 2049, len(labels)) + labels.astype(np.uint8).tobytes())


def _write(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as file:
            file.write(payload)
    else:
        path.write_bytes(payload)


def learnable_images(
    n: int, size: int, num_classes: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Noisy copies of one fixed random template per class: easy to learn, impossible to guess."""
    templates = np.random.default_rng(1234).random((num_classes, size, size)) > 0.7
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n)
    noise = rng.integers(0, 90, (n, size, size))
    images = np.clip(templates[labels] * 165 + noise, 0, 255).astype(np.uint8)
    return images, labels


def write_mnist(root: Path, n_train: int = 600, n_test: int = 200, gz: bool = False) -> Path:
    """A learnable MNIST-format dataset at `<root>/MNIST/raw`, as torchvision expects it."""
    raw = root / "MNIST" / "raw"
    suffix = ".gz" if gz else ""
    for prefix, n, seed in (("train", n_train, 0), ("t10k", n_test, 1)):
        images, labels = learnable_images(n, 28, 10, seed)
        write_idx_images(raw / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx_labels(raw / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
    return root


def write_image_folder(root: Path, per_class: int = 12, classes=("ant", "bee", "cat")) -> Path:
    """A folder of class sub-folders holding small RGB PNGs, a learnable colour per class."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for index, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 60, (20, 24, 3))
            pixels[..., index % 3] += 180
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{i}.png")
    return root


class KillAtStep(Callback):
    """A callback (add it with `+callbacks.killer=...`) that SIGKILLs its own process.

    It fires at the end of optimizer step `step`, before that step's checkpoint is written:
    the crash loses the step in progress, as a real one would.
    """

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args, **kwargs):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


# A Qwen3-style LM small enough to train for a few steps in seconds.
TINY_LM = [
    "model=qwen3_tiny",
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.head_dim=16",
]


def shakespeare_excerpt(folder: Path, characters: int) -> Path:
    """The first `characters` of Tiny Shakespeare as `folder/corpus.txt`, for data=text."""
    path = folder / "corpus.txt"
    path.write_text(
        (ROOT / "src" / "data" / "assets" / "tinyshakespeare.txt").read_text()[:characters]
    )
    return path


def text_lm_overrides(corpus: Path) -> list[str]:
    """data=text on `corpus`, keeping the checkpoint with the lowest validation loss."""
    return [
        "data=text",
        f"data.paths=[{corpus}]",
        "callbacks.model_checkpoint.monitor=val/loss",
        "callbacks.model_checkpoint.mode=min",
    ]


def small_image_folder_overrides(folder: Path) -> list[str]:
    """data=imagefolder on a folder of 16x16 RGB images of 3 classes, without augmentation."""
    return [
        "data=imagefolder",
        f"data.data_dir={folder}",
        "data.num_classes=3",
        "data.input_shape=[3,16,16]",
        "data.transform.transforms.0.size=16",
        "data.transform.transforms.1.size=16",
        "data.train_transform=null",
        "data.num_workers=0",
        "data.pin_memory=false",
        "data.batch_size=8",
    ]

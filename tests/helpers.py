"""Small data, config, model and process builders shared by the tests; nothing here touches
the network."""

import gzip
import json
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from omegaconf import DictConfig

from src.models.language.qwen import QwenConfig, QwenLM
from src.run.config.compose import ROOT, compose_run_config
from src.utils.errors import UserFacingError, first_cause
from tests.warm_interpreter import run_warm
from train import train

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


class SignalAtStep(Callback):
    """A callback (`+callbacks.signaller=...`) that sends its own process the signal `name` at
    the end of optimizer step `step`."""

    def __init__(self, step: int, name: str):
        self.step, self.signum = step, getattr(signal, name)

    def on_train_batch_end(self, trainer, *args, **kwargs):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


# A Qwen3-style LM small enough to train for a few steps in seconds.
TINY_LM = [
    "model=qwen3_tiny",
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.head_dim=16",
]

# Four steps of an LM experiment, validated once on one batch and tested on one, logged to CSV.
FOUR_LM_STEPS = [
    *FAST,
    *TINY_LM,
    "scheduler.scheduler.warmup_steps=2",
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
    "logger=csv",
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


def user_error(raised: BaseException, error_type: type = UserFacingError) -> BaseException:
    """The `error_type` error in `raised` or what it was raised from, as the entry points find
    it (Hydra's instantiate wraps the errors of the objects it builds)."""
    error = first_cause(raised, error_type)
    assert error is not None, f"{type(raised).__name__}, not {error_type.__name__}: {raised}"
    return error


# -- processes and trainers -------------------------------------------------------------------


def run_script(
    script: str,
    args: Sequence[str] = (),
    *,
    check: bool = True,
    launcher: Sequence[str] = (sys.executable,),
    timeout: float = 300,
    **options,
) -> subprocess.CompletedProcess:
    """`python <script> <args>` from the repository root, as a user types it, its output
    captured as text. With `check`, a non-zero exit fails the test with the end of stderr.

    A Python script with the default launcher and environment runs in a warm interpreter
    (tests/warm_interpreter.py), any other the cold way."""
    argv = [str(ROOT / script), *args]
    if (
        tuple(launcher) == (sys.executable,)
        and script.endswith(".py")
        and options.keys() <= {"start_new_session"}
    ):
        result = run_warm(argv, cwd=ROOT, timeout=timeout, **options)
    else:
        result = subprocess.run(
            [*launcher, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **options
        )
    if check and result.returncode != 0:
        pytest.fail(
            f"{script} {' '.join(args)} exited with {result.returncode}:\n{result.stderr[-3000:]}"
        )
    return result


def run_train(
    args: Sequence[str], run_dir: Path | None = None, **options
) -> subprocess.CompletedProcess:
    """`python train.py <args>` in its own process (plain `ddp` re-executes the command line,
    which must be train.py's, not pytest's), with `hydra.run.dir=<run_dir>` unless `run_dir` is
    None. Its own session, so that a callback that kills its process group stops the run's
    ranks and never pytest. `options` as for `run_script`."""
    pinned = [] if run_dir is None else [f"hydra.run.dir={run_dir}"]
    return run_script("train.py", [*args, *pinned], start_new_session=True, **options)


def quiet_trainer(**options) -> Trainer:
    """A CPU Trainer that writes and prints nothing of its own: no logger, checkpoints,
    progress bar or model summary, unless `options` turn them back on."""
    quiet = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return Trainer(**(quiet | options))


# -- Qwen-style models and tensors --------------------------------------------------------------


def tiny_config(model_type: str, **overrides) -> QwenConfig:
    """4 layers (hybrid: 3 Gated DeltaNet + 1 attention), heads * head_dim != hidden_size."""
    values = dict(
        model_type=model_type, vocab_size=97, hidden_size=48, intermediate_size=80,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_chunk_size=16, tie_word_embeddings=False,
    )  # fmt: skip
    if model_type == "qwen3_next":
        values["partial_rotary_factor"] = 0.5
    if "moe" in model_type:  # 4 experts, 2 per token; Qwen3.5-MoE's with a shared expert
        values.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        if model_type.startswith("qwen3_5"):
            values["shared_expert_intermediate_size"] = 24
    return QwenConfig(**{**values, **overrides})


def perturbed_model(config: QwenConfig, seed: int = 0) -> QwenLM:
    """A model whose norms, gates and decay rates are all away from their initial values, so that
    a mix-up between, say, w and 1 + w, or two heads, cannot hide."""
    torch.manual_seed(seed)
    model = QwenLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model


def assert_same_tensors(expected, actual, where=""):
    """Nested dicts, lists and tuples of tensors (a state dict, optimizer states) are bitwise
    equal; `where` names the first entry that differs."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(expected, actual), f"{where} differs"
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), where
        for key in expected:
            assert_same_tensors(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, list | tuple):
        for index, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_tensors(e, a, f"{where}[{index}]")
    else:
        assert expected == actual, f"{where}: {expected} != {actual}"


# -- runs stopped and resumed ------------------------------------------------------------------

# A run that can resume at any step, bit for bit: deterministic, a last.ckpt after every step,
# and no test after fitting.
RESUMABLE_EVERY_STEP = [
    "trainer.deterministic=true",
    "callbacks.last_checkpoint.every_n_train_steps=1",
    "callbacks.last_checkpoint.every_n_epochs=null",
    "test=false",
]


def final_state(run_dir):
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    metrics = json.loads((run_dir / "metrics.json").read_text())["metrics"]
    logged = {k: v for k, v in metrics.items() if not k.startswith("perf/")}
    return checkpoint, logged


def trained_state(run: list[str], run_dir, *more: str):
    """`train(<run> <more>)` in this process with its run dir at `run_dir`; its `final_state`."""
    train(compose_config(run_dir, [*run, *more]))
    return final_state(run_dir)


def killed_run(run: list[str], run_dir, kill_step: int):
    """`train.py <run>` in a subprocess SIGKILLed at the end of step `kill_step`; its last.ckpt."""
    killer = [
        "+callbacks.killer._target_=tests.helpers.KillAtStep",
        f"+callbacks.killer.step={kill_step}",
    ]
    killed = run_train([*run, *killer], run_dir, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    return run_dir / "checkpoints" / "last.ckpt"


def assert_resumes_exactly(run: list[str], folder: Path, kill_step: int) -> dict:
    """`run` trained whole (in `folder/whole`) and killed at the end of step `kill_step`, then
    resumed from its last.ckpt (in `folder/killed`), end with the same step, weights, optimizer
    states and metrics. Returns the resumed run's last checkpoint."""
    expected_checkpoint, expected_metrics = trained_state(run, folder / "whole")
    last = killed_run(run, folder / "killed", kill_step)
    checkpoint, metrics = trained_state(run, folder / "killed", f"ckpt_path={last}")
    assert checkpoint["global_step"] == expected_checkpoint["global_step"]
    assert_same_tensors(expected_checkpoint["state_dict"], checkpoint["state_dict"], "weights")
    assert_same_tensors(
        expected_checkpoint["optimizer_states"], checkpoint["optimizer_states"], "optimizer"
    )
    assert metrics == expected_metrics
    return checkpoint

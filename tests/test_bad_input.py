"""Every kind of bad input gets a clear, actionable error: one table, one row per case.

Each row builds its own broken input, runs the template the way a user would (in-process,
through `train()`), and checks the error type and the words that tell the user what to fix.
"""

import errno

import numpy as np
import pytest
import torch
from hydra.errors import MissingConfigException

from src.checkpoints import io as checkpoint_io
from src.utils.errors import CheckpointError, ConfigError, DataError, MissingFileError
from tests.helpers import FAST, TINY_LM, compose_config, write_mnist
from train import train


def unknown_option(tmp_path):
    return ["model=resnet9000"]


def wrong_type(tmp_path):
    return ["trainer.max_epochs=ten"]


def missing_dataset(tmp_path):
    return ["data=mnist", f"data.data_dir={tmp_path}", "data.download=false"]


def corrupt_dataset(tmp_path):
    write_mnist(tmp_path, n_train=20, n_test=10)
    (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte").write_bytes(b"not an idx file")
    return ["data=mnist", f"data.data_dir={tmp_path}", "data.download=false"]


def empty_dataset(tmp_path):
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 1, 8, 8), np.float32), y=np.zeros(0))
    return [
        "data=tensors",
        f"data.path={tmp_path / 'empty.npz'}",
        "data.num_classes=2",
        "data.input_shape=[1,8,8]",
    ]


def image_folder_without_classes(tmp_path):
    (tmp_path / "images").mkdir()
    return ["data=imagefolder", f"data.data_dir={tmp_path / 'images'}", "data.num_classes=2"]


def truncated_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.randn(5000)}}, path)
    path.write_bytes(path.read_bytes()[:1000])
    return [f"ckpt_path={path}"]


def checkpoint_of_another_model(tmp_path):
    train(compose_config(tmp_path / "cnn", [*FAST, "model=cnn", "test=false"]))
    return ["model=simplenet", f"ckpt_path={tmp_path / 'cnn' / 'checkpoints' / 'last.ckpt'}"]


def missing_checkpoint(tmp_path):
    return [f"ckpt_path={tmp_path / 'nope.ckpt'}"]


def wrong_input_shape(tmp_path):
    return ["data.input_shape=[1,28,28]"]


def jsonl_line_that_does_not_parse(tmp_path):
    lines = ['{"prompt": "1+1=", "response": "2"}', '{"prompt": "2+2=", "response": 4'] * 10
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return [*TINY_LM, "data=sft", f"data.path={tmp_path / 'chats.jsonl'}"]


def sample_longer_than_the_context(tmp_path):
    (tmp_path / "corpus.txt").write_text("\n\n".join(["short", "x" * 300, "also short"] * 10))
    return [*TINY_LM, "data=text", f"data.paths=[{tmp_path / 'corpus.txt'}]", "data.overlong=raise"]


CASES = {
    # case: (make the input, expected error, words the message must contain)
    "unknown config option": (unknown_option, MissingConfigException, ["cnn", "simplenet"]),
    "wrong value type": (wrong_type, ConfigError, ["trainer.max_epochs='ten'", "expects int"]),
    "missing dataset file": (missing_dataset, MissingFileError, ["MNIST/raw", "data.data_dir"]),
    "corrupt dataset file": (corrupt_dataset, DataError, ["not valid IDX", "Delete them"]),
    "empty dataset": (empty_dataset, DataError, ["split", "is empty"]),
    "image folder with no classes": (
        image_folder_without_classes,
        MissingFileError,
        ["class folder", "one sub-folder per class"],
    ),
    "truncated checkpoint": (truncated_checkpoint, CheckpointError, ["truncated or corrupt"]),
    "checkpoint of another model": (
        checkpoint_of_another_model,
        CheckpointError,
        ["another model", "conv1.weight", "model=cnn"],
    ),
    "ckpt_path does not exist": (
        missing_checkpoint,
        MissingFileError,
        ["does not exist", "ckpt_path=last"],
    ),
    "data shape differs from config": (
        wrong_input_shape,
        ConfigError,
        ["data.input_shape=[1, 8, 8]"],
    ),
    "JSONL line that does not parse": (
        jsonl_line_that_does_not_parse,
        DataError,
        ["chats.jsonl, line 2", "not valid JSON"],
    ),
    "sample longer than the context under raise": (
        sample_longer_than_the_context,
        DataError,
        ["'xxxxx", "301 tokens", "max_seq_len=256", "data.overlong=truncate, drop or split"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_a_clear_error(tmp_path, case):
    make_input, error_type, words = CASES[case]
    overrides = make_input(tmp_path)
    with pytest.raises(error_type) as error:
        train(compose_config(tmp_path / "run", [*FAST, *overrides]))
    for word in words:
        assert word in str(error.value), f"{case}: {word!r} not in: {error.value}"


def test_a_disk_that_fills_during_training_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    saves = []
    real_save = torch.save

    def fills_after_three(obj, file):
        saves.append(1)
        if len(saves) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, file)

    monkeypatch.setattr(checkpoint_io.torch, "save", fills_after_three)
    cfg = compose_config(tmp_path, [*FAST, "trainer.max_epochs=5"])
    with pytest.raises(CheckpointError, match="No space left"):
        train(cfg)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    # Epoch 0's three saves (best, periodic, last) fit; epoch 1's first fills the disk.
    assert last["epoch"] == 0, f"last.ckpt of epoch {last['epoch']}"
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))
    assert not (tmp_path / "metrics.json").exists()  # a failed run reports no results

"""Every kind of bad input gets a clear, actionable error: one table, one row per case.

Each row builds its own broken input, runs the template the way a user would (in-process,
through `train()`), and checks the error type and the words that tell the user what to fix.
"""

import contextlib
import errno
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from scripts.generate import main as generate_main
from src.callbacks.training.divergence import DivergenceError
from src.checkpoints import io as checkpoint_io
from src.run.config.key_hints import typo_hint
from src.run.hydra_callbacks import check_writable
from src.utils.error_boundary import exit_in_one_line
from src.utils.errors import CheckpointError, ConfigError, DataError, MissingFileError
from tests.entry_points.support import assert_unchanged, files_and_contents
from tests.helpers import (
    FAST,
    ROOT,
    TINY_LM,
    compose_config,
    run_script,
    shakespeare_excerpt,
    small_image_folder_overrides,
    text_lm_overrides,
    user_error,
    write_image_folder,
    write_mnist,
)
from train import train


def wrong_type(tmp_path):
    return ["trainer.max_epochs=ten"]


def missing_dataset(tmp_path):
    return ["data=mnist", f"data.data_dir={tmp_path}", "data.download=false"]


def corrupt_dataset(tmp_path):
    write_mnist(tmp_path, n_train=20, n_test=10)
    (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte").write_bytes(b"not an idx file")
    return ["data=mnist", f"data.data_dir={tmp_path}", "data.download=false"]


def truncated_mnist_archive(tmp_path):
    write_mnist(tmp_path, n_train=200, n_test=10, gz=True)
    archive = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte.gz"
    archive.write_bytes(archive.read_bytes()[:2000])
    return ["data=mnist", f"data.data_dir={tmp_path}", "data.download=false"]


def one_class_image_folder(tmp_path):
    write_image_folder(tmp_path / "images", per_class=6, classes=("cat",))
    return [*small_image_folder_overrides(tmp_path / "images"), "data.num_classes=2"]


def image_folder_with_a_corrupt_image(tmp_path):
    write_image_folder(tmp_path / "images", per_class=6, classes=("ant", "bee", "cat"))
    (tmp_path / "images" / "bee" / "3.png").write_bytes(b"\x89PNG but cut short")
    return small_image_folder_overrides(tmp_path / "images")


def empty_dataset(tmp_path):
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 1, 8, 8), np.float32), y=np.zeros(0))
    return [
        "data=tensors",
        f"data.path={tmp_path / 'empty.npz'}",
        "data.num_classes=2",
        "data.input_shape=[1,8,8]",
    ]


def tensors_without_their_path(tmp_path):
    return ["data=tensors"]


def image_folder_without_class_folders_or_num_classes(tmp_path):
    (tmp_path / "images").mkdir()
    return ["data=imagefolder", f"data.data_dir={tmp_path / 'images'}"]


def image_folder_without_classes(tmp_path):
    (tmp_path / "images").mkdir()
    return ["data=imagefolder", f"data.data_dir={tmp_path / 'images'}", "data.num_classes=2"]


def truncated_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.randn(5000)}}, path)
    path.write_bytes(path.read_bytes()[:1000])
    return [f"ckpt_path={path}"]


def random_bytes_as_checkpoint(tmp_path):
    (tmp_path / "last.ckpt").write_bytes(np.random.default_rng(0).bytes(3000))
    return [f"ckpt_path={tmp_path / 'last.ckpt'}"]


def weights_file(tmp_path):
    save_file({"fc1.weight": torch.zeros(4, 4)}, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def safetensors_as_checkpoint(tmp_path):
    return [f"ckpt_path={weights_file(tmp_path)}"]


def pretrained_that_is_not_safetensors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"<html>Not Found</html>")
    return [f"model.pretrained={tmp_path / 'model.safetensors'}"]


def checkpoint_of_another_model(tmp_path):
    train(compose_config(tmp_path / "cnn", [*FAST, "model=cnn", "test=false"]))
    return ["model=simplenet", f"ckpt_path={tmp_path / 'cnn' / 'checkpoints' / 'last.ckpt'}"]


def missing_checkpoint(tmp_path):
    return [f"ckpt_path={tmp_path / 'nope.ckpt'}"]


def negative_learning_rate(tmp_path):
    return ["optimizer.lr=-1"]


def wrong_input_shape(tmp_path):
    return ["data.input_shape=[1,28,28]"]


def jsonl_line_that_does_not_parse(tmp_path):
    lines = ['{"prompt": "1+1=", "response": "2"}', '{"prompt": "2+2=", "response": 4'] * 10
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return [*TINY_LM, "data=sft", f"data.path={tmp_path / 'chats.jsonl'}"]


def prompts_longer_than_the_context(tmp_path):
    lines = [
        json.dumps({"prompt": "Tell me the story " + "once more " * 30, "response": f"No. {i}"})
        for i in range(40)
    ]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return [*TINY_LM, "data=sft", f"data.path={tmp_path / 'chats.jsonl'}", "data.max_seq_len=64"]


def sample_longer_than_the_context(tmp_path):
    (tmp_path / "corpus.txt").write_text("\n\n".join(["short", "x" * 300, "also short"] * 10))
    return [*TINY_LM, "data=text", f"data.paths=[{tmp_path / 'corpus.txt'}]", "data.overlong=raise"]


def corpus_smaller_than_one_batch(tmp_path):
    corpus = shakespeare_excerpt(tmp_path, 3000)  # 12 rows of 256 bytes to train on
    return [*TINY_LM, *text_lm_overrides(corpus), f"data.cache_dir={tmp_path / 'cache'}"]


def jsonl_rows_without_the_text_field(tmp_path):
    speeches = (ROOT / "src" / "data" / "assets" / "tinyshakespeare.txt").read_text()
    rows = [{"text": speech} for speech in speeches.split("\n\n")[:51]]
    rows[7] = {"body": rows[7]["text"]}
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [*TINY_LM, *text_lm_overrides(tmp_path / "docs.jsonl"), "data.batch_size=2"]


def tensors_with_nan_features(tmp_path):
    x = np.random.default_rng(0).random((200, 1, 8, 8), np.float32)
    x[5, 0, 3, 3] = np.nan
    np.savez(tmp_path / "nan.npz", x=x, y=np.arange(200) % 2)
    return [
        "data=tensors",
        f"data.path={tmp_path / 'nan.npz'}",
        "data.num_classes=2",
        "data.input_shape=[1,8,8]",
    ]


def tensor_file(**changes):
    """A mistake in a tensor file: 200 8x8 samples of two classes, with `changes` applied
    (an array replaced, or removed where None)."""

    def make(tmp_path):
        x = np.random.default_rng(0).random((200, 1, 8, 8), np.float32)
        arrays = {"x": x, "y": np.arange(200) % 2}
        for key, change in changes.items():
            arrays[key] = change(arrays) if callable(change) else change
        np.savez(tmp_path / "arrays.npz", **{k: v for k, v in arrays.items() if v is not None})
        return [
            "data=tensors",
            f"data.path={tmp_path / 'arrays.npz'}",
            "data.num_classes=2",
            "data.input_shape=[1,8,8]",
        ]

    return make


def cut_tensor_file(tmp_path):
    overrides = tensor_file()(tmp_path)
    whole = (tmp_path / "arrays.npz").read_bytes()
    (tmp_path / "arrays.npz").write_bytes(whole[: len(whole) // 2])
    return overrides


CASES = {
    # case: (make the input, expected error, words the message must contain)
    "wrong value type": (wrong_type, ConfigError, ["trainer.max_epochs='ten'", "expects int"]),
    "missing dataset file": (missing_dataset, MissingFileError, ["MNIST/raw", "data.data_dir"]),
    "corrupt dataset file": (corrupt_dataset, DataError, ["not valid IDX", "Delete them"]),
    "truncated MNIST archive": (
        truncated_mnist_archive,
        DataError,
        ["train-images-idx3-ubyte.gz is truncated or corrupt", "Delete it"],
    ),
    "image folder of one class": (
        one_class_image_folder,
        DataError,
        ["one class only (cat/)", "at least two"],
    ),
    "corrupt image in an image folder": (
        image_folder_with_a_corrupt_image,
        DataError,
        ["bee/3.png is not a readable image", "Delete or replace it"],
    ),
    "empty dataset": (empty_dataset, DataError, ["split", "is empty"]),
    "data=tensors without its required values": (
        tensors_without_their_path,
        ConfigError,
        ["not set: data.input_shape, data.num_classes, data.path", "data.path=..."],
    ),
    "data=imagefolder without its folder": (
        lambda tmp_path: ["data=imagefolder"],
        ConfigError,
        ["not set: data.data_dir.", "data.data_dir=..."],
    ),
    "data=imagefolder counting the classes of a folder without any": (
        image_folder_without_class_folders_or_num_classes,
        MissingFileError,
        ["class folder", "one sub-folder per class"],
    ),
    "image folder with no classes": (
        image_folder_without_classes,
        MissingFileError,
        ["class folder", "one sub-folder per class"],
    ),
    "truncated checkpoint": (truncated_checkpoint, CheckpointError, ["truncated or corrupt"]),
    "random bytes as checkpoint": (
        random_bytes_as_checkpoint,
        CheckpointError,
        ["is not a PyTorch checkpoint", "checkpoints/last.ckpt"],
    ),
    "safetensors file as checkpoint": (
        safetensors_as_checkpoint,
        CheckpointError,
        ["safetensors weights file", "model.pretrained=", "checkpoints/"],
    ),
    "pretrained weights that are not safetensors": (
        pretrained_that_is_not_safetensors,
        CheckpointError,
        ["model.safetensors", "is not a safetensors file", "b'<html>N"],
    ),
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
    "model size that is not a number": (
        lambda tmp_path: [*TINY_LM, "data=shakespeare_bytes", "model.config.hidden_size=ten"],
        ConfigError,
        ["hidden_size='ten' must be a whole number of at least 1", "model.config.<name>="],
    ),
    "negative model size": (
        lambda tmp_path: [*TINY_LM, "data=shakespeare_bytes", "model.config.hidden_size=-8"],
        ConfigError,
        ["hidden_size=-8 must be a whole number of at least 1"],
    ),
    "negative learning rate": (
        negative_learning_rate,
        ConfigError,
        ["torch.optim.Adam refuses", "optimizer.lr=-1", "Invalid learning rate: -1"],
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
    "a value the network refuses": (
        lambda tmp_path: ["model=cnn", "model.net.dropout=2"],
        ConfigError,
        ["model.net: CNN refuses this config", "between 0 and 1, but got 2", "model.net.<name>="],
    ),
    "a value the trainer refuses": (
        lambda tmp_path: ["trainer.max_epochs=-5"],
        ConfigError,
        ["trainer: ", "refuses this config", "You passed in -5"],
    ),
    "no batches per optimizer step": (
        lambda tmp_path: ["trainer.accumulate_grad_batches=0"],
        ConfigError,
        ["trainer.accumulate_grad_batches=0: it counts batches per optimizer step", "at least 1"],
    ),
    "a step schedule that never steps": (
        lambda tmp_path: ["scheduler=step", "scheduler.scheduler.step_size=0"],
        ConfigError,
        ["scheduler.scheduler.step_size=0", "must be at least 1"],
    ),
    "language model on image data": (
        lambda tmp_path: TINY_LM,
        ConfigError,
        [
            "model=qwen3_tiny trains on token sequences, but data=digits yields labelled images",
            "data=shakespeare_bytes",
            "model=cnn",
        ],
    ),
    "classifier on text": (
        lambda tmp_path: ["data=text", "model=cnn"],
        ConfigError,
        [
            "model=cnn trains on labelled images, but data=text yields token sequences",
            "data=digits",
            "model=qwen3_tiny",
        ],
    ),
    "the LM experiment with a classifier": (
        lambda tmp_path: ["experiment=lm_shakespeare", "model=cnn"],
        ConfigError,
        ["model=cnn trains on labelled images, but data=shakespeare_bytes yields token"],
    ),
    "corpus smaller than one batch": (
        corpus_smaller_than_one_batch,
        DataError,
        ["The training split has 12 rows, fewer than one batch of data.batch_size=16", "to 12"],
    ),
    "JSON rows without the text field": (
        jsonl_rows_without_the_text_field,
        DataError,
        ["1 of 51 rows of", "docs.jsonl have no 'text'", "row 8", "data.missing_text=skip"],
    ),
    "a missing_text choice that is not one": (
        lambda tmp_path: [*TINY_LM, "data=text", "data.missing_text=drop"],
        ConfigError,
        ["data.missing_text='drop' is not one of raise, skip"],
    ),
    "NaN features in a tensor dataset": (
        tensors_with_nan_features,
        DataError,
        ["nan.npz: x holds NaN or Inf in 1 of its 200 samples (the first is sample 5)"],
    ),
    "SFT prompts longer than the context": (
        prompts_longer_than_the_context,
        DataError,
        [
            "The train split has no samples left: all 36 of its documents are longer than "
            "data.max_seq_len=64 tokens",
            "Raise data.max_seq_len to at least",
            "data.overlong=truncate would cut the answers off",
        ],
    ),
    "a misspelt precision": (
        lambda tmp_path: ["trainer.precision=bf17-mixed"],
        ConfigError,
        [
            "expects one of",
            "'bf16-mixed', '32-true'",
            "'auto' or null",
            "trainer.precision=bf16-mixed, say",
        ],
    ),
    "a precision in bits that does not exist": (
        lambda tmp_path: ["trainer.precision=8"],
        ConfigError,
        ["trainer.precision=8 (int) is not a valid value", "one of 64, 32, 16,"],
    ),
    "8-bit images in a tensor file": (
        tensor_file(x=lambda a: (a["x"] * 255).astype(np.uint8)),
        DataError,
        ["x is torch.uint8", "floating-point inputs", "x.astype('float32') / 255"],
    ),
    "fractional labels in a tensor file": (
        tensor_file(y=lambda a: a["y"] + 0.5),
        DataError,
        ["y holds non-integer labels (sample 0 is 0.5)"],
    ),
    "a training label beyond num_classes": (
        tensor_file(y=lambda a: np.where(np.arange(200) == 3, 7, a["y"])),
        DataError,
        ["labels outside 0..1 (sample 3 is 7", "data.num_classes=8"],
    ),
    "a negative label": (
        tensor_file(y=lambda a: np.where(np.arange(200) == 9, -1, a["y"])),
        DataError,
        ["sample 9 is -1", "class indices start at 0"],
    ),
    "one-hot labels": (
        tensor_file(y=lambda a: np.eye(2)[a["y"]]),
        DataError,
        ["y has shape [200, 2]", "y.argmax(1)"],
    ),
    "labels as text": (
        tensor_file(y=lambda a: np.array(["cat", "dog"] * 100)),
        DataError,
        ["y holds <U3 values (text?)", "integer class indices"],
    ),
    "x_val without y_val": (
        tensor_file(x_val=lambda a: a["x"][:20]),
        DataError,
        ["holds x_val but no y_val"],
    ),
    "validation samples of another shape": (
        tensor_file(x_val=lambda a: a["x"][:20, :, :4, :4], y_val=lambda a: a["y"][:20]),
        DataError,
        ["x_val samples have shape [1, 4, 4], but x samples [1, 8, 8]"],
    ),
    "arrays under other names": (
        tensor_file(X=lambda a: a["x"], Y=lambda a: a["y"], x=None, y=None),
        DataError,
        ["arrays named x and y", "it holds arrays named X, Y"],
    ),
    "one value per sample as x": (
        tensor_file(x=lambda a: a["x"][:, 0, 0, 0]),
        DataError,
        ["x has shape [200]", "[N, *data.input_shape]"],
    ),
    "a tensor file cut short": (
        cut_tensor_file,
        DataError,
        ["arrays.npz is not a readable .npz file (truncated or corrupt"],
    ),
    "a transform that makes the inputs infinite": (
        lambda tmp_path: ["data.transform.std=[1e-45]"],
        DataError,
        ["training batch of step 0", "values of batch[0] are NaN or Inf", "not the learning"],
    ),
    "a learning rate that makes the loss explode": (
        lambda tmp_path: ["optimizer.lr=1e12"],
        DivergenceError,
        ["Training diverged at step 1", "learning rate (1e+12) is the likely cause", "lower "],
    ),
    "sample longer than the context under raise": (
        sample_longer_than_the_context,
        DataError,
        ["'xxxxx", "301 tokens", "max_seq_len=256", "data.overlong=truncate, drop or split"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_a_clear_error(tmp_path, case):
    """Through the entry points' error boundary: one line that names the log holding the
    traceback, exit status 1, and every file the user had left as it was."""
    make_input, error_type, words = CASES[case]
    overrides = make_input(tmp_path)
    before = files_and_contents(tmp_path)

    @exit_in_one_line
    def run() -> None:
        train(compose_config(tmp_path / "run", [*FAST, *overrides]))

    with pytest.raises(SystemExit) as exit_:
        run()
    line = exit_.value.code
    assert isinstance(line, str), f"{case}: exit status {line}, not 1 with a message"
    assert line.startswith("Error: "), line
    assert "\n" not in line, f"{case}: more than one line: {line}"
    log = re.fullmatch(r".* \(full traceback: (.+)\)", line)
    assert log, f"{case}: the line names no log: {line}"
    assert "Traceback (most recent call last)" in Path(log[1]).read_text(), log[1]
    error = user_error(exit_.value.__context__, error_type)  # what the boundary ended
    for word in words:
        assert word in str(error), f"{case}: {word!r} not in: {error}"
        assert " ".join(word.split()) in line, f"{case}: {word!r} not in the line: {line}"
    assert "weights_only" not in line, f"{case}: advises an unsafe load"
    assert_unchanged(before, tmp_path, case=case)


def disk_full_after(saves: int, torch_save):
    """A torch.save that fills the disk after `saves` saves, failing as torch does: a part
    written, then a RuntimeError raised while handling the write's OSError (ENOSPC)."""
    done = []

    def save(obj, file):
        done.append(1)
        if len(done) <= saves:
            return torch_save(obj, file)
        file.write(b"PK\x03\x04 a partial checkpoint")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos"
            ) from None

    return save


def test_a_disk_that_fills_during_training_says_so_in_one_line_keeping_the_last_checkpoint(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(checkpoint_io.torch, "save", disk_full_after(3, torch.save))
    cfg = compose_config(tmp_path, [*FAST, "trainer.max_epochs=5"])
    with pytest.raises(CheckpointError) as error:
        train(cfg)
    message = str(error.value)
    assert message.startswith("No space left on the device: saving the checkpoint"), message
    assert str(tmp_path / "checkpoints") in message, message
    assert re.search(
        r"needed about \d+\.\d [kMGT]?B, and \d+\.\d [kMGT]?B is free there", message
    ), message
    assert "previous checkpoint at that path (if any) is intact" in message, message
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    # Epoch 0's three saves (best, periodic, last) fit; epoch 1's first fills the disk.
    assert last["epoch"] == 0, f"last.ckpt of epoch {last['epoch']}"
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))
    assert not (tmp_path / "metrics.json").exists()  # a failed run reports no results


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a small filesystem (tmpfs) filled to the last byte; skipped where this
    machine does not let the tests mount one (it needs root)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small filesystem here (needs root)")
    try:
        with open(mount / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * 4096)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_at_the_start_of_a_run_is_named_in_one_line(full_disk):
    with pytest.raises(SystemExit) as exit_:
        check_writable(full_disk / "run", "hydra.run.dir")
    message = str(exit_.value)
    assert message.startswith(f"Error: no space left on the device holding {full_disk / 'run'}")
    assert "kB free" in message, message
    assert "hydra.run.dir=..." in message, message


@pytest.mark.slow
def test_train_py_into_a_full_disk_stops_in_one_line_before_hydra_writes(full_disk):
    result = run_script("train.py", [f"hydra.run.dir={full_disk / 'run'}"], check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("Error: no space left on the device holding"), last_line


@pytest.mark.slow
def test_eval_py_refuses_another_model_for_a_checkpoint_in_one_line(tmp_path):
    train(compose_config(tmp_path / "run", [*FAST, "trainer.limit_train_batches=2", "test=false"]))
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    args = [f"ckpt_path={checkpoint}", "model=cnn", f"hydra.run.dir={tmp_path / 'eval'}"]
    result = run_script("eval.py", args, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("Error: model=cnn: a checkpoint's weights only fit the model"), (
        last_line
    )
    assert "data.batch_size=8" in last_line, last_line


# Where the Hydra entry points of the tests below write (inside the test's tmp_path).
RUN_DIR = "hydra.run.dir={run_dir}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "make_file", "args", "words"),
    [
        ("eval.py", weights_file, ["ckpt_path={}", RUN_DIR], "safetensors weights file"),
        (
            "predict.py",
            None,
            ["ckpt_path={}", "input={}", RUN_DIR],
            "is not a PyTorch checkpoint",
        ),
        ("scripts/export.py", weights_file, ["ckpt_path={}", RUN_DIR], "safetensors weights file"),
        ("scripts/generate.py", None, ["--ckpt", "{}"], "is not a PyTorch checkpoint"),
    ],
    ids=["eval", "predict", "export", "generate"],
)
def test_every_entry_point_names_a_file_that_is_not_a_checkpoint_in_one_line(
    tmp_path, script, make_file, args, words
):
    if make_file is None:
        path = tmp_path / "last.ckpt"
        path.write_bytes(np.random.default_rng(0).bytes(3000))
    else:
        path = make_file(tmp_path)
    args = [arg.format(path, run_dir=tmp_path / "run") for arg in args]
    result = run_script(script, args, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("Error: "), last_line
    assert words in last_line, last_line
    assert "weights_only" not in result.stderr, last_line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "args", "words"),
    [
        ("eval.py", [], "Required config value not set: ckpt_path"),
        ("predict.py", ["ckpt_path=x.ckpt"], "Required config value not set: input"),
        ("train.py", ["trainer=gpu"], "sees no GPU on this machine"),
        ("train.py", ["optimizer.lr=1e12"], "Training diverged at step 1"),
    ],
    ids=[
        "eval without ckpt_path",
        "predict without input",
        "trainer=gpu without a GPU",
        "a learning rate that diverges",
    ],
)
def test_an_entry_point_names_what_to_set_in_one_line(tmp_path, script, args, words):
    if "trainer=gpu" in args and (torch.cuda.is_available() or torch.backends.mps.is_available()):
        pytest.skip("this machine has a GPU")
    result = run_script(script, [*args, f"hydra.run.dir={tmp_path}"], check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("Error: "), last_line
    assert words in last_line, last_line
    log = (tmp_path / f"{script.removesuffix('.py')}.log").read_text()
    assert "Traceback" in log, f"the log lacks the traceback: {log[-2000:]}"
    assert words in log, f"the log lacks the traceback: {log[-2000:]}"


def test_a_checkpoint_cut_at_any_length_is_named_as_cut(tmp_path):
    torch.save(
        {"state_dict": {f"w{i}": torch.randn(1000 + 37 * i) for i in range(30)}}, tmp_path / "a"
    )
    whole = (tmp_path / "a").read_bytes()
    cut = tmp_path / "cut.ckpt"
    for length in range(0, len(whole), len(whole) // 97):
        cut.write_bytes(whole[:length])
        with pytest.raises(CheckpointError) as error:
            checkpoint_io.load_checkpoint(cut)
        assert "truncated or corrupt" in str(error.value) or "empty file" in str(error.value), (
            f"cut at {length} of {len(whole)} bytes: {error.value}"
        )


def test_generate_on_a_classifier_checkpoint_says_it_needs_a_language_model(tmp_path):
    run = [*FAST, "trainer.limit_train_batches=2", "test=false"]
    train(compose_config(tmp_path, run))
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as exit_:
        generate_main(["--ckpt", str(checkpoint)])
    message = str(exit_.value)
    assert message.startswith(f"Error: {checkpoint} is a checkpoint of"), message
    assert "ImageClassifier, not of a language model" in message, message
    assert f"predict.py ckpt_path={checkpoint}" in message, message


# -- a mistyped key: Hydra says "append with +", the template names the close key -------------


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("trainer.max_epoch=3", "did you mean trainer.max_epochs=3?"),
        ("sed=7", "did you mean seed=7?"),
        ("data.batchsize=8", "did you mean data.batch_size=8?"),
    ],
)
def test_a_mistyped_key_gets_the_close_key(override, hint):
    message = typo_hint(ROOT / "conf", "train", ["model=cnn", override])
    assert message == f"{override.split('=')[0]} is not a key of the config: {hint}"


@pytest.mark.parametrize(
    "overrides",
    [["trainer.max_epochs=3"], ["trainer.zzzzzz=1"], ["model=nonexistent"], ["+extra=1"]],
    ids=["valid", "nothing close", "unknown option", "an addition"],
)
def test_no_key_hint_where_a_key_is_not_mistyped(overrides):
    assert typo_hint(ROOT / "conf", "train", overrides) is None

"""predict.py: a checkpoint's top classes for image files, prepared as its test images were."""

import csv
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits
from torchvision.transforms import v2

from predict import predict, report
from src.checkpoints.restore import restore
from src.data.image.imagefolder import ImageFolderDataModule
from src.utils.errors import CheckpointError, DataError, MissingFileError
from tests.helpers import FAST, compose_config, run_script, small_image_folder_overrides
from train import train

DIGITS = 12  # images written as PNG files


@pytest.fixture(scope="module")
def digits_ckpt(tmp_path_factory):
    """A checkpoint of the default model trained one epoch on the embedded digits."""
    run_dir = tmp_path_factory.mktemp("digits_run")
    train(compose_config(run_dir, [*FAST, "test=false"]))
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def digit_pngs(tmp_path_factory):
    """The first digits as 8x8 grey PNGs (some in a sub-folder, next to a text file), and their
    pixels as written."""
    folder = tmp_path_factory.mktemp("digit_pngs")
    (folder / "more").mkdir()
    (folder / "notes.txt").write_text("not an image")
    pixels = np.round(load_digits().images[:DIGITS] * 255 / 16).astype(np.uint8)
    for index, image in enumerate(pixels):
        Image.fromarray(image).save(folder / ("more" if index % 2 else ".") / f"{index:02d}.png")
    return folder, pixels


def predict_with(tmp_path, *overrides):
    return predict(compose_config(tmp_path, list(overrides), config_name="predict"))


def run_predict(tmp_path, *overrides) -> subprocess.CompletedProcess:
    return run_script("predict.py", [f"hydra.run.dir={tmp_path}", *overrides], check=False)


def test_top1_and_probabilities_match_the_model_on_the_same_tensors(
    tmp_path, digits_ckpt, digit_pngs
):
    folder, pixels = digit_pngs
    predictions = predict_with(tmp_path, f"ckpt_path={digits_ckpt}", f"input={folder}", "top_k=3")

    restored = restore(digits_ckpt)
    model, datamodule = restored.model, restored.datamodule
    inputs = datamodule.transform(torch.from_numpy(pixels).unsqueeze(1).float() / 255)
    with torch.no_grad():
        expected = model(inputs).softmax(dim=1)
    by_name = {path.name: ranked for path, ranked in predictions}
    # Sub-folders are searched, files that are not images skipped.
    assert sorted(by_name) == [f"{index:02d}.png" for index in range(DIGITS)]
    for index in range(DIGITS):
        ranked = by_name[f"{index:02d}.png"]
        assert len(ranked) == 3
        top_label, top_probability = ranked[0]
        assert top_label == str(expected[index].argmax().item()), f"image {index}: {ranked}"
        assert top_probability == pytest.approx(expected[index].max().item(), abs=1e-5)


@pytest.mark.slow
def test_a_folder_from_the_command_line_writes_predictions_csv(tmp_path, digits_ckpt, digit_pngs):
    folder, _ = digit_pngs
    expected = {
        path.name: ranked
        for path, ranked in predict_with(
            tmp_path / "in_process", f"ckpt_path={digits_ckpt}", f"input={folder}", "top_k=2"
        )
    }
    result = run_predict(tmp_path, f"ckpt_path={digits_ckpt}", f"input={folder}", "top_k=2")
    assert result.returncode == 0, result.stderr[-2000:]
    csv_path = tmp_path / "predictions.csv"
    assert f"Predictions written to {csv_path}" in result.stdout
    with csv_path.open() as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == ["path", "label_1", "probability_1", "label_2", "probability_2"]
    assert len(rows) == DIGITS
    for row in rows:
        assert f"{row['path']}: {row['label_1']} (" in result.stdout
        (label_1, p_1), (label_2, p_2) = expected[Path(row["path"]).name]
        assert (row["label_1"], row["label_2"]) == (label_1, label_2), row
        assert float(row["probability_1"]) == pytest.approx(p_1, abs=1e-6)
        assert float(row["probability_2"]) == pytest.approx(p_2, abs=1e-6)
        assert p_1 >= p_2
        assert p_1 + p_2 <= 1 + 1e-6


def test_one_file_prints_its_top_k_and_writes_no_csv(tmp_path, digits_ckpt, digit_pngs, capsys):
    image = digit_pngs[0] / "00.png"
    predictions = predict_with(tmp_path, f"ckpt_path={digits_ckpt}", f"input={image}", "top_k=4")
    report(predictions, image, tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{image}: "), lines
    assert lines[0].count("(") == 4, lines[0]
    assert not (tmp_path / "predictions.csv").exists()


@pytest.mark.slow
def test_a_file_that_is_not_an_image_fails_with_one_clear_line(tmp_path, digits_ckpt, digit_pngs):
    text = digit_pngs[0] / "notes.txt"
    result = run_predict(tmp_path, f"ckpt_path={digits_ckpt}", f"input={text}")
    assert result.returncode == 1
    assert f"Error: {text} is not a readable image" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("ckpt", "image", "error", "message"),
    [
        ("missing.ckpt", "00.png", MissingFileError, "does not exist"),
        ("last.ckpt", "missing.png", MissingFileError, "Pass an image file or a folder"),
        ("last.ckpt", "empty", MissingFileError, "holds no images"),
        ("last.ckpt", "corrupt.png", DataError, "is not a readable image"),
    ],
)
def test_bad_paths_raise_clear_errors(
    tmp_path, digits_ckpt, digit_pngs, ckpt, image, error, message
):
    folder = tmp_path / "inputs"
    (folder / "empty").mkdir(parents=True)
    (folder / "00.png").write_bytes((digit_pngs[0] / "00.png").read_bytes())
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(error, match=message):
        predict_with(
            tmp_path / "run", f"ckpt_path={digits_ckpt.parent / ckpt}", f"input={folder / image}"
        )


def test_a_folder_with_a_corrupt_file_predicts_the_others_and_reports_one_skipped(
    tmp_path, digits_ckpt, digit_pngs, caplog
):
    folder = tmp_path / "inputs"
    folder.mkdir()
    for name in ("00.png", "02.png"):
        (folder / name).write_bytes((digit_pngs[0] / name).read_bytes())
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with caplog.at_level(logging.WARNING, logger="predict"):
        predictions = predict_with(tmp_path / "run", f"ckpt_path={digits_ckpt}", f"input={folder}")
    assert [path.name for path, _ in predictions] == ["00.png", "02.png"]
    warnings = [record.getMessage() for record in caplog.records if record.name == "predict"]
    assert len(warnings) == 1, warnings
    assert "Skipped 1 of 3 image files" in warnings[0], warnings
    assert "corrupt.png" in warnings[0], warnings


def test_a_folder_where_no_image_is_readable_fails_with_one_clear_error(tmp_path, digits_ckpt):
    folder = tmp_path / "inputs"
    folder.mkdir()
    for index in range(5):
        (folder / f"{index}.png").write_bytes(b"not a png")
    with pytest.raises(
        DataError, match=r"None of the 5 image files .*\(0.png, 1.png, 2.png and 2 more\)"
    ):
        predict_with(tmp_path / "run", f"ckpt_path={digits_ckpt}", f"input={folder}")


def test_a_checkpoint_without_its_run_config_is_refused_with_what_to_use(tmp_path, digit_pngs):
    bare = tmp_path / "bare.ckpt"
    torch.save({"state_dict": {}}, bare)
    with pytest.raises(CheckpointError, match=r"records no run config.*written by train\.py"):
        predict_with(tmp_path / "run", f"ckpt_path={bare}", f"input={digit_pngs[0]}")


def test_class_names_of_a_folder_dataset_travel_in_the_checkpoint(tmp_path, image_folder):
    overrides = small_image_folder_overrides(image_folder)
    train(compose_config(tmp_path / "train", [*overrides, *FAST, "test=false"]))
    predictions = predict_with(
        tmp_path / "predict",
        f"ckpt_path={tmp_path / 'train' / 'checkpoints' / 'last.ckpt'}",
        f"input={image_folder / 'bee'}",
        "top_k=5",
    )
    for _, ranked in predictions:
        assert sorted(label for label, _ in ranked) == ["ant", "bee", "cat"], ranked


def test_preprocess_gives_a_file_exactly_as_the_test_split_holds_it(image_folder):
    datamodule = ImageFolderDataModule(
        data_dir=str(image_folder),
        num_classes=3,
        input_shape=[3, 16, 16],
        transform=v2.Compose(
            [
                v2.Resize(16),
                v2.CenterCrop(16),
                v2.ToImage(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize([0.5] * 3, [0.25] * 3),
            ]
        ),
        precompute=False,
    )
    datamodule.setup()
    test = datamodule.datasets["test"].dataset  # TransformedDataset over a Subset of the folder
    for index in range(3):
        path, _ = test.dataset.samples[test.indices[index]]
        expected, _ = datamodule.datasets["test"][index]
        with Image.open(path) as image:
            assert torch.equal(datamodule.preprocess(image), expected), path

"""The class report callback: per-class test accuracy and the confusion matrix of classifiers."""

import csv
import logging
from pathlib import Path

import hydra
import pytest
import torch
from PIL import Image

from eval import evaluate
from src.callbacks.measurement.class_report import (
    ClassReport,
    class_results,
    console_table,
    write_csv,
)
from src.checkpoints.restore import restore
from src.models.language.language_model import LanguageModel
from tests.helpers import FAST, compose_config, quiet_trainer, small_image_folder_overrides
from train import train


def with_class_report(run_dir: Path) -> list[str]:
    # `++`: the override holds whether or not conf/callbacks/default.yaml lists the callback.
    return [
        "++callbacks.class_report._target_=src.callbacks.measurement.class_report.ClassReport",
        f"++callbacks.class_report.dirpath={run_dir}",
    ]


def read_table(path: Path) -> list[dict[str, str]]:
    with path.open() as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """One epoch on the embedded digits, tested on its best checkpoint with the class report."""
    run_dir = tmp_path_factory.mktemp("digits")
    record = train(compose_config(run_dir, [*FAST, "logger=none", *with_class_report(run_dir)]))
    return run_dir, record


def test_the_per_class_table_of_a_short_training_matches_the_models_own_test_predictions(
    digits_run,
):
    run_dir, record = digits_run
    restored = restore(record["best_model_path"])
    restored.datamodule.setup()
    images, labels = restored.datamodule.datasets["test"].tensors
    with torch.no_grad():
        predicted = restored.model(images).argmax(dim=1)

    rows = read_table(run_dir / "per_class_accuracy.csv")
    assert [row["class"] for row in rows] == [str(index) for index in range(10)]
    for index, row in enumerate(rows):
        of_class = labels == index
        samples, correct = int(of_class.sum()), int((predicted[of_class] == index).sum())
        assert (int(row["samples"]), int(row["correct"])) == (samples, correct), row
        assert float(row["accuracy"]) == pytest.approx(correct / samples, abs=1e-6), row
    total_correct = sum(int(row["correct"]) for row in rows)
    assert total_correct / len(labels) == pytest.approx(record["metrics"]["test/acc"])


def test_the_confusion_matrix_is_a_png_next_to_the_other_plots(digits_run):
    run_dir, _ = digits_run
    with Image.open(run_dir / "plots" / "confusion_matrix.png") as image:
        assert image.format == "PNG", (image.format, image.size)
        assert min(image.size) > 100, (image.format, image.size)


def test_eval_py_writes_the_same_table_for_the_checkpoint_it_tests(digits_run, tmp_path):
    run_dir, record = digits_run
    overrides = [f"ckpt_path={record['best_model_path']}", "logger=none", *FAST]
    evaluate(compose_config(tmp_path, [*overrides, *with_class_report(tmp_path)], "eval"))
    assert read_table(tmp_path / "per_class_accuracy.csv") == read_table(
        run_dir / "per_class_accuracy.csv"
    )
    assert (tmp_path / "plots" / "confusion_matrix.png").is_file()


def test_the_classes_are_named_by_the_datamodules_class_names(tmp_path, image_folder):
    cfg = compose_config(tmp_path, small_image_folder_overrides(image_folder))
    datamodule = hydra.utils.instantiate(cfg.data)
    report = ClassReport(str(tmp_path))
    quiet_trainer(callbacks=[report]).test(
        hydra.utils.instantiate(cfg.model), datamodule=datamodule
    )

    rows = read_table(tmp_path / "per_class_accuracy.csv")
    assert [row["class"] for row in rows] == ["ant", "bee", "cat"]
    assert sum(int(row["samples"]) for row in rows) == len(datamodule.datasets["test"])
    # What metrics.json records: the same accuracies, by the same names.
    assert report.accuracy == {
        row["class"]: int(row["correct"]) / int(row["samples"]) if int(row["samples"]) else None
        for row in rows
    }


def test_many_classes_list_only_the_worst_and_a_class_without_samples_has_no_accuracy(
    tmp_path,
):
    # Class i has 10 samples of which i are right, except class 5, never in the test split.
    confusion = torch.zeros(12, 12, dtype=torch.long)
    for index in range(12):
        confusion[index, index] = index
        confusion[index, (index + 1) % 12] = 10 - index
    confusion[5] = 0
    results = class_results(confusion, [f"class_{index}" for index in range(12)])

    table = console_table(results, max_rows=3, table_path=tmp_path / "t.csv").splitlines()
    assert table[0].startswith("Test accuracy of the 3 worst of 12 classes"), table
    shown = [line.split()[0] for line in table[2:]]
    assert shown == ["class_0", "class_1", "class_2"], table

    write_csv(results, tmp_path / "t.csv")
    row = read_table(tmp_path / "t.csv")[5]
    assert row == {"class": "class_5", "samples": "0", "correct": "0", "accuracy": ""}


def test_a_language_model_test_writes_no_class_report(tmp_path, caplog):
    config = dict(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    batches = [
        {"input_ids": torch.randint(0, 32, (2, 12)), "labels": torch.randint(0, 32, (2, 12))}
    ]
    report = ClassReport(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="src.callbacks.measurement.class_report"):
        quiet_trainer(callbacks=[report]).test(
            LanguageModel(config), dataloaders=torch.utils.data.DataLoader(batches, batch_size=None)
        )
    assert list(tmp_path.iterdir()) == []
    assert report.accuracy == {}
    assert not [r for r in caplog.records if r.name == "src.callbacks.measurement.class_report"], (
        caplog.text
    )

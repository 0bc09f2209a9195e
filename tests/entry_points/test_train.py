import json
import time

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from eval import evaluate
from tests.helpers import FAST, compose_config, learnable_images, small_image_folder_overrides
from train import train

# One epoch of training (seconds on every datamodule here), validation and test shortened.
LIMITS = ["trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]


@pytest.fixture(scope="module")
def tensor_file(tmp_path_factory):
    """960 learnable 8x8 images of 3 classes as float arrays: enough for one epoch to learn."""
    images, labels = learnable_images(960, 8, 3, seed=0)
    path = tmp_path_factory.mktemp("arrays") / "arrays.npz"
    np.savez(path, x=(images[:, None] / 255).astype(np.float32), y=labels)
    return path


@pytest.fixture
def data_overrides(mnist_root, image_folder, tensor_file):
    return {
        "digits": ["data=digits"],
        "mnist": ["data=mnist", f"data.data_dir={mnist_root}", "data.download=false"],
        "imagefolder": small_image_folder_overrides(image_folder),
        "tensors": [
            "data=tensors",
            f"data.path={tensor_file}",
            "data.num_classes=3",
            "data.input_shape=[1,8,8]",
        ],
    }


@pytest.mark.parametrize("data", ["digits", "mnist", "imagefolder", "tensors"])
@pytest.mark.parametrize("model", ["simplenet", "cnn"])
def test_every_model_trains_and_tests_on_every_datamodule(tmp_path, model, data, data_overrides):
    cfg = compose_config(tmp_path, [f"model={model}", *data_overrides[data], *FAST, *LIMITS])
    record = train(cfg)
    chance = 1 / cfg.data.num_classes
    accuracy = record["metrics"]["test/acc"]
    assert accuracy > 2 * chance, f"test/acc {accuracy:.3f} after one epoch; chance is {chance:.2f}"
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_short_run_learns_the_digits(tmp_path):
    record = train(compose_config(tmp_path, [*FAST, "trainer.max_epochs=10"]))
    assert record["metrics"]["test/acc"] > 0.85, "chance is 0.1: the model did not learn"
    assert record["metrics"]["val/acc_best"] >= record["metrics"]["val/acc"]


def test_metrics_json_has_final_metrics_best_checkpoint_and_wall_time(tmp_path):
    cfg = compose_config(tmp_path, [*FAST, "trainer.max_epochs=2"])
    start = time.perf_counter()
    train(cfg)
    elapsed = time.perf_counter() - start
    record = json.loads((tmp_path / "metrics.json").read_text())
    model = instantiate(cfg.model)  # every run records its model's bytes as stored
    stored = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert record["metrics"]["model/parameter_bytes"] == stored
    for key in (
        "train/loss",
        "train/acc",
        "val/loss",
        "val/acc",
        "val/acc_best",
        "test/acc",
        "test/loss",
    ):
        assert isinstance(record["metrics"][key], float), key
    assert record["best_model_path"].startswith(str(tmp_path / "checkpoints"))
    wall_time = record["wall_time_s"]  # in ms: it may round up past the time measured here
    assert 0 < wall_time <= elapsed + 1e-3, f"{wall_time} s recorded, {elapsed:.3f} s measured"


def test_checkpoints_load_weights_only_with_plain_hyperparameters(tmp_path):
    train(compose_config(tmp_path, [*FAST, "model=cnn"]))
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"] == {"num_classes": 10, "input_shape": [1, 8, 8]}
    assert (
        checkpoint["run_config"]["config"]["model"]["net"]["_target_"]
        == "src.models.vision.cnn.CNN"
    )
    assert "model=cnn" in checkpoint["run_config"]["overrides"]


def test_resume_from_last_checkpoint_continues_where_training_stopped(tmp_path):
    first = tmp_path / "first"
    train(compose_config(first, [*FAST, "trainer.max_epochs=2"]))
    last = first / "checkpoints" / "last.ckpt"
    steps_per_epoch = torch.load(last, weights_only=True)["global_step"] // 2

    resumed = tmp_path / "resumed"
    train(compose_config(resumed, [*FAST, "trainer.max_epochs=3", f"ckpt_path={last}"]))
    checkpoint = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["epoch"] == 2
    assert checkpoint["global_step"] == 3 * steps_per_epoch


def test_eval_rebuilds_the_model_from_the_checkpoint_and_matches_the_training_test(tmp_path):
    record = train(compose_config(tmp_path / "train", [*FAST, "model=cnn", "trainer.max_epochs=2"]))
    # No model=cnn here: eval.py reads the architecture from the checkpoint.
    cfg = compose_config(
        tmp_path / "eval", [f"ckpt_path={record['best_model_path']}"], config_name="eval"
    )
    result = evaluate(cfg)
    assert result["metrics"]["test/acc"] == pytest.approx(record["metrics"]["test/acc"])
    assert (tmp_path / "eval" / "metrics.json").is_file()


@pytest.mark.slow
def test_same_seed_gives_the_same_run_and_another_seed_does_not(tmp_path):
    # Random augmentation in two DataLoader workers: worker seeding is part of what is checked.
    augment = [
        "data.num_workers=2",
        "data.train_transform={_target_: torchvision.transforms.v2.RandomAffine, degrees: 15}",
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=1",
        "test=false",
    ]

    def final_weights(name, seed):
        train(compose_config(tmp_path / name, [*FAST, *augment, f"seed={seed}"]))
        return torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)[
            "state_dict"
        ]["net.fc1.weight"]

    reference = final_weights("a", 7)
    assert torch.equal(reference, final_weights("b", 7))
    assert not torch.equal(reference, final_weights("c", 8))

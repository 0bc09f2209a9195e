"""Freezing layers, exporting weights and starting new runs from them."""

import json

import pytest
import torch
from hydra.utils import instantiate

from src.models.vision.cnn import CNN
from src.utils.errors import CheckpointError
from src.utils.weights import load_network_weights, read_weights
from tests.helpers import (
    FAST,
    TINY_LM,
    compose_config,
    run_script,
    shakespeare_excerpt,
    text_lm_overrides,
)
from train import train


def weights(run_dir, name="last.ckpt"):
    return torch.load(run_dir / "checkpoints" / name, weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def trained_cnn(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cnn")
    record = train(compose_config(run_dir, [*FAST, "model=cnn", "trainer.max_epochs=2"]))
    return run_dir, record


def test_train_only_fc2_leaves_every_other_weight_bit_identical(tmp_path, trained_cnn):
    start, _ = trained_cnn
    cfg = compose_config(
        tmp_path,
        [
            *FAST,
            "model=cnn",
            "callbacks=freeze",
            "callbacks.freeze.train_only=[fc2]",
            f"model.pretrained={start / 'checkpoints' / 'last.ckpt'}",
            "callbacks.rich_progress_bar=null",
            "callbacks.model_summary=null",
        ],
    )
    train(cfg)
    before, after = weights(start), weights(tmp_path)
    for key in before:
        if not key.startswith("net."):
            continue
        changed = not torch.equal(before[key], after[key])
        assert changed == key.startswith("net.fc2"), f"{key} changed={changed}"
    summary = (tmp_path / "model_summary.txt").read_text()
    assert "Trainable params: 1,290" in summary  # fc2 of the CNN: 128 * 10 + 10


def test_freeze_patterns_then_unfreeze_at_a_later_epoch(tmp_path):
    cfg = compose_config(
        tmp_path,
        [
            *FAST,
            "model=cnn",
            "callbacks=freeze",
            "callbacks.freeze.train_only=null",
            "callbacks.freeze.freeze=[conv*]",
            "callbacks.freeze.unfreeze_at_epoch=1",
            "trainer.max_epochs=2",
            "callbacks.last_checkpoint.save_top_k=-1",
        ],
    )
    train(cfg)
    epoch_0 = weights(tmp_path, "step_00000020.ckpt")
    epoch_1 = weights(tmp_path, "step_00000040.ckpt")
    torch.manual_seed(42)  # the seed the run used: its initial convolution weights
    initial = CNN([1, 8, 8], 10).state_dict()
    assert torch.equal(epoch_0["net.conv1.weight"], initial["conv1.weight"])
    assert not torch.equal(epoch_1["net.conv1.weight"], epoch_0["net.conv1.weight"])
    optimizer = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)[
        "optimizer_states"
    ][0]
    lrs = sorted(group["lr"] for group in optimizer["param_groups"])
    assert lrs == pytest.approx([1e-4, 1e-3])  # unfrozen group at 0.1 x the base rate


def test_patterns_that_match_nothing_list_the_modules(tmp_path):
    cfg = compose_config(
        tmp_path, [*FAST, "callbacks=freeze", "callbacks.freeze.train_only=[head]"]
    )
    with pytest.raises(ValueError, match=r"choose among: net\.fc1, net\.fc2"):
        train(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "filename"), [("safetensors", "model.safetensors"), ("state_dict", "model.pt")]
)
def test_export_then_pretrained_gives_the_same_predictions(tmp_path, trained_cnn, fmt, filename):
    run_dir, record = trained_cnn
    best = record["best_model_path"]
    out = tmp_path / "export"
    run_script("scripts/export.py", [f"ckpt_path={best}", f"format={fmt}", f"hydra.run.dir={out}"])
    assert (out / "config.yaml").read_text().count("src.models.vision.cnn.CNN") == 1
    exported = read_weights(out / filename)
    assert set(exported) == {
        k.removeprefix("net.") for k in weights(run_dir) if k.startswith("net.")
    }

    reference, restored = CNN([1, 8, 8], 10).eval(), CNN([1, 8, 8], 10).eval()
    load_network_weights(reference, best)
    load_network_weights(restored, out / filename)
    images = torch.randn(16, 1, 8, 8)
    assert torch.equal(reference(images), restored(images))

    rerun = compose_config(
        tmp_path / "rerun",
        [*FAST, "model=cnn", "train=false", f"model.pretrained={out / filename}"],
    )
    assert train(rerun)["metrics"]["test/acc"] == pytest.approx(record["metrics"]["test/acc"])


def test_weights_of_another_model_name_the_offending_keys(trained_cnn):
    run_dir, _ = trained_cnn
    from src.models.vision.simplenet import SimpleNet

    with pytest.raises(CheckpointError) as error:
        load_network_weights(SimpleNet([1, 8, 8], 10), run_dir / "checkpoints" / "last.ckpt")
    message = str(error.value)
    assert "conv1.weight" in message
    assert "fc1.weight: file [128, 256], model [128, 64]" in message


def test_metrics_json_of_a_frozen_run_is_complete(tmp_path):
    train(compose_config(tmp_path, [*FAST, "callbacks=freeze"]))
    metrics = json.loads((tmp_path / "metrics.json").read_text())["metrics"]
    assert "test/acc" in metrics


def test_the_lm_trains_only_its_last_decoder_layer_and_final_norm(tmp_path):
    overrides = [
        *FAST,
        *TINY_LM,
        *text_lm_overrides(shakespeare_excerpt(tmp_path, 4000)),
        "data.max_seq_len=64",
        "data.batch_size=4",
        "callbacks=freeze",
        "callbacks.freeze.train_only=[model.norm]",
        "callbacks.freeze.train_last_n=1",
        "test=false",
    ]
    cfg = compose_config(tmp_path / "run", overrides)
    torch.manual_seed(cfg.seed)  # train() draws the same initial weights
    initial = {f"net.{k}": v.clone() for k, v in instantiate(cfg.model).net.state_dict().items()}
    train(cfg)
    after = weights(tmp_path / "run")
    trained = ("net.model.layers.3.", "net.model.norm.")
    for key, value in initial.items():
        changed = not torch.equal(value, after[key])
        assert changed == key.startswith(trained), f"{key} changed={changed}"

"""Torchvision backbones (model=resnet18, model=vit_b_16) on image folders: their weights,
their new head, a frozen backbone and the classes counted from the folder."""

import logging

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torchvision import models

from src.data.image.imagefolder import image_classes
from src.models.vision.backbones import torchvision_backbone
from src.utils.errors import (
    CheckpointError,
    ConfigError,
    MissingFileError,
)
from tests.helpers import FAST, compose_config, user_error, write_image_folder
from train import train

SIZES = {"resnet18": 32, "vit_b_16": 32}  # small images: 2x2 patches for the ViT
HEADS = {"resnet18": "fc", "vit_b_16": "heads.head"}


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """Three classes (ant, bee, cat) of four images each."""
    return write_image_folder(tmp_path_factory.mktemp("images"), per_class=4)


def backbone_run(model: str, folder, *extra: str) -> list[str]:
    """Two training steps of `model` on `folder` at a small image size, batch 2."""
    size = SIZES[model]
    return [
        *FAST,
        f"model={model}",
        "data=imagefolder",
        f"data.data_dir={folder}",
        f"data.input_shape=[3,{size},{size}]",
        f"data.transform.transforms.0.size={size}",
        f"data.transform.transforms.1.size={size}",
        "data.train_transform=null",
        "data.num_workers=0",
        "data.pin_memory=false",
        "data.batch_size=2",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0",
        "logger=none",
        "test=false",
        *extra,
    ]


def saved_imagenet_network(model: str, path, **options) -> dict[str, torch.Tensor]:
    """A torchvision `model` with its 1000-class ImageNet head, saved as a state dict at `path`."""
    torch.manual_seed(7)
    state = models.get_model(model, **options).state_dict()
    if path.suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save(state, path)
    return state


def last_weights(run_dir) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    state = checkpoint["state_dict"]
    return {key.removeprefix("net."): value for key, value in state.items() if key[:4] == "net."}


def resnet18_backbone(weights: str | None):
    """model=resnet18's network for 3 classes of 32x32 images, starting from `weights`."""
    return torchvision_backbone("resnet18", "fc", 3, [3, 32, 32], weights=weights)


def is_head(model: str, key: str) -> bool:
    return key.startswith(f"{HEADS[model]}.")


@pytest.mark.parametrize("model", ["resnet18", pytest.param("vit_b_16", marks=pytest.mark.slow)])
def test_backbone_trains_from_random_weights_with_a_head_for_the_folders_classes(
    tmp_path, image_folder, model
):
    cfg = compose_config(tmp_path, backbone_run(model, image_folder))
    assert cfg.data.num_classes == 3, "the classes are counted from ant/, bee/, cat/"
    record = train(cfg)
    assert record["metrics"]["val/acc"] >= 0
    weights = last_weights(tmp_path)
    assert weights[f"{HEADS[model]}.weight"].shape[0] == 3


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_a_weights_file_loads_the_backbone_and_leaves_a_new_head(
    tmp_path, image_folder, suffix, caplog
):
    path = tmp_path / f"resnet18{suffix}"
    saved = saved_imagenet_network("resnet18", path)
    cfg = compose_config(
        tmp_path, backbone_run("resnet18", image_folder, f"model.net.weights={path}")
    )
    with caplog.at_level(logging.INFO, logger="src.models.vision.backbones"):
        net = instantiate(cfg.model).net
    loaded = net.state_dict()
    for key, value in saved.items():
        if not is_head("resnet18", key):
            assert torch.equal(loaded[key], value), f"{key} differs from the file's"
    assert net.fc.out_features == 3
    assert not torch.equal(loaded["fc.bias"], saved["fc.bias"][:3])
    assert f"backbone weights from {path}; the 3-class head fc is new" in caplog.text


def test_a_weights_name_loads_torchvisions_file_from_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # where torchvision keeps its downloads
    cache = tmp_path / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    url = models.ResNet18_Weights.IMAGENET1K_V1.url
    saved = saved_imagenet_network("resnet18", cache / url.rsplit("/", 1)[-1])
    for name in ("IMAGENET1K_V1", "ResNet18_Weights.IMAGENET1K_V1", "DEFAULT"):
        net = resnet18_backbone(name)
        assert torch.equal(net.state_dict()["layer4.1.bn2.weight"], saved["layer4.1.bn2.weight"])


@pytest.mark.slow
def test_callbacks_freeze_trains_only_the_new_head_of_resnet18(tmp_path, image_folder):
    path = tmp_path / "resnet18.safetensors"
    saved = saved_imagenet_network("resnet18", path)
    freeze = [
        f"model.net.weights={path}",
        "callbacks=freeze",
        "callbacks.freeze.train_only=[fc]",
        "callbacks.freeze.train_bn=false",
        "callbacks.rich_progress_bar=null",
        "callbacks.model_summary=null",
    ]
    cfg = compose_config(tmp_path / "run", backbone_run("resnet18", image_folder, *freeze))
    torch.manual_seed(cfg.seed)  # train() draws the same initial head
    initial_head = instantiate(cfg.model).net.fc.weight.detach().clone()
    train(cfg)
    after = last_weights(tmp_path / "run")
    for key, value in saved.items():
        if not is_head("resnet18", key):
            assert torch.equal(after[key], value), f"{key} changed although frozen"
    assert not torch.equal(after["fc.weight"], initial_head), "the head did not train"


@pytest.mark.slow
def test_callbacks_freeze_trains_only_the_new_head_of_vit_b_16(tmp_path, image_folder):
    path = tmp_path / "vit_b_16.pth"
    saved = saved_imagenet_network("vit_b_16", path, image_size=SIZES["vit_b_16"])
    freeze = [
        f"model.net.weights={path}",
        "callbacks=freeze",
        "callbacks.freeze.train_only=[heads.head]",
        "callbacks.rich_progress_bar=null",
        "callbacks.model_summary=null",
    ]
    cfg = compose_config(tmp_path / "run", backbone_run("vit_b_16", image_folder, *freeze))
    torch.manual_seed(cfg.seed)
    initial_head = instantiate(cfg.model).net.heads.head.weight.detach().clone()
    train(cfg)
    after = last_weights(tmp_path / "run")
    for key, value in saved.items():
        if not is_head("vit_b_16", key):
            assert torch.equal(after[key], value), f"{key} changed although frozen"
    assert after["heads.head.weight"].shape == (3, 768)
    assert not torch.equal(after["heads.head.weight"], initial_head), "the head did not train"


def test_an_unknown_weights_name_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="choose one of IMAGENET1K_V1, DEFAULT"):
        resnet18_backbone("IMAGENET22K")


def test_a_weights_file_of_another_network_names_its_keys_in_one_line(tmp_path):
    state = models.resnet18().state_dict()
    del state["layer1.0.conv1.weight"]
    state["extra.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError) as raised:
        resnet18_backbone(str(tmp_path / "other.safetensors"))
    message = str(raised.value)
    assert "missing in the file (1): layer1.0.conv1.weight [64, 64, 3, 3]" in message, message
    assert "not in the model (1): extra.weight" in message, message
    assert "\n" not in message


def test_a_weights_file_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(
        MissingFileError, match=r"model\.net\.weights=.*missing\.pth' does not exist"
    ):
        resnet18_backbone(str(tmp_path / "missing.pth"))


@pytest.mark.parametrize("data", ["digits", "mnist"])
def test_grey_scale_data_is_refused_naming_the_data_that_fits(tmp_path, data):
    with pytest.raises(Exception) as raised:  # noqa: PT011 - Hydra may wrap it: user_error unwraps
        train(compose_config(tmp_path, [*FAST, "model=resnet18", f"data={data}"]))
    message = str(user_error(raised.value))
    assert "model=resnet18 takes RGB images" in message, message
    assert "data=imagefolder" in message, message
    assert "model=cnn" in message, message


@pytest.mark.parametrize(
    ("shape", "reason"),
    [("[3,32,48]", "Wrong image width! Expected 32"), ("[3,8,8]", "indivisible by patch size")],
)
def test_vit_b_16_refuses_images_it_cannot_take(tmp_path, image_folder, shape, reason):
    overrides = [*backbone_run("vit_b_16", image_folder), f"data.input_shape={shape}"]
    with pytest.raises(Exception) as raised:  # noqa: PT011 - Hydra may wrap it: user_error unwraps
        instantiate(compose_config(tmp_path, overrides).model)
    message = str(user_error(raised.value))
    assert "model=vit_b_16 cannot take images of data.input_shape=" in message, message
    assert reason in message, message
    assert "\n" not in message, message


def test_an_explicit_num_classes_wins_over_the_folders(tmp_path, image_folder):
    cfg = compose_config(tmp_path, [*backbone_run("resnet18", image_folder), "data.num_classes=5"])
    assert cfg.data.num_classes == 5
    assert cfg.model.net.num_classes == 5


def test_classes_are_counted_in_the_train_folder_when_there_is_one(tmp_path):
    write_image_folder(tmp_path / "train", per_class=1, classes=("a", "b", "c", "d"))
    write_image_folder(tmp_path / "val", per_class=1, classes=("a", "b", "c", "d"))
    assert image_classes(str(tmp_path)) == 4


def test_a_folder_without_class_folders_says_so_when_counting_classes(tmp_path):
    (tmp_path / "images").mkdir()
    cfg = compose_config(tmp_path / "run", backbone_run("resnet18", tmp_path / "images"))
    with pytest.raises(Exception) as raised:  # noqa: PT011 - Hydra may wrap it: user_error unwraps
        OmegaConf.to_container(cfg.data, resolve=True)
    message = str(user_error(raised.value))
    assert "class folder" in message, message
    assert "one sub-folder per class" in message, message

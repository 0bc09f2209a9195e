"""Torchvision's image classifiers (resnet18, vit_b_16, ...) with a new head for the data's classes.

They start from random, published or local ImageNet weights.
"""

import logging
from pathlib import Path

import torch
from torch import nn
from torchvision import models

from src.utils.errors import CheckpointError, ConfigError, MissingFileError
from src.utils.weights import describe_mismatch, read_weights

log = logging.getLogger(__name__)

WEIGHTS_FILES = (".pth", ".pt", ".safetensors")


def torchvision_backbone(
    name: str,
    head: str,
    num_classes: int,
    input_shape: list[int],
    weights: str | None = None,
    **options,
) -> nn.Module:
    """Torchvision's `name` network for images of `input_shape`, with a new `head` Linear layer.

    The new head is randomly initialised, with `num_classes` outputs.

    `weights` is null (random weights), the name of torchvision's published weights
    (`IMAGENET1K_V1`, `ResNet18_Weights.IMAGENET1K_V1`, `DEFAULT`: downloaded once into the
    torch hub cache) or a local state dict of the network (.pth, .pt, .safetensors), e.g. with
    its ImageNet head: every weight but the head's is loaded. `options` go to torchvision's
    builder (`image_size` for vit_b_16).
    """
    net = build_network(name, input_shape, options)
    replace_head(net, name, head, num_classes)
    if weights is None:
        log.info("%s: random initial weights, %d-class head %s", name, num_classes, head)
        return net
    state, source = read_backbone_weights(name, weights)
    load_backbone(net, name, head, state, source)
    log.info(
        "%s: backbone weights from %s; the %d-class head %s is new (random init)",
        name,
        source,
        num_classes,
        head,
    )
    return net


def replace_head(net: nn.Module, name: str, head: str, num_classes: int) -> None:
    """Swap the Linear layer at `head` (e.g. `fc`, `heads.head`) for one with `num_classes`."""
    parent_name, _, attribute = head.rpartition(".")
    old = getattr(net.get_submodule(parent_name), attribute, None)
    if not isinstance(old, nn.Linear):
        raise ConfigError(
            f"model.net.head={head!r} is not the Linear classifier layer of {name} "
            f"(found {type(old).__name__}): name the module that maps features to classes."
        )
    setattr(net.get_submodule(parent_name), attribute, nn.Linear(old.in_features, num_classes))


def build_network(name: str, input_shape: list[int], options: dict) -> nn.Module:
    """Torchvision's `name` network with random weights, checked to take images of `input_shape`.

    The check runs one image: a misfit fails now, in one line, not at the first step.
    """
    input_shape = list(input_shape)
    if len(input_shape) != 3 or input_shape[0] != 3:
        raise ConfigError(
            f"model={name} takes RGB images, data.input_shape [3, height, width], but the data "
            f"has input_shape {input_shape}. Use image data such as data=imagefolder; for "
            f"grey-scale data such as data=digits or data=mnist choose model=cnn or "
            f"model=simplenet."
        )
    builder = models.get_model_builder(name)
    try:
        net = builder(weights=None, **options)
        with torch.no_grad():
            net.eval()(torch.zeros(1, *input_shape))  # eval: batch norms refuse one image
    except (RuntimeError, AssertionError, ValueError) as error:
        raise ConfigError(
            f"model={name} cannot take images of data.input_shape={input_shape}: "
            f"{str(error).splitlines()[0]}"
        ) from None
    return net.train()


def read_backbone_weights(name: str, weights: str) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict that `weights` names (a file or torchvision's weights) and its source."""
    if Path(weights).suffix in WEIGHTS_FILES:
        if not Path(weights).is_file():
            raise MissingFileError(
                f"model.net.weights={weights!r} does not exist. Pass a state dict file "
                f"({', '.join(WEIGHTS_FILES)}) or the name of torchvision's weights for {name}."
            )
        return read_weights(weights), weights
    published = models.get_model_weights(name)
    key = weights.removeprefix(f"{published.__name__}.")
    if key not in published.__members__:
        raise ConfigError(
            f"model.net.weights={weights!r} is neither a weights file ({', '.join(WEIGHTS_FILES)}) "
            f"nor weights torchvision publishes for {name}: choose one of "
            f"{', '.join(published.__members__)} (also as {published.__name__}.<name>)."
        )
    chosen = published[key]
    try:
        state = chosen.get_state_dict(progress=True, map_location="cpu", weights_only=True)
    except OSError as error:  # no network: urllib's URLError is an OSError
        raise CheckpointError(
            f"Could not download {published.__name__}.{chosen.name} from {chosen.url} ({error}). "
            f"Without internet, download that file elsewhere and pass it: "
            f"model.net.weights=/path/to/{chosen.url.rsplit('/', 1)[-1]}"
        ) from None
    return state, f"{published.__name__}.{chosen.name}"


def load_backbone(
    net: nn.Module, name: str, head: str, state: dict[str, torch.Tensor], source: str
) -> None:
    """Load every weight of `state` but the head's into `net`, or name the keys that differ."""

    def backbone_only(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: value for key, value in tensors.items() if not key.startswith(f"{head}.")}

    backbone = backbone_only(state)
    if problems := describe_mismatch(backbone_only(net.state_dict()), backbone):
        raise CheckpointError(
            f"The weights in {source} do not fit {name}'s backbone: {problems}. Pass the "
            f"state_dict of torchvision's {name} built with the same options."
        )
    net.load_state_dict(backbone, strict=False)

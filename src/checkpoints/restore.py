"""A trained run rebuilt from its checkpoint, for use outside training: `restore(ckpt_path)`.

The checkpoint's stored run config says which classes to build (by `_target_`, so this layer
imports no model or data code); the weights and the datamodule's state (class names, the
tokenizer) come from the checkpoint itself. Nothing here reads the dataset. eval.py,
predict.py, scripts/generate.py and scripts/export.py all start from `restore`.
"""

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from lightning.pytorch import LightningDataModule, LightningModule
from omegaconf import DictConfig, OmegaConf

from src.utils.contracts import TokenizedData, Tokenizer
from src.utils.errors import CheckpointError, ConfigError
from src.utils.weights import describe_mismatch, load_checkpoint

log = logging.getLogger(__name__)

# Arguments only training uses: a model class that requires one is given None for inference.
TRAINING_ONLY = ("optimizer", "scheduler")
# What a checkpoint's config may name as a `_target_`: a class of the template or of these
# libraries (or any of their callables as a `_partial_`, which restoring never calls), and
# get_object, which only looks a value up. A checkpoint loads weights-only, yet its config is
# data that names code: without this, `{_target_: builtins.open, ...}` would run on restore.
# Add your own package here if its models or datamodules live outside src/.
TRUSTED_PREFIXES = ("src.", "torch.optim.", "torchvision.transforms.")
TRUSTED_TARGETS = ("hydra.utils.get_object",)
_ABSENT = object()
# Where the modules a stored config names live since src/ was grouped by domain: a checkpoint
# written before names `src.models.cnn.CNN`, which is `src.models.vision.cnn.CNN` now.
MOVED_MODULES = {
    "src.data.digits": "src.data.image.digits",
    "src.data.image": "src.data.image.datamodule",
    "src.data.imagefolder": "src.data.image.imagefolder",
    "src.data.mnist": "src.data.image.mnist",
    "src.data.tensors": "src.data.image.tensors",
    "src.data.text": "src.data.text.pretraining",
    "src.data.packed_text": "src.data.text.packed_text",
    "src.data.sft": "src.data.text.sft",
    "src.data.byte_text": "src.data.text.byte_text",
    "src.data.streaming": "src.data.text.streaming",
    "src.data.synthetic_sft": "src.data.text.synthetic_sft",
    "src.data.chat_template": "src.data.text.chat_template",
    "src.data.readers": "src.data.corpus.readers",
    "src.data.tokenizers": "src.data.corpus.tokenizers",
    "src.data.encoding": "src.data.corpus.encoding",
    "src.data.token_store": "src.data.corpus.token_store",
    "src.data.rows": "src.data.corpus.rows",
    "src.data.packing": "src.data.packing.packing",
    "src.data.collate": "src.data.packing.collate",
    "src.data.packing_checks": "src.data.packing.checks",
    "src.models.backbones": "src.models.vision.backbones",
    "src.models.classifier": "src.models.vision.classifier",
    "src.models.cnn": "src.models.vision.cnn",
    "src.models.simplenet": "src.models.vision.simplenet",
    "src.models.language_model": "src.models.language.language_model",
    "src.models.adapters": "src.models.language.adapters",
    "src.models.exact_match": "src.models.language.exact_match",
    "src.models.parallel": "src.models.language.parallel",
    "src.models.qwen": "src.models.language.qwen",
}
MOVED_QWEN = "src.models.qwen"  # a package: its modules moved with it


@dataclass(frozen=True)
class Restored:
    """A run as its checkpoint holds it."""

    config: DictConfig  # the run's resolved config, with the overrides applied
    model: LightningModule  # weights loaded, in eval mode, on the CPU
    datamodule: LightningDataModule  # its checkpointed state loaded; not set up
    tokenizer: Tokenizer | None  # the datamodule's tokenizer; None for image data
    checkpoint: dict[str, Any]


def restore(ckpt_path: str | Path, overrides: Sequence[str] = ()) -> Restored:
    """Rebuild the model, datamodule and tokenizer of a train.py checkpoint as the run had them.

    `overrides` (`data.batch_size=8`, `+key=value`, `~key`) change keys of the stored config
    first.
    """
    checkpoint = load_checkpoint(ckpt_path)
    stored = checkpoint.get("run_config")
    if stored is None:
        raise CheckpointError(
            f"{ckpt_path} records no run config, so the model it holds cannot be rebuilt. Use a "
            f"checkpoint written by train.py (e.g. <run dir>/checkpoints/last.ckpt)."
        )
    config = apply_overrides(OmegaConf.create(moved_targets(stored["config"])), overrides)
    for group in ("model", "data"):
        check_targets(OmegaConf.to_container(config[group]), f"{ckpt_path}: {group}")
    built = checkpoint.get("hyper_parameters", {}).get("config")
    model = hydra.utils.instantiate(inference_node(config.model, ckpt_path, built))
    # As Trainer does before loading: the model may complete its state there (a LoRA run's
    # checkpoint names its frozen base instead of holding it, src/models/language/adapters.py).
    model.on_load_checkpoint(checkpoint)
    if problems := describe_mismatch(model.state_dict(), checkpoint["state_dict"]):
        raise CheckpointError(
            f"The weights in {ckpt_path} do not fit {config.model._target_} as it is built "
            f"now: {problems}. Was the model's code changed since the run?"
        )
    model.load_state_dict(checkpoint["state_dict"])
    datamodule = hydra.utils.instantiate(config.data)
    # Lightning saves `datamodule.state_dict()` under the class's qualified name.
    datamodule.load_state_dict(checkpoint.get(type(datamodule).__qualname__, {}))
    tokenizer = datamodule.tokenizer if isinstance(datamodule, TokenizedData) else None
    return Restored(config, model.eval(), datamodule, tokenizer, checkpoint)


def moved_targets(node: Any) -> Any:
    """`node` with every `_target_` in a module that has moved (MOVED_MODULES) renamed."""
    if isinstance(node, list):
        return [moved_targets(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: moved_targets(value) for key, value in node.items()}
    if isinstance(target := node.get("_target_"), str):
        module, _, name = target.rpartition(".")
        if module in MOVED_MODULES:
            node["_target_"] = f"{MOVED_MODULES[module]}.{name}"
        elif module.startswith(f"{MOVED_QWEN}."):
            node["_target_"] = target.replace(MOVED_QWEN, MOVED_MODULES[MOVED_QWEN], 1)
    return node


def check_targets(node: Any, where: str) -> None:
    """Refuse a config that names a class outside TRUSTED_PREFIXES, before importing anything."""
    if isinstance(node, list):
        for item in node:
            check_targets(item, where)
        return
    if not isinstance(node, dict):
        return
    target = node.get("_target_")
    if target is not None:
        trusted = target in TRUSTED_TARGETS or (
            isinstance(target, str) and target.startswith(TRUSTED_PREFIXES)
        )
        if trusted and target not in TRUSTED_TARGETS and not node.get("_partial_"):
            trusted = inspect.isclass(hydra.utils.get_object(target))
        if not trusted:
            raise CheckpointError(
                f"Refusing to restore {where}: its config names {target!r} to build, which is "
                f"not a class of the template ({', '.join(TRUSTED_PREFIXES)}). A checkpoint's "
                f"config could otherwise run any code; if you wrote it, add the package to "
                f"TRUSTED_PREFIXES in src/checkpoints/restore.py."
            )
    for value in node.values():
        check_targets(value, where)


def apply_overrides(config: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Apply Hydra command-line overrides to the keys of a stored `config`, as Hydra would.

    Group choices (`model=cnn`) are refused: the weights only fit the stored model.
    """
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as error:
        raise ConfigError(str(error)) from None
    for override in parsed:
        key, line = override.key_or_group, override.input_line
        current = OmegaConf.select(config, key, default=_ABSENT)
        if "." not in key and isinstance(current, DictConfig):
            raise ConfigError(
                f"{line}: a checkpoint's weights only fit the model it was trained as, so its "
                f"config groups cannot be chosen again. Override keys of its stored config "
                f"instead, e.g. data.data_dir=<folder> or data.batch_size=8."
            )
        if override.is_sweep_override():
            raise ConfigError(f"{line}: a checkpoint is restored with one value per key.")
        if override.is_delete():
            if current is _ABSENT:
                raise ConfigError(f"{line}: {key} is not in the checkpoint's config.")
            parent, _, leaf = key.rpartition(".")
            del (OmegaConf.select(config, parent) if parent else config)[leaf]
        elif override.is_add() and current not in (_ABSENT, None):
            raise ConfigError(f"{line}: {key} is already set; override it with {key}=...")
        elif not (override.is_add() or override.is_force_add()) and current is _ABSENT:
            raise ConfigError(f"{line}: {key} is not in the checkpoint's config; add it: +{line}")
        else:
            OmegaConf.update(config, key, override.value(), merge=True, force_add=True)
    return config


def inference_node(
    node: DictConfig, ckpt_path: str | Path, built_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Make the stored model config buildable for inference by the class as it is now.

    - No starting weights: the checkpoint has them (an adapter run keeps `pretrained`, its base,
      where that folder still exists).
      The architecture is then the one built (`built_config`, the checkpoint's hyperparameters),
      which a `pretrained` folder decided, whatever sizes the model's YAML gave.
    - None for a required training-only argument that is not stored.
    - Keys the signature no longer takes are dropped with a warning (a checkpoint older than the
      class).
    """
    spec = cast(dict[str, Any], OmegaConf.to_container(node))  # keys: the model's argument names
    if spec.get("adapter") and spec.get("pretrained") and not Path(spec["pretrained"]).exists():
        # A LoRA run whose base folder moved: built without it, the adapter's checkpoint entry
        # names where the base was and how to give its new place.
        spec["pretrained"] = None
    if "pretrained" in spec and not spec.get("adapter"):
        if spec["pretrained"] and built_config is not None and "config" in spec:
            spec["config"] = built_config
            spec.pop("explicit_config", None)  # checked against the folder at training time
        spec["pretrained"] = None
    parameters = inspect.signature(hydra.utils.get_object(spec["_target_"])).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    retired = [k for k in spec if not (takes_any or k.startswith("_") or k in parameters)]
    if retired:
        log.warning(
            "%s: the stored model config has keys that %s no longer takes, left out: %s",
            ckpt_path,
            spec["_target_"],
            ", ".join(retired),
        )
        spec = {key: value for key, value in spec.items() if key not in retired}
    for name in TRAINING_ONLY:
        required = name in parameters and parameters[name].default is inspect.Parameter.empty
        if required and name not in spec:
            spec[name] = None
    return spec

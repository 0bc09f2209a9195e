"""Catch missing and wrongly typed config values before anything is built, naming the fix.

A value of the wrong type (`trainer.max_epochs=ten`), or a key the target takes no argument
for (`+model.hidden=64`), would otherwise surface as a traceback deep inside the object that
received it. This walks every `_target_` node, reads the target's signature, refuses keys it
lacks and compares each plain value with the parameter's annotation. A required value left
unset (`???`, e.g. `data.path` of data=tensors) would surface as OmegaConf's
MissingMandatoryValue traceback wherever it is first read; it is named up front instead.
"""

import difflib
import inspect
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, DictKeyType, ListConfig, OmegaConf

from src.run.lr_scaling import LR_SCALING_KEYS
from src.utils.errors import ConfigError


def check_config_types(cfg: DictConfig, path: str = "") -> None:
    """Raise ConfigError for unset required values, else for the first value of a wrong type.

    A value's type is wrong when it contradicts the signature of the target it is passed to.
    """
    if not path:
        check_model_fits_data(cfg)
        check_required_values(cfg)
        check_optimizer_values(cfg)
        check_positive_counts(cfg)
        check_adapter_model(cfg)
        check_lr_monitor_has_a_logger(cfg)
    _check_target_nodes(cfg, path)


def _check_target_nodes(cfg: DictConfig | ListConfig, path: str) -> None:
    """Check the values of every `_target_` node below `cfg`, whose dotted key is `path`."""
    for key, node in _items(cfg):
        child_path = f"{path}.{key!s}" if path else str(key)
        if isinstance(node, DictConfig | ListConfig):
            if isinstance(node, DictConfig) and "_target_" in node:
                _check_target_node(node, child_path)
            _check_target_nodes(node, child_path)


def check_required_values(cfg: DictConfig) -> None:
    """Raise ConfigError naming every required value (`???`) that no option or override set."""
    missing = sorted(_missing_keys(OmegaConf.to_container(cfg, resolve=False)))
    if missing:
        settings = " ".join(f"{key}=..." for key in missing)
        raise ConfigError(
            f"Required config value{'s' if len(missing) > 1 else ''} not set: "
            f"{', '.join(missing)}. Set {'them' if len(missing) > 1 else 'it'} on the command "
            f"line: {settings}"
        )


def _missing_keys(value: Any, path: str = "") -> list[str]:
    """List the dotted keys of `???` in a config made plain without resolving it.

    Left unresolved, an interpolation of a missing value (such as
    model.num_classes=${data.num_classes}) is not reported twice.
    """
    if value == "???":
        return [path]
    if not isinstance(value, dict | list):
        return []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return [
        key
        for child, item in items
        for key in _missing_keys(item, f"{path}.{child}" if path else str(child))
    ]


def check_model_fits_data(cfg: DictConfig) -> None:
    """Refuse a model and a datamodule whose kinds of batch differ, naming the options that fit.

    For example `model=qwen3_tiny` on images or `model=cnn` on text. It runs first: otherwise a
    missing interpolation (the classifier's `${data.num_classes}`) or the first batch fails
    less clearly. The kinds are the classes' `batch_kind` (src/utils/contracts.py), read without
    building anything.
    """
    model_kind, data_kind = (_batch_kind(cfg.get(group)) for group in ("model", "data"))
    if model_kind is None or data_kind is None or model_kind == data_kind:
        return
    choices = _choices()
    model, data = (choices.get(group) or cfg[group]._target_ for group in ("model", "data"))
    conf = Path(str(cfg.paths.root_dir)) / "conf" if "paths" in cfg else None
    raise ConfigError(
        f"model={model} trains on {model_kind}, but data={data} yields {data_kind}. Choose "
        f"data that fits the model ({_options_of_kind(conf, 'data', model_kind)}) or a model "
        f"that fits the data ({_options_of_kind(conf, 'model', data_kind)})."
    )


def _batch_kind(node: Any) -> str | None:
    if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
        return None
    try:
        return getattr(hydra.utils.get_object(node._target_), "batch_kind", None)
    except Exception:  # noqa: BLE001 - an unknown target is instantiate's to report
        return None


def _choices() -> dict[str, str]:
    """The option chosen in each config group, where Hydra composed the config."""
    if not HydraConfig.initialized():
        return {}
    return {group: str(option) for group, option in HydraConfig.get().runtime.choices.items()}


def _options_of_kind(conf: Path | None, group: str, kind: str) -> str:
    """`group=<option>` for each option in conf/<group>/ whose class takes or yields `kind`."""
    options = []
    for path in sorted(conf.glob(f"{group}/*.yaml")) if conf else []:
        if _batch_kind(OmegaConf.load(path)) == kind:
            options.append(f"{group}={path.stem}")
    return ", ".join(options) or f"another {group}= option"


def check_optimizer_values(cfg: DictConfig) -> None:
    """Name an optimizer value that the optimizer refuses, before training starts.

    It builds the optimizer on one dummy parameter, so that `optimizer.lr=-1` or betas outside
    [0, 1) do not surface as a traceback from inside Lightning's first step. Other failures (an
    unknown key, added or removed elsewhere) are left to the run.
    """
    optimizer = cfg.get("optimizer")
    if not isinstance(optimizer, DictConfig) or "_target_" not in optimizer:
        return
    try:
        build = hydra.utils.instantiate(optimizer)
        build([torch.nn.Parameter(torch.zeros(1))])
    except ValueError as error:
        values = " ".join(
            f"optimizer.{key!s}={value}" for key, value in optimizer.items() if str(key)[0] != "_"
        )
        raise ConfigError(
            f"{optimizer._target_} refuses this config ({values}): {error}. Fix the value it "
            f"names on the command line, e.g. optimizer.lr=1e-3."
        ) from None
    except Exception:  # noqa: BLE001 - anything else is the run's to report
        return


# Counts that Lightning and torch divide by without checking them first: 0 would end in a
# ZeroDivisionError from inside the run.
POSITIVE_COUNTS = {
    "trainer.accumulate_grad_batches": "batches per optimizer step",
    "scheduler.scheduler.step_size": "epochs (or steps) between learning-rate decays",
}


def check_positive_counts(cfg: DictConfig) -> None:
    """Raise ConfigError for a count in `POSITIVE_COUNTS` below 1."""
    for key, counts in POSITIVE_COUNTS.items():
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"{key}={value}: it counts {counts}, so it must be at least 1")


def check_adapter_model(cfg: DictConfig) -> None:
    """Refuse adapters (`adapter=lora`) on a model whose class takes none.

    Hydra would otherwise fail with an unclear "unexpected keyword argument".
    """
    model = cfg.get("model")
    if not cfg.get("adapter") or not isinstance(model, DictConfig) or "_target_" not in model:
        return
    target = model._target_
    if "adapter" not in _parameter_hints(hydra.utils.get_object(target)):
        raise ConfigError(
            f"adapter=lora trains adapters on a language model, "
            f"but the model is {target}, which takes none. Choose a Qwen LM (e.g. "
            f"experiment=lm_sft model.pretrained=<folder> adapter=lora) or drop adapter=lora."
        )


def check_lr_monitor_has_a_logger(cfg: DictConfig) -> None:
    """Refuse the learning-rate monitor without a logger (`~logger`) before the run starts.

    Lightning refuses it too, but only once the trainer is built.
    """
    callbacks = cfg.get("callbacks")
    if isinstance(callbacks, DictConfig) and callbacks.get("lr_monitor") and not cfg.get("logger"):
        raise ConfigError(
            "callbacks.lr_monitor writes the learning rate to a logger, and this run has none: "
            "choose logger=none (no logger and no monitor) or a logger (e.g. logger=csv)"
        )


def check_accelerator(cfg: DictConfig) -> None:
    """Refuse a GPU trainer on a machine without one, pointing at the CPU trainer.

    Lightning's own error names neither the key nor the fix. This checks the machine, not the
    config, so the entry points run it, not `check_config_types` (which also checks GPU configs
    on CPUs).
    """
    trainer = cfg.get("trainer") or {}
    accelerator = str(trainer.get("accelerator", "auto")).lower()
    has_gpu = torch.cuda.is_available() or torch.backends.mps.is_available()
    if accelerator in ("gpu", "cuda", "mps") and not has_gpu:
        raise ConfigError(
            f"trainer.accelerator={accelerator} but torch sees no GPU on this machine "
            f"(torch {torch.__version__} finds no CUDA or MPS device). Train on the CPU with "
            f"trainer=cpu (or trainer=ddp_cpu for several processes), or install a CUDA build "
            f"of torch."
        )


def _items(cfg: DictConfig | ListConfig) -> Iterator[tuple[DictKeyType, Any]]:
    """(key, resolved value) pairs, skipping mandatory values that are still `???`."""
    if isinstance(cfg, DictConfig):
        return ((key, cfg[key]) for key in cfg if not OmegaConf.is_missing(cfg, key))
    return ((i, cfg[i]) for i in range(len(cfg)) if not OmegaConf.is_missing(cfg, i))


def _check_target_node(node: DictConfig, path: str) -> None:
    try:
        target = hydra.utils.get_object(node._target_)
        hints = _parameter_hints(target)
    except Exception:  # noqa: BLE001 - unknown or un-introspectable targets are instantiate's job
        return
    _check_known_arguments(node, path, target)
    for key, value in _items(node):
        if not isinstance(key, str) or key.startswith("_") or key not in hints:
            continue
        if isinstance(value, DictConfig | ListConfig) and not _is_plain_list(value):
            continue
        plain = OmegaConf.to_object(value) if isinstance(value, ListConfig) else value
        if not _matches(plain, hints[key]):
            expected = _describe(hints[key])
            choices = _literal_values(hints[key])
            fix = (
                f"{path}.{key}={_closest(plain, choices)}, say"
                if choices
                else f"{path}.{key}=<{expected}>"
            )
            raise ConfigError(
                f"{path}.{key}={plain!r} ({type(plain).__name__}) is not a valid value: "
                f"{node._target_} expects {expected}. Fix it with {fix}."
            )


def _check_known_arguments(node: DictConfig, path: str, target: Any) -> None:
    """Refuse a key that `target` takes no argument for (`+model.bar=1`), naming the closest."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to read: instantiate's job
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    project_keys = LR_SCALING_KEYS if path.split(".")[-1] == "optimizer" else ()
    for key in node:
        if isinstance(key, str) and not key.startswith("_") and key not in parameters:
            if key in project_keys:  # read by src/run/lr_scaling.py, never passed on
                continue
            close = difflib.get_close_matches(key, list(parameters), n=1, cutoff=0.6)
            hint = f"did you mean {path}.{close[0]}?" if close else f"remove it (~{path}.{key})."
            raise ConfigError(
                f"{path}.{key} is not an argument of {node._target_}, which takes "
                f"{', '.join(parameters)}: {hint}"
            )


def _parameter_hints(target: Any) -> dict[str, Any]:
    """Collect the annotations of the target's parameters."""
    if not inspect.isclass(target):
        return typing.get_type_hints(target)
    hints: dict[str, Any] = {}
    # Every `__init__` of the MRO: subclasses commonly pass `**kwargs` on to their parents.
    for klass in reversed(target.__mro__):
        if klass is not object and "__init__" in vars(klass):
            hints.update(typing.get_type_hints(vars(klass)["__init__"]))
    return hints


def _is_plain_list(value: Any) -> bool:
    return isinstance(value, ListConfig) and not any(isinstance(item, DictConfig) for item in value)


def _matches(value: Any, annotation: Any) -> bool:
    """True when `value` could be passed for `annotation`; unknown annotations always pass."""
    if value is None or annotation is Any:
        return True
    if annotation is type(None):
        return False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin in (list, tuple, typing.Sequence, typing.MutableSequence):
        return isinstance(value, list | tuple)
    if origin in (dict, typing.Mapping):
        return isinstance(value, dict)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    return True


def _describe(annotation: Any) -> str:
    """The values or types `annotation` allows, in config terms: `one of 'a', 'b' or null`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        others = [
            _describe(arg)
            for arg in typing.get_args(annotation)
            if typing.get_origin(arg) is not typing.Literal
        ]
        values = _literal_values(annotation)
        listed = [f"one of {', '.join(map(repr, values))}"] if values else []
        return " or ".join(listed + others)
    if typing.get_origin(annotation) is typing.Literal:
        return f"one of {', '.join(map(repr, typing.get_args(annotation)))}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _literal_values(annotation: Any) -> list[Any]:
    """Every value a Literal in `annotation` (or in its Union) allows."""
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [value for arg in typing.get_args(annotation) for value in _literal_values(arg)]
    return []


def _closest(given: Any, choices: list[Any]) -> Any:
    """The choice that reads most like `given` (the first one when none is close)."""
    shown = {str(choice): choice for choice in choices}
    close = difflib.get_close_matches(str(given), list(shown), n=1, cutoff=0.0)
    return shown[close[0]] if close else choices[0]

"""Catch wrongly typed config values before anything is built, with a message that says the fix.

Hydra reports unknown group options well ("Could not find 'model/foo'... Available options"),
but a value of the wrong type (`trainer.max_epochs=ten`) would otherwise surface as a traceback
deep inside the object that received it. This walks every `_target_` node, reads the target's
signature and compares each plain value with the parameter's annotation.
"""

import inspect
import types
import typing
from typing import Any

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from src.utils.errors import ConfigError


def check_config_types(cfg: DictConfig, path: str = "") -> None:
    """Raise ConfigError for the first value whose type contradicts its target's signature."""
    for key, node in _items(cfg):
        child_path = f"{path}.{key}" if path else str(key)
        if isinstance(node, DictConfig | ListConfig):
            if isinstance(node, DictConfig) and "_target_" in node:
                _check_target_node(node, child_path)
            check_config_types(node, child_path)


def _items(cfg: DictConfig | ListConfig):
    """(key, resolved value) pairs, skipping mandatory values that are still `???`."""
    keys = cfg.keys() if isinstance(cfg, DictConfig) else range(len(cfg))
    return ((key, cfg[key]) for key in keys if not OmegaConf.is_missing(cfg, key))


def _check_target_node(node: DictConfig, path: str) -> None:
    try:
        hints = _parameter_hints(hydra.utils.get_object(node._target_))
    except Exception:  # noqa: BLE001 - unknown or un-introspectable targets are instantiate's job
        return
    for key, value in _items(node):
        if key.startswith("_") or key not in hints:
            continue
        if isinstance(value, DictConfig | ListConfig) and not _is_plain_list(value):
            continue
        plain = OmegaConf.to_object(value) if isinstance(value, ListConfig) else value
        if not _matches(plain, hints[key]):
            expected = _describe(hints[key])
            raise ConfigError(
                f"{path}.{key}={plain!r} ({type(plain).__name__}) is not a valid value: "
                f"{node._target_} expects {expected}. Fix it with {path}.{key}=<{expected}>."
            )


def _parameter_hints(target: Any) -> dict[str, Any]:
    """Annotations of the target's parameters; for a class, of every `__init__` in its MRO, since
    subclasses commonly pass `**kwargs` on to their parents."""
    if not inspect.isclass(target):
        return typing.get_type_hints(target)
    hints: dict[str, Any] = {}
    for klass in reversed(target.__mro__):
        if klass is not object and "__init__" in vars(klass):
            hints.update(typing.get_type_hints(klass.__init__))
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
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))

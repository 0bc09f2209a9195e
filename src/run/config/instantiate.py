"""Build objects from config nodes, naming the node when its class refuses the config."""

import re

import hydra
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig

from src.utils.errors import ConfigError, UserFacingError, first_cause

# Optional extras of pyproject.toml, by the class that needs them.
EXTRAS = {"MLFlowLogger": "loggers", "WandbLogger": "loggers"}
# What a class raises for an argument it refuses (`nn.Dropout(p=2)`, `Trainer(max_epochs=-5)`).
REFUSALS = (ValueError, MisconfigurationException)


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every entry of a group such as `callbacks` or `logger` that has a `_target_`.

    Entries set to null (e.g. `callbacks.rich_progress_bar=null`) are skipped, which is how a
    single member of a group is switched off from the command line.
    """
    if not group:
        return []
    return [instantiate_config(entry) for entry in group.values() if entry and "_target_" in entry]


def instantiate_config(node: DictConfig, **kwargs):
    """Call `hydra.utils.instantiate(node, **kwargs)`, raising a ConfigError for a bad config.

    A class refusing its arguments, or a package that is not installed, becomes a ConfigError
    naming the config key and the fix.
    """
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as error:
        cause, (target, key) = error.__cause__, failed_node(error, node)
        if (missing := first_cause(error, ModuleNotFoundError)) is not None:
            extra = EXTRAS.get(target)
            how = f'pip install -e ".[{extra}]"' if extra else "install it"
            raise ConfigError(
                f"{key} ({target}) needs a package that is not installed: {missing}. "
                f"Install it ({how}), or choose another option."
            ) from error
        if isinstance(cause, REFUSALS) and not isinstance(cause, UserFacingError):
            raise ConfigError(
                f"{key}: {target} refuses this config: {cause}. Fix the value on the command "
                f"line ({key}.<name>=...)."
            ) from error
        raise


def failed_node(error: InstantiationException, node: DictConfig) -> tuple[str, str]:
    """Read the class and the config key that Hydra names in an instantiation error.

    Hydra writes "Error in call to target 'src.models.vision.cnn.CNN': ...", then
    "full_key: model.net", which may be a node nested in `node`. Where it names no class, the
    class is `node`'s own.
    """
    message = str(error)
    target = re.search(r"target '([\w.]+)'", message)
    key = re.search(r"^full_key: (\S+)$", message, re.MULTILINE)
    name = (target.group(1) if target else node._target_).rsplit(".", 1)[-1]
    return name, key.group(1) if key else name

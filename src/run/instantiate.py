"""Build the callback and logger lists from their config groups."""

import hydra
from omegaconf import DictConfig

from src.utils.errors import ConfigError

# Optional extras of pyproject.toml, by the class that needs them.
EXTRAS = {"MLFlowLogger": "loggers", "WandbLogger": "loggers"}


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every entry of a group such as `callbacks` or `logger` that has a `_target_`.

    Entries set to null (e.g. `callbacks.rich_progress_bar=null`) are skipped, which is how a
    single member of a group is switched off from the command line. An entry whose package is
    not installed fails with the command that installs it.
    """
    if not group:
        return []
    return [
        instantiate_entry(name, entry)
        for name, entry in group.items()
        if entry and "_target_" in entry
    ]


def instantiate_entry(name: str, entry: DictConfig):
    try:
        return hydra.utils.instantiate(entry)
    except Exception as error:
        missing = error
        while missing is not None and not isinstance(missing, ModuleNotFoundError):
            missing = missing.__cause__ or missing.__context__
        if missing is None:
            raise
        target = entry._target_.rsplit(".", 1)[-1]
        extra = EXTRAS.get(target)
        how = f'pip install -e ".[{extra}]"' if extra else "install it"
        raise ConfigError(
            f"{name} ({target}) needs a package that is not installed: {missing}. "
            f"Install it ({how}), or choose another option."
        ) from error

"""Build the callback and logger lists from their config groups."""

import hydra
from omegaconf import DictConfig


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every entry of a group such as `callbacks` or `logger` that has a `_target_`.

    Entries set to null (e.g. `callbacks.rich_progress_bar=null`) are skipped, which is how a
    single member of a group is switched off from the command line.
    """
    if not group:
        return []
    return [
        hydra.utils.instantiate(entry) for entry in group.values() if entry and "_target_" in entry
    ]

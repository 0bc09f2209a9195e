"""A close key for a mistyped override (`trainer.max_epoch=3` -> `trainer.max_epochs`).

Hydra refuses an override of a key the config lacks with "To append to your config use +...",
which is rarely what a typo needs. Once Hydra has refused it, `typo_hint` composes the config
again without that override and names the closest existing key (for the one line of
src/run/config/composition_errors.py).
"""

import difflib
import re
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

REFUSED_KEY = re.compile(r"Could not override '([^']+)'")


def typo_hint(conf_dir: Path, config_name: str, args: Sequence[str]) -> str | None:
    """Suggest "Did you mean ...?" for an override of `args` whose key does not exist.

    None when a missing key is not why composing failed.
    """
    overrides = [arg for arg in args if "=" in arg and not arg.startswith("-")]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        try:
            compose(config_name, overrides=overrides)
            return None
        except Exception as error:  # noqa: BLE001 - whatever else failed is Hydra's to report
            refused = REFUSED_KEY.search(str(error))
        if refused is None:
            return None
        key = refused.group(1)
        others = [arg for arg in overrides if arg.split("=", 1)[0] != key]
        try:
            cfg = compose(config_name, overrides=others)
        except Exception:  # noqa: BLE001 - another override is wrong too: no hint
            return None
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return None
    close = difflib.get_close_matches(leaf, [str(k) for k in node], n=1, cutoff=0.6)
    if not close:
        return None
    value = next(arg.split("=", 1)[1] for arg in overrides if arg.split("=", 1)[0] == key)
    suggestion = f"{parent}.{close[0]}" if parent else close[0]
    return f"{key} is not a key of the config: did you mean {suggestion}={value}?"

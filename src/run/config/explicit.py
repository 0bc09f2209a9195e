"""Which model config fields the user set on the command line, for a model started from a folder.

A transformers folder (`model.pretrained=<folder>`) gives the architecture whichever Qwen config
was chosen; only sizes set explicitly (`model.config.hidden_size=...`) are checked against it.
"""

from collections.abc import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, open_dict

PREFIX = "model.config."


def record_explicit_model_config(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Name in `cfg.model.explicit_config` the `model.config.*` keys that `overrides` set.

    Only for a model that takes a config and starts from a `pretrained` folder; a no-op else.
    """
    model = cfg.get("model")
    if model is None or not model.get("pretrained") or "config" not in model:
        return
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    keys = [
        o.key_or_group.removeprefix(PREFIX) for o in parsed if o.key_or_group.startswith(PREFIX)
    ]
    with open_dict(model):
        model.explicit_config = sorted(keys)

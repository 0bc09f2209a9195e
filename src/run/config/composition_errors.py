"""Hydra's refusals of a command line, each as one line that says what to do.

Hydra prints its composition errors over several lines (the options of a group, a grammar
link, OmegaConf's `full_key` and `object_type`) and then exits. `hydra_raises` lets them reach
the entry point's error boundary instead, and `composition_error` rewrites each as a
ConfigError: an option a group lacks lists the group's options and the closest one; a key the
config lacks names the close key, or how to add one. `group=null`, which Hydra refuses with a
bare ValueError, gets the group's options (`null_group_error`).
"""

import difflib
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hydra.errors import HydraException, MissingConfigException, OverrideParseException

from src.run.config.key_hints import REFUSED_KEY, typo_hint
from src.utils.error_boundary import TRACEBACKS_ASKED
from src.utils.errors import ConfigError


@contextmanager
def hydra_raises() -> Iterator[None]:
    """Make Hydra raise what it would print, keeping whether the user asked for tracebacks.

    HYDRA_FULL_ERROR=1 is the only switch Hydra has for this. Meanwhile the user's own value is
    in TRACEBACKS_ASKED, where the error boundary reads it, in this process and in every job it
    launches; afterwards both are as they were.
    """
    saved = {name: os.environ.get(name) for name in ("HYDRA_FULL_ERROR", TRACEBACKS_ASKED)}
    os.environ.setdefault(TRACEBACKS_ASKED, "1" if saved["HYDRA_FULL_ERROR"] == "1" else "0")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def composition_error(
    error: HydraException, conf_dir: Path, config_name: str, args: Sequence[str]
) -> ConfigError:
    """`error`, which Hydra raised composing `config_name` from `args`, as one line."""
    if isinstance(error, MissingConfigException) and error.options and error.missing_cfg_file:
        return ConfigError(missing_option(error.missing_cfg_file, list(error.options)))
    if refused := REFUSED_KEY.search(str(error)):
        key = refused.group(1)
        hint = typo_hint(conf_dir, config_name, args)
        return ConfigError(
            hint
            or f"{key} is not a key of the config: check its spelling in "
            f"`python {sys.argv[0]} --cfg job`, or add it with +{key}=..."
        )
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    if isinstance(error, OverrideParseException):
        # Its first line is the parser's own ("no viable alternative at input '['"), or the
        # override with a caret under the character the lexer stopped at.
        return ConfigError(
            f"{error.override} is not an override Hydra can read ({lines[0]}): quote the value "
            "if it holds brackets, braces, commas or spaces; the grammar is at "
            "https://hydra.cc/docs/advanced/override_grammar/basic/"
        )
    return ConfigError("; ".join(lines) or type(error).__name__)


# What Hydra raises, as a bare ValueError, for `group=null`.
NULL_GROUP = "Config group override must be a string or a list"


def null_group_error(error: ValueError, conf_dir: Path, args: Sequence[str]) -> ConfigError | None:
    """`reward=null` for a config group: its options instead. None for other errors."""
    if not str(error).startswith(NULL_GROUP):
        return None
    groups = [
        key
        for key, _, value in (arg.lstrip("+").partition("=") for arg in args)
        if value == "null" and (conf_dir / key).is_dir()
    ]
    if not groups:
        return None
    group = groups[0]
    options = sorted(path.stem for path in (conf_dir / group).glob("*.yaml"))
    message = f"{group}=null: {group} is a config group; choose one of its options: "
    message += ", ".join(options)
    if "none" in options:
        message += f" ({group}=none leaves it out)"
    return ConfigError(message)


def missing_option(missing: str, options: list[str]) -> str:
    """`model=resnet9000`: which group, which options it has, which one is closest."""
    group, _, name = missing.rpartition("/")
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    closest = f" (closest: {close[0]})" if close else ""
    return (
        f"{group or 'the config'} has no option {name!r}: choose one of "
        f"{', '.join(sorted(options))}{closest}."
    )

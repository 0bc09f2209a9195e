"""Decide what a run shows on the console.

Its config as a short tree, Lightning's output without its tips and repeated notices, the
warnings a user can act on, and `--help` as the options a user picks. The run's log file
(conf/hydra/default.yaml) still receives every line.

Settings: `extras.quiet` (false shows everything on the console too) and `extras.print_config`
in the entry configs (conf/train.yaml).
"""

import logging
import re
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, cast

import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.tree import Tree

from src.run.launch import process_rank

# The loggers that print to the console themselves (Lightning's own handlers) rather than
# through Hydra's; warnings join them once `warnings.showwarning` logs to "py.warnings".
CONSOLE_LOGGERS = ("lightning.pytorch", "lightning.fabric", "py.warnings")

# Lightning's notices that advertise its services or repeat what the config tree shows (seed,
# devices, callbacks), and its summary table, which conf/callbacks/layer_summary.yaml prints
# with output shapes.
QUIET_NOTICES = re.compile(
    r"💡 Tip: |Seed set to |[GTH]PU available: |LOCAL_RANK: \d+ - |"
    r"Trainer already configured with model summary callbacks|"
    r"Restoring states from the checkpoint path at "  # "Loaded model weights ..." follows
)
QUIET_LOGGERS = ("lightning.pytorch.callbacks.model_summary",)

# Warnings about a library's own code or this project's, which no config can fix: (category,
# message pattern).
QUIET_WARNINGS = (
    (FutureWarning, re.compile(r"`isinstance\(treespec, LeafSpec\)` is deprecated")),
    # The language model refuses image tokens before the batch moves to the device, on purpose.
    (
        UserWarning,
        re.compile(r"You have overridden `on_before_batch_transfer` in `LightningModule`"),
    ),
    # A stream knows its length (the run's rows) and splits its files across workers itself.
    (UserWarning, re.compile(r"Your `IterableDataset` has `__len__` defined")),
    # A resumed run writes into its own checkpoints/ folder, which a lock keeps to one run.
    (UserWarning, re.compile(r"Checkpoint directory .* exists and is not empty")),
    # Throughput is measured per rank without a collective (src/callbacks/measurement/).
    (UserWarning, re.compile(r"It is recommended to use `self.log\('perf/")),
)


class QuietConsole(logging.Filter):
    """Keep Lightning's tips, notices, summary table and library warnings off a console handler.

    Every other record passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(QUIET_LOGGERS):
            return False
        category = getattr(record, "category", None)
        if category is not None:
            return not any(
                issubclass(category, quiet) and pattern.search(record.getMessage())
                for quiet, pattern in QUIET_WARNINGS
            )
        return not QUIET_NOTICES.match(record.getMessage().lstrip())


def log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Hand a warning to logging with its category, as `warnings.showwarning`.

    The console's filter needs the category, which logging.captureWarnings drops.
    """
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    logging.getLogger("py.warnings").warning("%s", text, extra={"category": category})


def set_up_console(quiet: bool) -> None:
    """Give Lightning's loggers and warnings one console handler and the run's log files.

    The console handler is filtered when `quiet`. Called once per job, after Hydra has set up
    logging.
    """
    log_files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in CONSOLE_LOGGERS:
        logger = logging.getLogger(name)
        # A previous job's log file goes (a multirun sets up logging again for each job).
        for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
            logger.removeHandler(handler)
        consoles = [h for h in logger.handlers if type(h) is logging.StreamHandler]
        if not consoles:  # Lightning adds its own only when imported before logging is set up
            consoles = [logging.StreamHandler()]
            logger.addHandler(consoles[0])
        for console in consoles:
            for old in [f for f in console.filters if isinstance(f, QuietConsole)]:
                console.removeFilter(old)
            if quiet:
                console.addFilter(QuietConsole())
        for handler in log_files:
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # Hydra's console would print each line a second time
    warnings.showwarning = log_warning


def show_config(cfg: DictConfig, print_tree: bool) -> None:
    """Save the resolved config tree to `<run dir>/config_tree.txt`; print its short form.

    Rank 0 only.
    """
    if process_rank() != 0:
        return
    path = Path(HydraConfig.get().runtime.output_dir) / "config_tree.txt"
    with path.open("w") as file:
        Console(file=file, width=120, color_system=None).print(full_tree(cfg))
    if print_tree:
        runtime = HydraConfig.get()
        Console().print(
            short_tree(cfg, dict(runtime.runtime.choices), runtime.overrides.task, path)
        )


def full_tree(cfg: DictConfig) -> Tree:
    """Every resolved value, one branch per top-level key."""
    tree = Tree("config")
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    for key, value in values.items():
        if isinstance(value, dict | list) and value:
            tree.add(escape(str(key))).add(escape(yaml.safe_dump(value, sort_keys=False).rstrip()))
        else:
            tree.add(escape(f"{key}: {_flow(value)}"))
    return tree


def short_tree(
    cfg: DictConfig, choices: dict[str, Any], overrides: list[str], saved_to: Path
) -> Tree:
    """Render the config in short: one line per group, top-level value and add-on config.

    A group shows the option chosen (with the values the command line set in it); the add-ons
    are the chosen experiment/debug/... configs.
    """
    tree = Tree(f"[bold]Config[/] (all of it: {escape(str(saved_to))})")
    set_in = _overrides_by_key(overrides)
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    for key, value in values.items():
        if key in choices:
            branch = tree.add(f"{key}: [bold]{escape(_flow(choices[key]))}[/]")
            for override in set_in.get(key, []):
                branch.add(escape(override))
        else:
            tree.add(escape(f"{key}: {_flow(value)}"))
    for group, choice in choices.items():
        if group not in values and not group.startswith("hydra") and _exists(group, choice):
            tree.add(f"{group}: [bold]{escape(choice)}[/]")
    return tree


def _overrides_by_key(overrides: list[str]) -> dict[str, list[str]]:
    """Command-line overrides inside a group (`trainer.max_epochs=1`), by the group's key."""
    by_key: dict[str, list[str]] = {}
    for override in overrides:
        key, dot, rest = override.lstrip("+~").partition(".")
        if dot and key != "hydra":
            by_key.setdefault(key, []).append(rest)
    return by_key


def _exists(group: str, choice: str) -> bool:
    """Tell whether `group/choice` was found.

    An `optional` default such as local may be absent, and a group left at null has no choice.
    """
    hydra = GlobalHydra.instance()
    return (
        choice is not None
        and hydra.is_initialized()
        and choice in hydra.config_loader().get_group_options(group)
    )


def _flow(value: Any) -> str:
    """A value as one line of YAML."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000)
    return text.removesuffix("...\n").strip()


WIDTH = 100  # of a --help line


def help_text(conf_dir: Path, root: DictConfig) -> str:
    """Write `--help`: the groups' options, the add-on groups and this config's own settings.

    The add-on groups are those it can take as `+group=option`. Each option is described by the
    first sentence of its yaml's leading comment; the pieces a group's default.yaml composes are
    not options.
    """
    choices = dict(root.hydra.runtime.choices)
    groups = sorted(g for g in choices if not g.startswith("hydra"))
    keys = [str(key) for key in root]  # as strings, the names masked_copy and _sets_only take
    lines = [f"Usage: python {sys.argv[0]} [group=option ...] [key=value ...]", ""]
    lines += ["== Groups (group=option) ==", ""]
    for group in groups:
        options = _options(conf_dir, group)
        if options == [choices[group]]:
            continue  # nothing else to pick
        now = f" (now: {choices[group]})" if _exists(group, choices[group]) else ""
        lines += [f"{group}{now}", *_described(conf_dir, group, options)]
        if pieces := _pieces(conf_dir, group):
            note = (
                f"`default` composes {', '.join(pieces)}. Turn one off with {group}.<name>=null, "
                f"add an option to them with {group}=[default,<option>]."
            )
            lines += textwrap.wrap(note, WIDTH, initial_indent="  ", subsequent_indent="  ")
        lines.append("")
    add_ons = [
        group
        for group in _groups(conf_dir)
        if group not in choices and _sets_only(conf_dir, group, set(keys))
    ]
    if add_ons:
        lines += ["== Add-ons (+group=option) ==", ""]
        for group in add_ons:
            lines += [group, *_described(conf_dir, group, _options(conf_dir, group)), ""]
    settings = OmegaConf.masked_copy(root, [k for k in keys if k != "hydra" and k not in choices])
    lines += ["== Settings (key=value) ==", "", OmegaConf.to_yaml(settings).rstrip(), ""]
    lines += ["`--cfg job` prints the whole config, `--hydra-help` Hydra's own options."]
    return "\n".join(lines).replace("$", "$$")  # Hydra fills the help in as a string.Template


def _groups(conf_dir: Path) -> list[str]:
    return sorted(p.name for p in conf_dir.iterdir() if p.is_dir() and p.name != "hydra")


def _options(conf_dir: Path, group: str) -> list[str]:
    """The options of `group` a user picks: its yaml files, less what its default.yaml composes."""
    pieces = set(_pieces(conf_dir, group))
    return [p.stem for p in sorted((conf_dir / group).glob("*.yaml")) if p.stem not in pieces]


def _pieces(conf_dir: Path, group: str) -> list[str]:
    """The options of `group` that its default.yaml composes: parts of it, not choices."""
    default = conf_dir / group / "default.yaml"
    if not default.is_file():
        return []
    entries = (yaml.safe_load(default.read_text()) or {}).get("defaults", [])
    return [e for e in entries if isinstance(e, str) and (conf_dir / group / f"{e}.yaml").is_file()]


def _described(conf_dir: Path, group: str, options: list[str]) -> list[str]:
    """One line per option: its name and its description, within WIDTH."""
    width = max(map(len, options), default=0)
    room = WIDTH - width - 4
    return [
        f"  {o:<{width}}  {_description(conf_dir / group / f'{o}.yaml', room)}" for o in options
    ]


def _description(path: Path, room: int) -> str:
    """Return the first sentence of the yaml's leading comment, cut to `room` characters.

    The `@package` line is not part of it.
    """
    comment = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            comment.append(line.lstrip("# ").strip())
    text = " ".join(comment)
    sentence = re.match(r"(.+?\.)(\s|$)", text)
    text = sentence.group(1) if sentence else text
    return text if len(text) <= room else text[: room - 1].rstrip() + "…"


def _sets_only(conf_dir: Path, group: str, keys: set[str]) -> bool:
    """Tell whether `group` is an add-on that applies: one changing only keys this config has.

    A `@package _global_` option changes its top-level keys, any other the group's own key.
    """
    written: set[str] = set()
    for path in (conf_dir / group).glob("*.yaml"):
        text = path.read_text()
        if "# @package _global_" in text:
            written |= set(yaml.safe_load(text) or {}) - {"defaults"}
        else:
            written.add(group)
    return written <= keys


def register_help_resolver(conf_dir: Path) -> None:
    """`${app_help:}` (conf/hydra/default.yaml's help template) becomes `help_text`."""
    OmegaConf.register_new_resolver(
        "app_help", lambda *, _root_: help_text(conf_dir, _root_), replace=True
    )


def start(cfg: DictConfig) -> None:
    """Set up the console as `cfg.extras` says (nothing where a config has no `extras`)."""
    extras = cfg.get("extras")
    if not extras:
        return
    set_up_console(quiet=extras.get("quiet", True))
    show_config(cfg, print_tree=extras.get("print_config", True))

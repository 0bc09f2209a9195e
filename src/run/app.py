"""Start every entry point the same way.

The project root, the config resolvers, one-line user errors, required values checked, one run
per directory.
"""

import functools
import inspect
import os
import string
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig

from src.run import console
from src.run.config.checks import check_accelerator, check_required_values
from src.run.config.composition_errors import (
    composition_error,
    hydra_raises,
    null_group_error,
)
from src.run.launch import register_launch_resolvers
from src.run.run_lock import pinned_run_dir, run_dir_lock
from src.utils.error_boundary import end_job_in_one_line, exit_in_one_line


def project_root(entry_point: Path) -> Path:
    """Find the project a command runs in: the nearest folder at or above `entry_point` with conf/.

    It follows the entry point, not the imported `src` package, so a copy of the project runs in
    the copy.
    """
    for folder in entry_point.resolve().parents:
        if (folder / "conf").is_dir():
            return folder
    raise FileNotFoundError(f"No conf/ folder above {entry_point}: run the project's own files.")


def hydra_app(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """Turn `task(cfg)` into the `main()` of a Hydra app on `conf/<config_name>.yaml`.

    - Before Hydra composes anything, PROJECT_ROOT is set (for conf/paths/) and the launch
      resolvers are registered (for conf/hydra/).
    - The task runs once every required value is set, holding the lock on its run directory
      (`run_dir_lock`).
    - Any exception ends in one line naming the log with its traceback (`exit_in_one_line`);
      a failed job of a multirun is recorded and the sweep goes on.
    """

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        root = project_root(Path(inspect.getfile(task)))
        os.environ.setdefault("PROJECT_ROOT", str(root))
        register_launch_resolvers()
        console.register_help_resolver(root / "conf")
        app = hydra.main(
            version_base="1.3", config_path=str(root / "conf"), config_name=config_name
        )(end_job_in_one_line(checked_and_locked(task)))

        @functools.wraps(app)
        @exit_in_one_line
        def main() -> Any:
            if (text := quick_help(root / "conf", config_name, sys.argv[1:])) is not None:
                print(text)
                return None
            with run_dir_lock(pinned_run_dir(sys.argv[1:])):  # before Hydra writes there
                try:
                    with hydra_raises():
                        return app()
                except HydraException as error:  # composing: a job's own ends in the job
                    args = sys.argv[1:]
                    raise composition_error(error, root / "conf", config_name, args) from error
                except ValueError as error:
                    if refusal := null_group_error(error, root / "conf", sys.argv[1:]):
                        raise refusal from error
                    raise

        return main

    return decorate


HELP_FLAGS = ("--help", "-h")


def quick_help(conf_dir: Path, config_name: str, argv: list[str]) -> str | None:
    """`--help` as Hydra prints it, in 0.2 s rather than 1 s; None where Hydra should answer.

    Hydra's own `--help` lists every option of every group (Hydra's included) for the template
    to use, whether it does or not: 0.8 s here, while ours (conf/hydra/default.yaml) shows
    `console.help_text` alone. So a `--help` among overrides only is answered from the config
    they compose; with other flags, or on a config that does not compose, Hydra answers (and
    reports the error its way).
    """
    if not any(arg in HELP_FLAGS for arg in argv) or any(
        arg.startswith("-") and arg not in HELP_FLAGS for arg in argv
    ):
        return None
    overrides = [arg for arg in argv if arg not in HELP_FLAGS]
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
            template = cfg.hydra.help.template
    except Exception:  # noqa: BLE001 - Hydra's --help reports it as it always has
        return None
    # A template that shows Hydra's listings ($APP_CONFIG_GROUPS, ...) needs Hydra to fill them.
    if "$" in template.replace("$$", ""):
        return None
    return string.Template(template).substitute()  # `$$` -> `$`, as Hydra's fill-in does


def checked_and_locked(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Wrap `task` to run only on a complete config for a device this machine has.

    It runs holding the lock on the directory Hydra made for it, with the console its `extras`
    ask for (src/run/console.py).
    """

    @functools.wraps(task)
    def run(cfg: DictConfig) -> Any:
        check_required_values(cfg)
        check_accelerator(cfg)
        with run_dir_lock(HydraConfig.get().runtime.output_dir):
            console.start(cfg)
            return task(cfg)

    return run

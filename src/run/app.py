"""Start every entry point the same way.

The project root, the config resolvers, one-line user errors, required values checked, one run
per directory.
"""

import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from src.run import console
from src.run.config.checks import check_accelerator, check_required_values
from src.run.config.key_hints import typo_hint
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
            with run_dir_lock(pinned_run_dir(sys.argv[1:])):  # before Hydra writes there
                try:
                    return app()
                except SystemExit as stop:
                    if stop.code and (hint := typo_hint(root / "conf", config_name, sys.argv[1:])):
                        print(hint, file=sys.stderr)
                    raise

        return main

    return decorate


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

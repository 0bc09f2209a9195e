"""How every entry point starts: the project root, the config resolvers, one-line user errors."""

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from src.run.launch import register_launch_resolvers
from src.utils.errors import exit_on_user_error


def project_root(entry_point: Path) -> Path:
    """The nearest folder at or above `entry_point` that holds `conf/`: the project a command
    runs in, wherever the `src` package was imported from (a copy of the project runs in the
    copy)."""
    for folder in entry_point.resolve().parents:
        if (folder / "conf").is_dir():
            return folder
    raise FileNotFoundError(f"No conf/ folder above {entry_point}: run the project's own files.")


def hydra_app(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """Decorator: `task(cfg)` becomes the `main()` of a Hydra app on `conf/<config_name>.yaml`.

    Before Hydra composes anything it sets PROJECT_ROOT (read by conf/paths/) and registers the
    launch resolvers (read by conf/hydra/); a UserFacingError raised by the task is printed as
    one line (see `exit_on_user_error`).
    """

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        root = project_root(Path(inspect.getfile(task)))
        os.environ.setdefault("PROJECT_ROOT", str(root))
        register_launch_resolvers()
        return hydra.main(
            version_base="1.3", config_path=str(root / "conf"), config_name=config_name
        )(exit_on_user_error(task))

    return decorate

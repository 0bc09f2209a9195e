"""Run the tests ported from Hydra's Optuna sweeper as Hydra's repository runs them.

There they run from the plugin's root (`chdir_plugin_root()` on import), where their example
apps and configs lie and where their runs may write. Here each test runs in a fresh copy of
that root, so that nothing lands in the working tree, and the worker's other tests keep their
working directory.
"""

import shutil
from pathlib import Path

import pytest
from hydra.test_utils import test_utils

PLUGIN_ROOT = Path(__file__).parent


def stay() -> None:
    """Stand in for `chdir_plugin_root`: the `plugin_root` fixture moves each test instead."""


test_utils.chdir_plugin_root = stay


@pytest.fixture(autouse=True)
def plugin_root(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("plugin_root")
    shutil.copytree(PLUGIN_ROOT / "example", root / "example")
    shutil.copytree(PLUGIN_ROOT / "tests" / "conf", root / "tests" / "conf")
    monkeypatch.chdir(root)
    return root

# Copyright (c) Facebook, Inc. and its affiliates. All Rights Reserved
from pathlib import Path

from hydra.test_utils.test_utils import (
    chdir_plugin_root,
    run_python_script,
)
from omegaconf import DictConfig, OmegaConf

chdir_plugin_root()


def test_example_with_deprecated_search_space(
    tmpdir: Path,
) -> None:
    cmd = [
        "-W ignore::UserWarning",
        "example/sphere.py",
        "--multirun",
        "--config-dir=tests/conf",
        "--config-name=test_deprecated_search_space",
        "hydra.sweep.dir=" + str(tmpdir),
        "hydra.job.chdir=True",
        "hydra.sweeper.n_trials=20",
        "hydra.sweeper.n_jobs=1",
    ]

    run_python_script(cmd)
    returns = OmegaConf.load(f"{tmpdir}/optimization_results.yaml")
    assert isinstance(returns, DictConfig)
    assert returns.name == "optuna"
    assert abs(returns["best_params"]["x"]) <= 5.5

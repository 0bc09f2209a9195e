"""Compose a run's config from Python (notebooks, tests, benchmarks) as the command line would."""

import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from src.run.launch import register_launch_resolvers

ROOT = Path(__file__).resolve().parents[3]
CONF_DIR = str(ROOT / "conf")


def compose_run_config(
    run_dir: Path, overrides: list[str], config_name: str = "train"
) -> DictConfig:
    """The config `python train.py <overrides> hydra.run.dir=<run_dir>` would run with.

    The Hydra runtime (output dir, overrides) is registered as well, so `${hydra:...}` resolves
    and `train()` / `evaluate()` see what they see in a real run. Hydra stays initialised (as
    inside an app) so the code can compose again; clear it with `GlobalHydra.instance().clear()`.
    """
    os.environ.setdefault("PROJECT_ROOT", str(ROOT))
    register_launch_resolvers()
    GlobalHydra.instance().clear()
    initialize_config_dir(config_dir=CONF_DIR, version_base="1.3")
    cfg = compose(
        config_name=config_name,
        overrides=[*overrides, f"hydra.run.dir={run_dir}"],
        return_hydra_config=True,
    )
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return cfg

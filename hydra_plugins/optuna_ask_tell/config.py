"""The configs Hydra composes for `hydra/sweeper=optuna_ask_tell`, its sampler and pruner
options, and `hydra/launcher=processes`."""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

SAMPLERS = {
    # Optuna's default: independent TPE after n_startup_trials random trials.
    "tpe": {"_target_": "optuna.samplers.TPESampler", "seed": None, "n_startup_trials": 10},
    # Continuous and integer parameters only; choice() ones are sampled at random.
    "cmaes": {"_target_": "optuna.samplers.CmaEsSampler", "seed": None},
    "gp": {"_target_": "optuna.samplers.GPSampler", "seed": None, "n_startup_trials": 10},
    "random": {"_target_": "optuna.samplers.RandomSampler", "seed": None},
}

PRUNERS = {
    "none": {"_target_": "optuna.pruners.NopPruner"},
    # Stops a trial whose report is worse than the median of earlier trials at the same step.
    "median": {
        "_target_": "optuna.pruners.MedianPruner",
        "n_startup_trials": 5,
        "n_warmup_steps": 0,
        "interval_steps": 1,
    },
    "hyperband": {
        "_target_": "optuna.pruners.HyperbandPruner",
        "min_resource": 1,
        "max_resource": "auto",
        "reduction_factor": 3,
    },
}


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.optuna_ask_tell.sweeper.OptunaSweeper"
    # The sampler and pruner reach the sweeper as configs: it seeds the sampler for the study.
    _recursive_: bool = False
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "median"}])
    sampler: Any = MISSING
    pruner: Any = MISSING
    direction: str = "minimize"
    # An SQLAlchemy URL; the default keeps the study beside the trials it ran.
    storage: str | None = "sqlite:///${hydra.sweep.dir}/optuna.db"
    study_name: str = "search"
    n_trials: int = 20
    # Trials run at once: the size of each batch handed to the launcher.
    n_jobs: int = 1
    # The share of failed trials above which the search stops.
    max_failure_rate: float = 0.0
    # key: value in Hydra's sweep syntax; command-line overrides are added to (and win over) them.
    params: dict[str, str] | None = None


@dataclass
class ProcessLauncherConf:
    _target_: str = "hydra_plugins.optuna_ask_tell.launcher.ProcessLauncher"


store = ConfigStore.instance()
store.store(
    group="hydra/sweeper",
    name="optuna_ask_tell",
    node=OptunaSweeperConf,
    provider="optuna_ask_tell",
)
store.store(
    group="hydra/launcher", name="processes", node=ProcessLauncherConf, provider="optuna_ask_tell"
)
for name, node in SAMPLERS.items():
    store.store(group="hydra/sweeper/sampler", name=name, node=node, provider="optuna_ask_tell")
for name, node in PRUNERS.items():
    store.store(group="hydra/sweeper/pruner", name=name, node=node, provider="optuna_ask_tell")

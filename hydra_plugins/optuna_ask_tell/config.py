"""The configs Hydra composes for `hydra/sweeper=optuna`, its sampler and pruner options, and
`hydra/launcher=processes`.

The sweeper is registered as `optuna`, the name of Hydra's Optuna sweeper, whose keys it takes
with their meaning there, and as `optuna_ask_tell`, its earlier name.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hydra_plugins.optuna_ask_tell.samplers import SAMPLERS

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
    # No pruner unless chosen: conf/hparams_search/optuna.yaml chooses median.
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "none"}])
    sampler: Any = MISSING
    pruner: Any = MISSING
    # minimize or maximize, or a list of them for a search of several objectives.
    direction: Any = "minimize"
    # An SQLAlchemy URL (sqlite:///..., postgresql://...) or journal:///<path> (Optuna's journal
    # file, src/utils/optuna_storage.py); the default keeps the study beside the trials it ran.
    storage: str | None = "sqlite:///${hydra.sweep.dir}/optuna.db"
    study_name: str | None = "search"
    # The trials of the study in all: every launch that shares it stops asking once it holds
    # this many, whichever launches asked them.
    n_trials: int = 20
    # Trials run at once: the size of each batch handed to the launcher.
    n_jobs: int = 1
    # The share of a batch's trials that may fail; more stops the search with an error.
    max_failure_rate: float = 0.0
    # Seconds between the heartbeats this launch records for its running trials (a database
    # storage only): a launch killed on another machine leaves trials whose heartbeat stops,
    # which any launch then marks failed after 2 intervals. null: no heartbeats.
    heartbeat_interval: int | None = 60
    # key: value in Hydra's sweep syntax; command-line overrides are added to (and win over) them.
    params: dict[str, str] | None = None
    # A function `(cfg, trial) -> None` (its dotted path) that suggests more parameters.
    custom_search_space: str | None = None
    # hydra-optuna-sweeper 1.1's search space, {key: {type, low, high, step, log, choices}}:
    # used only without `params`.
    search_space: dict[str, Any] | None = None


@dataclass
class ProcessLauncherConf:
    _target_: str = "hydra_plugins.optuna_ask_tell.launcher.ProcessLauncher"


store = ConfigStore.instance()
for sweeper_name in ("optuna", "optuna_ask_tell"):
    store.store(
        group="hydra/sweeper",
        name=sweeper_name,
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

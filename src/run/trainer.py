"""What train.py and eval.py share: the resolved config, and the Trainer with its callbacks."""

import logging
from typing import Any, Literal, cast

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from src.callbacks.checkpointing.logged_metrics import LoggedMetricsInCheckpoint
from src.callbacks.checkpointing.preemption import Preemption
from src.callbacks.checkpointing.run_config import RunConfigInCheckpoint
from src.callbacks.measurement.exact_match import ExactMatch
from src.callbacks.training.loader_workers import StopLoaderWorkersOnError
from src.callbacks.training.process_group import DestroyProcessGroupAtExit
from src.run.config.fit_checks import ModelFitsData
from src.run.config.instantiate import instantiate_config, instantiate_group
from src.run.launch import external_launcher
from src.utils.errors import LaunchError
from src.utils.hardware import machine_precision

log = logging.getLogger(__name__)


class AutoPrecisionTrainer(Trainer):
    """Lightning's Trainer that also takes `precision="auto"` (see `resolved_precision`)."""

    def __init__(
        self, *, precision: _PRECISION_INPUT | Literal["auto"] | None = None, **kwargs: Any
    ) -> None:
        accelerator = kwargs.get("accelerator", "auto")
        super().__init__(precision=resolved_precision(precision, accelerator), **kwargs)


def resolved_precision(precision: Any, accelerator: Any) -> Any:
    """Resolve `precision="auto"` to what `accelerator`'s device computes natively here.

    Any other value passes as given. The choice is logged once, with its reason and the override.
    """
    if precision != "auto":
        return precision
    choice = machine_precision(str(accelerator))
    # Every rank resolves; one line says it.
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # set by Lightning on the function
        other = "bf16-mixed" if choice.precision == "32-true" else "32-true"
        log.info(
            "Precision: %s (%s); set trainer.precision=%s to override",
            choice.precision,
            choice.reason,
            other,
        )
    return choice.precision


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python containers (safe in checkpoints and loggers)."""
    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))


def run_overrides() -> list[str]:
    """The command-line overrides of this run (empty outside a Hydra app)."""
    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)


def check_launch(cfg: DictConfig) -> None:
    """Refuse a Hydra multirun whose jobs would start their distributed ranks themselves."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    if external_launcher() is not None:
        return  # srun (the submitit launcher) or torchrun started the ranks: nothing re-runs
    strategy = strategy_name(cfg.trainer.get("strategy", "auto"))
    devices = cfg.trainer.get("devices", 1)
    spawns = strategy.lower() == "ddp_spawn"  # starts its ranks with multiprocessing: works
    # ddp, fsdp and model parallel re-run the command line for each rank: the whole sweep again.
    if (
        strategy.lower().startswith(("ddp", "fsdp", "modelparallel"))
        and devices != 1
        and not spawns
    ):
        raise LaunchError(
            f"A multirun (-m) cannot use trainer.strategy={strategy} with {devices} devices: "
            f"Lightning re-executes the command line for the other ranks, so each would start "
            f"the whole sweep again. Use trainer.strategy=ddp_spawn, run each configuration as its "
            f"own command, or sweep with a cluster launcher that starts the ranks itself "
            f"(hydra/launcher=slurm)."
        )


def strategy_name(strategy: Any) -> str:
    """A strategy as configured: its registered name ("ddp") or its class name (a `_target_`)."""
    if isinstance(strategy, DictConfig) and "_target_" in strategy:
        return strategy._target_.rsplit(".", 1)[-1]
    return str(strategy)


def build_trainer(cfg: DictConfig, run_config: tuple[dict, list[str]] | None = None) -> Trainer:
    """Build the Trainer with the configured callbacks and loggers.

    With `run_config` (resolved config, overrides), every checkpoint records how the run was
    configured and the loggers receive the config as hyperparameters. Both hold the precision
    that `trainer.precision: auto` resolved to.
    """
    precision = resolved_precision(
        cfg.trainer.get("precision"), cfg.trainer.get("accelerator", "auto")
    )
    if run_config is not None:
        config, overrides = run_config
        trainer_config = {**config["trainer"], "precision": precision}
        run_config = ({**config, "trainer": trainer_config}, overrides)
    # Not config choices: the checks and metrics every run needs, whatever `callbacks=` says,
    # the process group's clean exit (without it a distributed CPU run can abort at exit), and
    # a failed run's DataLoader workers stopped at once.
    mandatory = [
        ModelFitsData(),
        ExactMatch(),
        LoggedMetricsInCheckpoint(),
        DestroyProcessGroupAtExit(),
        StopLoaderWorkersOnError(),
    ]
    callbacks = [*instantiate_group(cfg.get("callbacks")), *mandatory]
    if run_config is not None:
        callbacks.append(RunConfigInCheckpoint(*run_config))
    loggers = instantiate_group(cfg.get("logger"))
    trainer = instantiate_config(
        cfg.trainer, precision=precision, callbacks=callbacks, logger=loggers or False
    )
    if run_config is not None:
        for logger in trainer.loggers:
            logger.log_hyperparams(run_config[0])
    return trainer


def was_preempted(trainer: Trainer) -> bool:
    """Whether a preemption signal stopped this run (it saved a checkpoint to resume from)."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
    return any(isinstance(c, Preemption) and c.received for c in callbacks)


def was_interrupted(trainer: Trainer) -> bool:
    """Whether Ctrl-C (one of the preemption callback's `interrupts`) stopped this run."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
    return any(isinstance(c, Preemption) and c.received in c.interrupts for c in callbacks)

"""Reports a trial's metric to its Optuna study after every validation; stops pruned trials.

The run stops early when the study's pruner gives up on the trial (hparams_search=optuna adds it
to every trial).
"""

import logging

import optuna
from lightning.pytorch import Callback, LightningModule, Trainer

from src.callbacks.training.optuna_marks import PRUNED_AT_STEP
from src.utils.errors import ConfigError
from src.utils.optuna_storage import open_storage

log = logging.getLogger(__name__)


class OptunaPruning(Callback):
    """Pruning for one trial of a study kept in a database or journal file (`storage`, its URL).

    The step of each report is the number of validations so far, not the epoch or the global
    step: trials with different batch sizes or validation intervals are then compared at the
    same point of their schedule, and a run that validates twice an epoch reports twice.
    Rank 0 alone reads and writes the study and decides; the decision is broadcast, so under
    DDP every rank stops at the same validation. A pruned run stops as `EarlyStopping` stops
    it: checkpoints, test and metrics.json as usual.
    """

    def __init__(
        self,
        storage: str | None,
        study_name: str,
        trial_number: int,
        monitor: str,
        pruner: optuna.pruners.BasePruner,
    ):
        if storage is None:
            raise ConfigError(
                "callbacks.optuna_pruning needs the study in a database that each trial "
                "reaches: set hydra.sweeper.storage (e.g. sqlite:///logs/optuna.db)."
            )
        self.storage = storage
        self.study_name = study_name
        self.trial_number = trial_number
        self.monitor = monitor
        self.pruner = pruner
        self.validations = 0
        self._trial: optuna.Trial | None = None  # loaded on rank 0, in the process that trains

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            self._trial = load_trial(self.storage, self.study_name, self.trial_number, self.pruner)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        if trainer.is_global_zero:
            prune = self.report(float(self.monitored_value(trainer)))
        self.validations += 1
        if trainer.strategy.broadcast(prune, src=0):
            trainer.should_stop = True

    def report(self, value: float) -> bool:
        """Report `value` at this validation's step; whether the pruner stops the trial."""
        assert self._trial is not None
        step = self.validations
        self._trial.report(value, step)
        if not self._trial.should_prune():
            return False
        self._trial.set_user_attr(PRUNED_AT_STEP, step)
        log.info(
            "Trial %d pruned at validation %d (%s=%.4f).",
            self._trial.number,
            step,
            self.monitor,
            value,
        )
        return True

    def monitored_value(self, trainer: Trainer):
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise ConfigError(
                f"callbacks.optuna_pruning.monitor={self.monitor!r} was not logged by "
                f"validation; logged: {sorted(trainer.callback_metrics)}. Set optimized_metric "
                f"to one of them."
            )
        return value


def load_trial(
    storage_url: str, study_name: str, number: int, pruner: optuna.pruners.BasePruner
) -> optuna.Trial:
    """Trial `number` of the study, with the pruner the sweeper configured for it."""
    storage = open_storage(storage_url)
    study = optuna.load_study(study_name=study_name, storage=storage, pruner=pruner)
    study_id = storage.get_study_id_from_name(study_name)
    return optuna.Trial(study, storage.get_trial_id_from_study_id_trial_number(study_id, number))

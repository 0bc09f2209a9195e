"""Read a study's results back.

`optimization_results.yaml`, and each trial's state and each parameter's importance for the
sweep summary.
"""

import logging
from collections.abc import Callable
from pathlib import Path

import optuna
from omegaconf import OmegaConf
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from src.utils.optuna_storage import open_storage

log = logging.getLogger(__name__)

# With fewer complete trials, the importance of each parameter is mostly noise.
MIN_TRIALS_FOR_IMPORTANCE = 4


def write_results(study: optuna.Study, path: Path) -> None:
    """Write the best trial, or for several objectives the Pareto front, to `path`.

    In the format of Hydra's Optuna sweeper (`name`, then `best_params` and `best_value`, or
    `solutions`: each Pareto-optimal trial's `params` and `values`), with the study's name and
    each trial's number.
    """
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        log.warning("No trial of study %r completed: no %s written.", study.study_name, path.name)
        return
    results: dict = {"name": "optuna", "study_name": study.study_name}
    if len(study.directions) == 1:
        best = study.best_trial
        results |= {"best_trial": best.number, "best_params": best.params, "best_value": best.value}
        log.info("Best trial %d: %s = %s (%s)", best.number, best.params, best.value, path)
    else:
        front = sorted(study.best_trials, key=lambda trial: trial.number)
        results["solutions"] = [
            {"trial": trial.number, "params": trial.params, "values": trial.values}
            for trial in front
        ]
        log.info("Pareto front: trials %s (%s)", [trial.number for trial in front], path)
    OmegaConf.save(results, path)


def load_study_report(
    storage: str, study_name: str, objectives: list[str]
) -> tuple[dict[int, str], dict[str, dict[str, float]]]:
    """Read each trial's state by number and, for each objective, each parameter's importance.

    States are "COMPLETE", "PRUNED", "FAIL", ...; importances are keyed by the names in
    `objectives` (one per objective of the study) and empty below MIN_TRIALS_FOR_IMPORTANCE
    complete trials.
    """
    study = optuna.load_study(study_name=study_name, storage=open_storage(storage))
    trials = study.get_trials(deepcopy=False)
    states = {trial.number: trial.state.name for trial in trials}
    complete = sum(trial.state == TrialState.COMPLETE for trial in trials)
    if complete < MIN_TRIALS_FOR_IMPORTANCE:
        return states, {}
    if len(study.directions) == 1:
        return states, {objectives[0]: optuna.importance.get_param_importances(study)}
    return states, {
        name: optuna.importance.get_param_importances(study, target=cost(study, index))
        for index, name in enumerate(objectives)
    }


def cost(study: optuna.Study, index: int) -> Callable[[FrozenTrial], float]:
    """A trial's `index`-th objective as a value to minimise, as Optuna's importance takes it."""
    sign = -1.0 if study.directions[index] == StudyDirection.MAXIMIZE else 1.0
    return lambda trial: sign * trial.values[index]

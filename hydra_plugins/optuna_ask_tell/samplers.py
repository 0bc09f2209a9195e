"""The sampler options of `hydra/sweeper/sampler`, with the keys of Hydra's Optuna sweeper.

Each config holds every key that hydra-optuna-sweeper 1.3 and 1.4 give it, so that their configs
and command lines compose unchanged; a key left None takes Optuna's default. `motpe`, which
Optuna 4 removed, composes too and is refused in one line when the search starts.
"""

from dataclasses import dataclass
from typing import Any, NoReturn


@dataclass
class TPESamplerConfig:
    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None
    consider_prior: bool | None = None
    prior_weight: float | None = None
    consider_magic_clip: bool | None = None
    consider_endpoints: bool | None = None
    # Random trials before TPE starts modelling.
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: bool = False
    warn_independent_sampling: bool | None = None


@dataclass
class RandomSamplerConfig:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = None


@dataclass
class CmaEsSamplerConfig:
    """Continuous and integer parameters only; choice() ones are sampled at random."""

    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: int | None = None
    x0: dict[str, Any] | None = None
    sigma0: float | None = None
    independent_sampler: Any = None
    warn_independent_sampling: bool = True
    consider_pruned_trials: bool = False
    restart_strategy: str | None = None
    # Optuna's default: hydra-optuna-sweeper's 2 only applies with a restart_strategy, which
    # Optuna 4.4 deprecated.
    inc_popsize: int = -1
    use_separable_cma: bool = False
    source_trials: Any = None


@dataclass
class NSGAIISamplerConfig:
    """A genetic algorithm for several objectives: population_size random trials, then
    generations bred from the best."""

    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: int | None = None
    population_size: int = 50
    mutation_prob: float | None = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5
    constraints_func: Any = None


@dataclass
class GPSamplerConfig:
    _target_: str = "optuna.samplers.GPSampler"
    seed: int | None = None
    independent_sampler: Any = None
    n_startup_trials: int = 10
    deterministic_objective: bool = False
    constraints_func: Any = None
    warn_independent_sampling: bool = True


@dataclass
class QMCSamplerConfig:
    """Quasi-random points that cover the space evenly (Optuna marks it experimental)."""

    _target_: str = "optuna.samplers.QMCSampler"
    seed: int | None = None
    qmc_type: str = "sobol"
    scramble: bool = False
    independent_sampler: Any = None
    warn_asynchronous_seeding: bool = True
    warn_independent_sampling: bool = True


@dataclass
class GridSamplerConfig:
    """Every combination of the swept values, each once, in an order the seed shuffles.

    Partial: the sweeper gives it the grid of the search space.
    """

    _target_: str = "optuna.samplers.GridSampler"
    _partial_: bool = True
    seed: int | None = None


@dataclass
class MOTPESamplerConfig:
    """The keys of hydra-optuna-sweeper 1.3's MOTPE sampler, which Optuna 4 removed."""

    _target_: str = "hydra_plugins.optuna_ask_tell.samplers.motpe_removed"
    seed: int | None = None
    consider_prior: bool | None = None
    prior_weight: float | None = None
    consider_magic_clip: bool | None = None
    consider_endpoints: bool | None = None
    n_startup_trials: int | None = None
    n_ehvi_candidates: int | None = None


def motpe_removed(*args: Any, **kwargs: Any) -> NoReturn:
    """Refuse the `motpe` sampler, which Optuna 4 folded into TPE."""
    from src.utils.errors import ConfigError

    raise ConfigError(
        "The 'motpe' sampler was removed in Optuna 4.0: choose hydra/sweeper/sampler=tpe, whose "
        "TPE now handles several objectives, or nsgaii."
    )


SAMPLERS = {
    "tpe": TPESamplerConfig,
    "random": RandomSamplerConfig,
    "cmaes": CmaEsSamplerConfig,
    "nsgaii": NSGAIISamplerConfig,
    "motpe": MOTPESamplerConfig,
    "grid": GridSamplerConfig,
    "gp": GPSamplerConfig,
    "qmc": QMCSamplerConfig,
}

"""Hyperparameter search on Optuna's ask/tell API as Hydra plugins: the `optuna_ask_tell`
sweeper (hydra/sweeper), its sampler and pruner options, and the `processes` launcher that runs
a batch of trials in parallel."""

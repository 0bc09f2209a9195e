"""Hyperparameter search on Optuna's ask/tell API as Hydra plugins: the `optuna` sweeper
(hydra/sweeper, also named `optuna_ask_tell`), its sampler and pruner options, and the
`processes` launcher that runs a batch of trials in parallel."""

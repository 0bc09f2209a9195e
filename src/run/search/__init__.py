"""Hyperparameter searches.

Hydra's sweep syntax as an Optuna space, the study, trials in their own processes, and the
summary of a multirun.
"""

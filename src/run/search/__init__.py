"""Hyperparameter searches.

Hydra's sweep syntax as an Optuna space, the study and its results, trials in their own
processes, and the summary of a multirun (with the Pareto front of several metrics).
"""

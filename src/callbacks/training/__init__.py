"""Callbacks that change how a run trains.

Compilation, EMA weights, layer freezing, the learning-rate finder, non-finite checks, Optuna
pruning, process-group teardown.
"""

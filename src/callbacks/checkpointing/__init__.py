"""Callbacks that make a run resumable.

Periodic checkpoints, RNG state, the run's config and logged metrics in every checkpoint, a clean
stop when the job is preempted.
"""

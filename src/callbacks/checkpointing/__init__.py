"""Callbacks that make a run resumable.

Periodic checkpoints, RNG state, the run's config in every checkpoint, a clean stop when the job
is preempted.
"""

"""Checkpoints and weights files: atomic weights-only I/O, and a run restored from one."""

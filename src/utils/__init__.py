"""Glue between Hydra configs and Lightning: instantiation, checks, run files and sweep summaries."""

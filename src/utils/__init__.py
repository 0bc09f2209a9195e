"""Glue between Hydra configs and Lightning: instantiation, checks, run files, sweep summaries."""

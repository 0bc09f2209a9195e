"""Callbacks that measure a run and change nothing in it.

Throughput and MFU, profiles, layer and data reports, plots, per-class results, exact-match
accuracy.
"""

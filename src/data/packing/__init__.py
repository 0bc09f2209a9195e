"""Sequence packing.

Documents fitted into rows, the batch metadata that keeps them apart (positions, cu_seqlens,
labels), and the checks that packing changes nothing a model computes.
"""

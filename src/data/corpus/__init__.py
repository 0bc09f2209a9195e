"""Corpora on disk, from documents to token ids.

Documents read through `datasets`, the tokenizers, and the memory-mapped token store the text
datamodules read rows from.
"""

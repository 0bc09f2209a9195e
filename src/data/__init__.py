"""Datamodules and what feeds them.

`image/` holds the classification sets, `text/` the language-model datamodules, `corpus/`
reading, tokenising and the token store, `packing/` rows of documents kept apart; the sampler
and split rules all of them share sit here.
"""

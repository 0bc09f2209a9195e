"""Preference pairs for DPO and its kin (`data=preferences`, `model.objective=dpo`).

`datamodule.py` is the datamodule; `records.py` reads TRL's row formats into a prompt and two
responses and renders them; `rows.py` fits pairs to the sequence length and serves and collates
them; `reference_logps.py` keeps precomputed reference log-probabilities beside the token store;
`synthetic.py` is the shipped synthetic set.
"""

"""Preference tuning of a LanguageModel (`model.objective=dpo`): DPO, IPO, hinge, SimPO, ORPO.

`losses.py` holds the published formulas on sequence log-probabilities; `sequences.py` sums a
batch's label log-probabilities over each response; `reference.py` is where the reference
log-probabilities come from (a frozen copy, the base under disabled LoRA adapters, or values the
datamodule precomputed); `objective.py` is the objective a LanguageModel trains with.
"""

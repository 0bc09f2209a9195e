"""The run layer: what turns a config into a finished run.

It composes and checks the config (`config/`), builds the Trainer, launches and locks the run
and writes its outputs; `search/` runs hyperparameter searches and `language/` exports and
evaluates language models.
"""

"""Language-model runs after training.

The export as a transformers folder, and lm-evaluation-harness scores kept with the run.
"""

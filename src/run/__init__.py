"""The run layer: compose, check and launch a run, build its Trainer, write its outputs."""

"""Lightning callbacks of the template.

`measurement/` observes a run, `checkpointing/` makes it resumable, `training/` changes how it
trains.
"""

"""The marks a trial's run leaves in its Optuna study for the sweeper to read.

Apart from the pruning callback, so that a sweeper reads them without importing Lightning.
"""

# The user attribute that marks a trial stopped by its pruner: the sweeper, which alone tells
# the study how a trial ended, records such a trial as pruned.
PRUNED_AT_STEP = "pruned_at_step"

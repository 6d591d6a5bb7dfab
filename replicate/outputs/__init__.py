"""Step 6, combine outputs: the one `EstimatorSpec` the Estimator sees.

- `specs`: the towers' specs combined: loss, TRAIN, EVAL, outputs.
- `predictions`: predictions and export outputs put back together.
- `metrics`: eval metrics over the whole batch.
"""

"""Step 6, combine outputs: the one `EstimatorSpec` the Estimator sees.

- `specs`: the towers' specs combined: loss, TRAIN, EVAL, outputs.
- `predictions`: predictions and export outputs put back together; those
  computed where rows meet, built again on the whole batch's rows.
- `metrics`: eval metrics over the whole batch.
- `batch_inputs`: metric updates fed a value over the batch, fed the whole
  batch's once.
- `tpu_spec`: a `TPUEstimatorSpec`'s `eval_metrics` and `scaffold_fn`,
  called once on the whole batch.
- `metric_rows`: a metric update no combination of the towers' gives,
  computed once on the whole batch's rows.
- `summaries`: summaries and `LoggingTensorHook` tensors of values over
  the batch read the whole batch's.
- `whole_batch`: the one builder of tower 0's values on the whole batch's
  rows (for summaries, `metric_rows` and `predictions`), from the towers'
  per-row tensors found and put together by `counterparts`, with the ops
  copied by `op_copies`; `row_counts` says which values count the rows,
  `folded_shapes` reads a shape folded to a constant.
"""

"""Step 6, combine outputs: the one `EstimatorSpec` the Estimator sees.

- `specs`: the towers' specs combined: loss, TRAIN, EVAL, outputs.
- `predictions`: predictions and export outputs put back together.
- `metrics`: eval metrics over the whole batch.
- `batch_inputs`: metric updates fed a value over the batch, fed the whole
  batch's once.
- `tpu_spec`: a `TPUEstimatorSpec`'s `eval_metrics` and `scaffold_fn`,
  called once on the whole batch.
- `metric_rows`: a metric update no combination of the towers' gives,
  computed once on the whole batch's rows.
- `summaries`: summaries and `LoggingTensorHook` tensors of values over
  the batch read the whole batch's, which `whole_batch` builds again on
  the towers' rows, found and put together by `counterparts`.
"""

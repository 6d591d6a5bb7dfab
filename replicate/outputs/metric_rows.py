"""A metric fed a value no combination of the towers' values gives: its
update is computed once, on the whole batch's rows.

On what: a metric whose update reads a value over the batch made by an op
that is no sum, count, maximum, minimum, any, all or mean of the rows (a
`py_func` corpus score such as BLEU or ROUGE, a median, an op the rows rule
does not know), or a per-row value computed where rows meet off the loss's
path (an in-batch similarity: `replicate.shard.rows_meet`'s). Each tower's
value is over its shard only, and no combination of them is one device's.

On how: tower 0's writes of its metric variables read the whole
batch's values instead, built by `replicate.outputs.whole_batch`: the ops
of its update back to the tower's per-row tensors are built again on the
towers' per-row tensors concatenated in tower order (input order), as
`replicate.all_rows` and a `TPUEstimatorSpec`'s `eval_metrics`
(`replicate.outputs.tpu_spec`) give the whole batch; the spec's loss is
the combined spec's loss. Tower 0's update alone runs
(`replicate.outputs.metrics`). The loss's and the predictions' own values
are not touched: they stay per tower.

Refused, naming the value, with the fix: what `whole_batch` cannot build
again (a shape TensorFlow folded to a constant that the towers cannot tell,
every tower holding one row; a reshape to the shard's rows; ops inside a TF
1 `while_loop`; a stateful op).
"""

import tensorflow as tf

from replicate import _tf
from replicate import graph_walk
from replicate.outputs import whole_batch

# Ops that read a variable without writing it.
_READS = frozenset(["ReadVariableOp", "Identity", "ResourceGather",
                    "ResourceGatherNd", "VariableShape"])


def feed_whole_batch(key: str, update, whole) -> None:
  """Tower 0's `update` of `key` computes on the whole batch's rows: the
  writes of metric (local) variables behind it (data and control edges)
  read the whole batch's values; the model's own ops (a lookup of an
  embedding table) stay the tower's.

  `whole()`: the call's `replicate.outputs.whole_batch.WholeBatch`.
  """
  whole = whole()
  graph = update.graph
  metric_variables = {v.op for name in (
      tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
      tf.compat.v1.GraphKeys.METRIC_VARIABLES)
                      for v in graph.get_collection(name)}
  ops = graph_walk.ops_behind([update], within=whole.forward,
                              follow_control=True)
  for op in sorted(ops, key=lambda o: o.name):
    if not _writes(op, metric_variables):
      continue
    for index, tensor in enumerate(op.inputs):
      if tensor.dtype == tf.resource or _tf.is_ref_dtype(tensor.dtype):
        continue
      try:
        value = whole.rebuilt(tensor)
      except whole_batch.CannotBuild as error:
        raise ValueError(_MESSAGE.format(key=key, why=error))
      if value is tensor:
        continue
      if not tensor.shape.is_compatible_with(value.shape):
        raise ValueError(_MESSAGE.format(
            key=key, why="the op {!r} holds {} where the whole batch gives "
            "{}".format(op.name, tensor.shape, value.shape)))
      _tf.update_input(op, index, value)


def _writes(op, metric_variables) -> bool:
  """Whether `op` writes a metric's variable (an `assign_add`, a scatter)."""
  if op.type in _READS:
    return False
  return any(whole_batch.variable_op(t) in metric_variables
             for t in op.inputs
             if t.dtype == tf.resource or _tf.is_ref_dtype(t.dtype))


_MESSAGE = (
    "eval_metric_ops[{key!r}] is fed a value over each tower's rows that no "
    "combination of the towers' values gives (a py_func corpus score, a "
    "median, rows that meet), so replicate computes it again on the whole "
    "batch's rows, but {why}. Fix: return a "
    "tf.compat.v1.estimator.tpu.TPUEstimatorSpec whose "
    "eval_metrics=(metric_fn, tensors) passes the per-row tensors (one row "
    "per input row) and computes this value in metric_fn; replicate calls "
    "metric_fn once, on the whole batch's tensors. Or feed the metric "
    "per-row values.")

"""A metric fed a value no combination of the towers' values gives: its
update is computed once, on the whole batch's rows.

On what: a metric whose update reads a value over the batch made by an op
that is no sum, count, maximum, minimum, any, all or mean of the rows (a
`py_func` corpus score such as BLEU or ROUGE, a median, an op the rows rule
does not know). Each tower's value is over its shard only, and no
combination of them is one device's value.

On how: tower 0's update, and the ops behind it that only metrics read, are
re-pointed at their inputs from the rows: each such input (a prediction's
per-row logits, a feature, the labels) reads the towers' tensors
concatenated along dimension 0 in tower order, each padded to the widest,
as `replicate.all_rows` and a `TPUEstimatorSpec`'s `eval_metrics`
(`replicate.outputs.tpu_spec`) give the whole batch, in input order; the
spec's loss reads the combined spec's loss. Tower 0's update alone runs
(`replicate.outputs.metrics`). The ops on the loss's and the predictions'
paths are not touched: they stay per tower, and their per-row values are
what is gathered. A rows rule refusal of the same op stays where it is on
those paths (the gradient path, and what is put back together by rows).

An input that has no rows to gather (a value over the tower's shard that
is not the loss) is refused, naming it, with the fix.
"""

from typing import Any, List, Sequence

import tensorflow as tf

from replicate import _tf
from replicate import graph_walk
from replicate.call import layout as layout_lib
from replicate.outputs import predictions as predictions_lib
from replicate.shard import rows as rows_lib


def feed_whole_batch(key: str, updates: Sequence[Any], tower_specs,
                     tower_ops: Sequence[List[tf.Operation]], layout,
                     combined_loss) -> None:
  """Tower 0's update of `key` computes on the whole batch's rows.

  `updates`: each tower's update of the key; `tower_ops`: the ops each
  tower built; `combined_loss`: the combined spec's loss.
  """
  within = frozenset(tower_ops[0])
  kept = set(graph_walk.ops_behind(_path_outputs(tower_specs[0]),
                                   within=within))
  metric_ops = set(graph_walk.ops_behind(
      [updates[0]], within=within, follow_control=True)) - kept
  tower0 = layout.towers[0]
  rows = rows_lib.TowerRows((tower0.features, tower0.labels), within)
  reads = [(op, index, tensor)
           for op in sorted(metric_ops, key=lambda o: o.name)
           for index, tensor in enumerate(op.inputs)
           if tensor.op not in metric_ops and rows.depend([tensor])]
  whole = {}  # tower 0's tensor ref -> the whole batch's
  for _, _, tensor in reads:
    if tensor.ref() in whole:
      continue
    value = _whole_batch(key, tensor, tower_specs, tower_ops, layout,
                         combined_loss)
    if not tensor.shape.is_compatible_with(value.shape):
      # The metric's ops were built for the shard's rows, known then: no
      # input of the whole batch's can replace them.
      raise ValueError(_STATIC.format(key=key, tensor=tensor))
    whole[tensor.ref()] = value
  for op, index, tensor in reads:
    _tf.update_input(op, index, whole[tensor.ref()])


def _path_outputs(spec):
  """What the loss's and the predictions' paths end in."""
  values = [spec.loss, spec.predictions]
  for output in (spec.export_outputs or {}).values():
    values.extend(getattr(output, field, None) for field in (
        "outputs", "scores", "classes", "value"))
  return [t for t in tf.nest.flatten(values)
          if isinstance(t, (tf.Tensor, tf.Operation))]


def _whole_batch(key, tensor, tower_specs, tower_ops, layout,
                 combined_loss):
  """The towers' counterparts of tower 0's `tensor`, in tower order."""
  loss = tower_specs[0].loss
  if loss is not None and tensor is tf.convert_to_tensor(loss):
    return tf.cast(combined_loss, tensor.dtype)
  if not tensor.shape.rank:
    raise ValueError(_NO_ROWS.format(key=key, tensor=tensor))
  parts = [_counterpart(tensor, index, tower_ops[index], layout)
           for index in range(layout.num_towers)]
  shards = layout.shards
  kept = []
  for index, part in enumerate(parts):
    if layout.towers[index].has_rows is False:
      continue
    kept.append(part[:shards.sizes[index]] if shards.may_stand_in else part)
  with tf.name_scope("metric_rows_over_towers"):
    return predictions_lib.concat_padded(kept)


def _counterpart(tensor, index, ops, layout):
  """Tower `index`'s tensor for tower 0's `tensor`: the same leaf of its
  shard, or the output of its op of the same name."""
  if index == 0:
    return tensor
  towers = layout.towers
  leaves = [tf.nest.flatten((t.features, t.labels), expand_composites=True)
            for t in (towers[0], towers[index])]
  for leaf, other in zip(*leaves):
    if leaf is tensor:
      return other
  for op in ops:
    if layout_lib.to_tower0_name(op.name, index) == tensor.op.name:
      return op.outputs[tensor.value_index]
  raise ValueError(
      "tower {} has no counterpart of tower 0's {!r}, which a metric reads: "
      "build the model_fn the same way in every tower (no branch on the "
      "tower).".format(index, tensor.name))


_FIX = (
    "Fix: return a tf.compat.v1.estimator.tpu.TPUEstimatorSpec whose "
    "eval_metrics=(metric_fn, tensors) passes the per-row tensors (one row "
    "per input row) and computes this value in metric_fn; replicate calls "
    "metric_fn once, on the whole batch's tensors. Or feed the metric "
    "per-row values.")
_STATIC = (
    "eval_metric_ops[{key!r}] is fed a value over each tower's rows that no "
    "combination of the towers' values gives (a py_func corpus score, a "
    "median), computed from {tensor!r}, whose number of rows was known when "
    "the metric was built: the metric cannot be computed again on the whole "
    "batch's rows (it is, on a batch of unknown size, as an input_fn's "
    "Dataset.batch() gives). " + _FIX)
_NO_ROWS = (
    "eval_metric_ops[{key!r}] is computed, once, on the whole batch's rows "
    "(its value over the batch is no sum, count, maximum, minimum or mean "
    "of them), but it reads {tensor!r}, a value over each tower's rows "
    "with no row to gather. Fix: compute the metric from per-row tensors "
    "(one row per input row), or return a "
    "tf.compat.v1.estimator.tpu.TPUEstimatorSpec whose eval_metrics="
    "(metric_fn, tensors) passes them; replicate calls metric_fn once, on "
    "the whole batch's tensors.")

"""Metric updates fed a value over the batch: fed the whole batch's, once.

On the rule: a metric variable's write (`assign_add(total, ...)`) is fed
per-row values when what it adds is a sum (or a count) of a tensor computed
from the rows: summing the towers' changes is one device's change, as
`replicate.outputs.metrics` does. Otherwise, walking back from what it adds,
every value computed from the rows that has no row dimension (a scalar, or a
`[C]` mean over the rows) is a value over the batch: `metrics.mean(loss)`,
`metrics.mean(tf.reduce_max(x))`. Each tower's is over its shard only, so
the towers' updates cannot be summed. Instead, tower 0's update is fed the
whole batch's value, combined from the towers' values, and it alone runs:
- the tower's spec `loss`: the combined spec's loss, combined the way
  `replicate.outputs.specs` combines it;
- a reduction over the rows: `Sum`, `Size` (and a count TensorFlow folded
  from a static batch) summed over towers; `Max`, `Min`, `Any`, `All` taken
  over towers; `Mean` weighted by the number of elements each tower
  averaged. A value computed from such reductions (`sum / count`) is then
  one device's too, since tower 0 computes it from the combined ones.
Anything else made from the rows without a row dimension (a `py_func`
corpus score, a median, a `top_k`) is of kind "rows": tower 0's update is
then computed once on the whole batch's rows (`replicate.outputs.
metric_rows`), as a `TPUEstimatorSpec`'s `eval_metrics` metric_fn is.

"From the rows" is `replicate.shard.rows`'s rule. A row tensor has rank 1 or
more and dimension 0 the shard's rows (unknown, when the shard's is).
"""

import re
from typing import List, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from replicate import _tf
from replicate import graph_walk
from replicate.graph import op_types
from replicate.shard import batch_reductions
from replicate.shard import sharding

# What a write may add directly and still be summed over towers.
_ADDITIVE = frozenset(["Sum", "Size", "UnsortedSegmentSum", "SegmentSum"])
# Counts scattered by row values (`metrics.mean_iou`'s confusion matrix):
# each row adds its own part, so the towers' parts sum to one device's.
_SCATTERED = frozenset(["ScatterNd", "Bincount", "DenseBincount",
                        "TensorScatterAdd"])
# Ops whose result, from sums, is still a sum (of the same rows' parts).
_LINEAR = frozenset(["Cast", "Identity", "Cumsum", "Reshape", "Transpose",
                     "ExpandDims", "Squeeze", "Neg", "ConcatV2", "Pack",
                     "Add", "AddV2", "Sub"])
_COMBINED = {"Sum": "sum", "Size": "sum", "Max": "max", "Min": "min",
             "Any": "any", "All": "all", "Mean": "mean"}
_OVER_TOWERS = {"max": tf.reduce_max, "min": tf.reduce_min,
                "any": tf.reduce_any, "all": tf.reduce_all}
_FOLDED_SIZE = re.compile(r"Size(_[0-9]+)?")
_FOLDED_SHAPE = re.compile(r"Shape(_[0-9]+)?")


def _is_shape(tensor):
  """A shape of a tensor (`tf.shape(x)`, or its value folded to a constant):
  a vector of sizes, never a row tensor, even when its length is the
  shard's rows."""
  op = tensor.op
  if tensor.dtype.base_dtype not in (tf.int32, tf.int64):
    return False
  return op.type == "Shape" or (
      op.type == "Const" and
      _FOLDED_SHAPE.fullmatch(op.name.split("/")[-1]) is not None)


class BatchValue(NamedTuple):
  """A value over the batch that a tower's metric update reads."""
  tensor: tf.Tensor
  kind: str  # "loss", a value of `_COMBINED`, or "rows": none of them
  reader: tf.Operation  # the metric's op that reads it
  index: int  # as its input `index`
  reduced: Optional[tf.Tensor]  # what a "mean" averaged


def find(key, update, variables, rows, row_count, loss,
         order) -> List[BatchValue]:
  """The values over the batch `update` (one tower's, for `key`) reads.

  `variables`: the key's metric variables; `rows`: the tower's
  `replicate.shard.rows.TowerRows`; `row_count`: its shard's static rows or
  None; `loss`: the tower's spec loss, or None; `order`: the position of
  each of the tower's ops in the order they were built.
  """
  variable_ops = {v.op for v in variables}
  behind = set(graph_walk.ops_behind([update], within=order,
                                     follow_control=True))
  writes = [op for op in behind
            if op.type in op_types.VARIABLE_WRITE_TYPES and op.inputs and
            _variable_op(op.inputs[0]) in variable_ops]
  finder = _Finder(key, rows, row_count, loss)
  found = []
  for write in sorted(writes, key=lambda op: order.get(op, -1)):
    for index, value in enumerate(write.inputs[1:], start=1):
      if not finder.is_additive(value):
        found.extend(finder.batch_values(write, index))
  metric_ops = behind | {getattr(update, "op", update)}
  for value in found:
    _check_read_by_the_metric_only(key, value, metric_ops)
  return found


def _check_read_by_the_metric_only(key, value, metric_ops):
  """The op fed the whole batch's value must be the metric's alone: what
  else reads it (the spec's loss, a prediction) keeps the tower's value."""
  for output in value.reader.outputs:
    for consumer in output.consumers():
      if consumer not in metric_ops:
        raise ValueError(
            "eval_metric_ops[{!r}] is fed a value over the batch through "
            "the op {!r}, which {!r} also reads, outside the metric: feeding "
            "the metric the whole batch's value would change it too. Fix: "
            "compute the metric's input on its own (from the per-row "
            "tensors), or return a tf.compat.v1.estimator.tpu."
            "TPUEstimatorSpec whose eval_metrics metric_fn gets the per-row "
            "tensors; replicate calls metric_fn once, on the whole "
            "batch's.".format(key, value.reader.name, consumer.name))


def _data_inputs(op):
  """The inputs of `op` that hold values: not a reduction's axes (on a
  score of unknown rank, `tf.range(tf.rank(score))`, a vector as long as
  the rank, is no row tensor, though its length is unknown like a
  batch's)."""
  if op.type in op_types.REDUCTION_TYPES and len(op.inputs) == 2:
    return op.inputs[:1]
  return op.inputs


def _variable_op(tensor):
  op = tensor.op
  while op.type in ("Identity", "ReadVariableOp") and op.inputs:
    op = op.inputs[0].op
  return op if op.type in op_types.VARIABLE_TYPES else None


class _Finder:

  def __init__(self, key, rows, row_count, loss):
    self._key = key
    self._rows = rows
    self._row_count = row_count
    self._loss = None if loss is None else tf.convert_to_tensor(loss)

  def _from_rows(self, tensor):
    return self._rows.depend([tensor])

  def _is_row(self, tensor):
    rank = tensor.shape.rank
    if not rank or _is_shape(tensor):
      return False
    rows = tf.compat.dimension_value(tensor.shape[0])
    if rows != self._row_count:
      return False
    # A reduction over dimension 0 of a row tensor is over the batch, even
    # when its width happens to be the shard's rows.
    op = tensor.op
    if op.type in op_types.REDUCTION_TYPES and len(op.inputs) == 2:
      # Axes known only when run are possibly the batch's.
      over = batch_reductions.over_batch_axis(op)
      if over is None or (over and self._is_row(op.inputs[0])):
        return False
    return True

  def _is_row_count(self, tensor):
    """`tf.shape(x)[0]` of a row tensor `x`: the shard's rows, a count that
    sums over towers, like `Size`."""
    op = tensor.op
    while op.type in ("Cast", "Identity") and op.inputs:
      tensor = op.inputs[0]
      op = tensor.op
    if op.type != "StridedSlice" or not op.get_attr("shrink_axis_mask") & 1:
      return False
    shape = op.inputs[0]
    if not _is_shape(shape) or not self._from_rows(shape):
      return False
    begin = tf.get_static_value(op.inputs[1])
    if begin is None or np.reshape(begin, [-1])[:1].tolist() != [0]:
      return False
    if shape.op.type == "Shape":
      return self._is_row(shape.op.inputs[0])
    return True

  def _is_opaque(self, tensor):
    """Whether a tensor of unknown rank may come from an op whose output is
    anything made of the rows (a `py_func`), through ops of unknown rank."""
    pending, seen = [tensor], set()
    while pending:
      t = pending.pop()
      if t.ref() in seen or t.shape.rank is not None:
        continue
      seen.add(t.ref())
      # A `py_func`: its output is anything made of the rows (a corpus
      # score), never taken for a sum's parts.
      if t.op.type in op_types.PY_FUNC_TYPES:
        return True
      pending.extend(t.op.inputs)
    return False

  def is_additive(self, value):
    """Whether the write adds a sum or count of the rows (or nothing of
    them): the towers' changes then sum to one device's."""
    if not self._from_rows(value) or self._is_row(value):
      return True
    op = value.op
    if op.type == "Const":
      return True  # a count folded from a static shape
    if self._is_row_count(value):
      return True
    if op.type in _ADDITIVE:
      # A rank unknown when built (`precision_at_k`'s set sizes) is no
      # scalar either, unless an op such as a `py_func` made it (a corpus
      # score over the rows: a value over the batch).
      source = op.inputs[0]
      if source.shape.rank is None:
        return not self._is_opaque(source)
      return source.shape.rank != 0
    if op.type in _SCATTERED:
      return True
    if op.type in _LINEAR:
      # A sum's parts rearranged (Keras' confusion matrices: a segment sum,
      # then a cumulative sum over the thresholds, a sum less it) are still
      # sums.
      return all(self.is_additive(t) for t in op.inputs)
    return False

  def batch_values(self, write, index):
    """Walks back from `write`'s input `index` to the values over the batch."""
    found = []
    pending = [(write, index)]
    seen = set()  # (reader, position): every read of a value is fed
    expanded = set()
    while pending:
      reader, position = pending.pop()
      tensor = reader.inputs[position]
      if (reader, position) in seen:
        continue
      seen.add((reader, position))
      if not self._from_rows(tensor) or self._is_row(tensor):
        continue
      op = tensor.op
      if self._loss is not None and tensor is self._loss:
        found.append(BatchValue(tensor, "loss", reader, position, None))
        continue
      if self._is_row_count(tensor):
        found.append(BatchValue(tensor, "sum", reader, position, None))
        continue
      if op.type == "Const":
        if _FOLDED_SIZE.fullmatch(op.name.split("/")[-1]):
          found.append(BatchValue(tensor, "sum", reader, position, None))
        continue
      row_inputs = [t for t in _data_inputs(op)
                    if self._is_row(t) and self._from_rows(t)]
      if row_inputs:
        # No combination of the towers' values gives one device's:
        # computed on the whole batch's rows (`metric_rows`).
        kind = _COMBINED.get(op.type, "rows")
        found.append(BatchValue(tensor, kind, reader, position,
                                row_inputs[0]))
        continue
      if op not in expanded:
        expanded.add(op)
        pending.extend((op, i) for i in reversed(range(len(op.inputs))))
    return found


def feed_once(key, tower_values, has_rows, combined_loss) -> None:
  """Tower 0's reads of its values over the batch read the whole batch's.

  `tower_values`: per tower, `find`'s list; `has_rows`: per tower, whether
  its values count; `combined_loss`: the combined spec's loss.
  """
  first = tower_values[0]
  for index, values in enumerate(tower_values[1:], start=1):
    if [v.kind for v in values] != [v.kind for v in first]:
      raise ValueError(
          "eval_metric_ops[{!r}]: tower {}'s update reads values over the "
          "batch ({}) unlike tower 0's ({}). Build the metric the same way "
          "in every tower.".format(key, index, [v.kind for v in values],
                                   [v.kind for v in first]))
  for position, value in enumerate(first):
    with tf.name_scope("metric_input_over_towers"):
      if value.kind == "loss":
        whole = combined_loss
      else:
        whole = _combined(value.kind,
                          [values[position] for values in tower_values],
                          has_rows)
    _tf.update_input(value.reader, value.index,
                     tf.cast(whole, value.tensor.dtype))


def _combined(kind, values, has_rows):
  tensors = [v.tensor for v in values]
  if kind == "sum":
    # A tower known to have no rows is left out (not zeroed: see there).
    return tf.math.add_n([sharding.zero_unless_rows(t, rows)
                          for t, rows in zip(tensors, has_rows)
                          if rows is not False])
  if kind in _OVER_TOWERS:
    # A tower without rows takes tower 0's value: neutral either way.
    chosen = [t if rows is True else tf.where(rows, t, tensors[0])
              for t, rows in zip(tensors, has_rows) if rows is not False]
    return _OVER_TOWERS[kind](tf.stack(chosen), axis=0)
  # "mean": weighted by the elements each tower averaged per output.
  totals, counts = [], []
  for value, rows in zip(values, has_rows):
    if rows is False:
      continue
    dtype = value.tensor.dtype
    count = tf.cast(tf.size(value.reduced), dtype) / tf.cast(
        tf.maximum(tf.size(value.tensor), 1), dtype)
    totals.append(sharding.zero_unless_rows(value.tensor * count, rows))
    counts.append(sharding.zero_unless_rows(count, rows))
  return tf.math.divide_no_nan(tf.math.add_n(totals), tf.math.add_n(counts))

"""Putting the towers' predictions and export outputs back together.

On batch-major values: a value computed from the tower's rows (it depends on
the tower's shard of `features` or `labels`) has one row per input row; the
towers' values are concatenated along dimension 0 in tower order, so they
line up with the input rows. What a tower computed on a stand-in row (see
`sharding`) is left out. In PREDICT, features whose dimension 0 disagree
are split each by its own rows, and a value is put back with the rows of
the feature it is computed from, as unwrapped.

On values that do not depend on the rows: a value computed from constants
and variables only (class names as a `[3]` constant, a temperature) is the
same in every tower; tower 0's is returned whole, as unwrapped. Whether a
value depends on the rows is `replicate.shard.rows`'s rule, the one `train_op`
uses: a shape TensorFlow folded to a constant with a static batch (the
canned heads' `all_class_ids`, `tf.zeros_like(x)`) counts as the rows.

On values computed where rows meet, off the loss's path (each row's
nearest row of the batch, a `py_func` of every row, rows reordered: the
rows rule's `Meeting`): the towers' values are no part of the whole
batch's, so the value is built again on the whole batch's rows by
`replicate.outputs.whole_batch`, once, as one device computes it.

On values that cannot be put back together: a value computed from the rows
with no batch dimension (a scalar mean of the logits) is what one device
computes over the whole batch, which no combination of the towers' values
gives. In `predictions` it is a `ValueError` naming it. In `export_outputs`
it becomes a tensor that fails, naming it, when run: the multi-tower graph's
export outputs are never run by `Estimator.predict` (it fetches
`predictions`), and a SavedModel export builds the `model_fn` as one tower
(see `replicate.model_fn`), where the export output is the `model_fn`'s own.
"""

from typing import Optional

import tensorflow as tf

from replicate import graph_walk
from replicate.outputs import counterparts
from replicate.outputs import whole_batch
from replicate.shard import rows

_export_outputs = tf.estimator.export


class _CannotCombineError(ValueError):
  """A tower's value that cannot be put back together along the batch."""


def combine_outputs(tower_specs, layout, tower0_ops, whole_values=None,
                    whole=None):
  """(predictions, export_outputs) over every tower, from one spec per tower.

  `layout` is the call's `replicate.call.layout.TowerLayout`: the towers'
  shards and the batch's split;
  `tower0_ops` the ops tower 0 built, within which `replicate.shard.rows` looks
  for what its values are computed from; `whole_values` {a tower's
  reduction over the batch axis (`ref()`): the whole batch's value}
  (`replicate.shard.batch_reductions.combine`'s), which a value that is one
  of them is instead: one device's, static or unknown batch alike;
  `whole()` the call's `replicate.outputs.whole_batch.WholeBatch`, which
  builds again a value computed after ops where rows meet (None: there
  are none).
  """
  tower0 = layout.towers[0]
  rows_of_tower0 = rows.TowerRows((tower0.features, tower0.labels),
                                  tower0_ops)
  combiner = _Combiner(layout.shards, rows_of_tower0, whole_values=whole_values,
                       whole=whole)
  predictions = combiner.structure(
      "predictions", [spec.predictions for spec in tower_specs])
  outputs = tower_specs[0].export_outputs
  if outputs:
    lenient = _Combiner(layout.shards, rows_of_tower0, is_lenient=True,
                        whole_values=whole_values, whole=whole)
    outputs = {
        key: _combined_export_output(
            "export_outputs[{!r}]".format(key),
            [spec.export_outputs[key] for spec in tower_specs], lenient)
        for key in outputs
    }
  return predictions, outputs


class _Combiner:
  """Puts per-tower values back together, or returns tower 0's whole.

  A lenient one (for export outputs) returns a value it cannot put back
  together as a tensor that fails when run; a strict one raises.
  """

  def __init__(self, shards, rows_of_tower0, is_lenient=False,
               whole_values=None, whole=None):
    self._whole_values = whole_values or {}
    self._whole = whole
    self._shards = shards
    self._rows_of_tower0 = rows_of_tower0
    self._is_lenient = is_lenient
    inputs = list(zip(shards.features, shards.labels))
    self._tower_rows = [_static_rows(tower_inputs) for tower_inputs in inputs]

  def structure(self, name, values):
    """A tensor or a dict of them, per tower, put back together."""
    if values[0] is None:
      return None
    if isinstance(values[0], dict):
      return {key: self.tensors(name + "[{!r}]".format(key),
                                [v[key] for v in values])
              for key in values[0]}
    return self.tensors(name, values)

  def tensors(self, name, tensors):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    tensors = [self._whole_values.get(t.ref(), t) for t in tensors]
    if not self._rows_of_tower0.depend([tensors[0]]):
      return tensors[0]
    if self._whole is not None and self._whole().needed(tensors[0]):
      try:
        return self._whole().rebuilt(tensors[0])
      except whole_batch.CannotBuild as error:
        if not self._is_lenient:
          raise ValueError(_REBUILT.format(name, error))
        return _failing_when_run(tensors[0], _REBUILT.format(name, error))
    try:
      self._check_batch_major(name, tensors)
    except _CannotCombineError as error:
      if not self._is_lenient:
        raise
      return _failing_when_run(tensors[0], str(error))
    if self._shards.may_stand_in:
      # Keep each tower's real rows: none from a tower on a stand-in row.
      sizes = self._sizes_for(tensors[0])
      tensors = [t[:sizes[i]] for i, t in enumerate(tensors)]
    return counterparts.concat_padded(tensors)

  def _sizes_for(self, tensor):
    """The rows per tower of the input `tensor` (tower 0's) is made from.

    Every input has the batch's rows, except in PREDICT with features whose
    dimension 0 may disagree, each split by its own (see `sharding`).
    """
    leaf_sizes = self._shards.leaf_sizes
    if not leaf_sizes:
      return self._shards.sizes
    behind = set(graph_walk.ops_behind([tensor]))
    for part, sizes in leaf_sizes:
      if any(t.op in behind for t in tf.nest.flatten(part,
                                                     expand_composites=True)):
        return sizes
    return self._shards.sizes

  def _check_batch_major(self, name, tensors):
    if tensors[0].shape.rank == 0:
      raise _CannotCombineError(
          "{} is computed from each tower's rows but is a scalar ({!r}), so "
          "the towers' values cannot be put back together into the value "
          "of the whole batch. Return a value with one row per input row "
          "(shape [batch, ...]), e.g. the per-row values it reduces, and "
          "reduce them after prediction.".format(name, tensors[0]))
    for index, tensor in enumerate(tensors):
      rows = self._tower_rows[index]
      value_rows = tf.compat.dimension_value(tensor.shape[0])
      if rows is not None and value_rows not in (None, rows):
        raise _CannotCombineError(
            "{} is computed from each tower's rows but tower {}'s value has "
            "{} rows where its shard has {} ({!r}), so it is not one row "
            "per input row and cannot be put back together along the batch. "
            "Return a value of shape [batch, ...].".format(
                name, index, value_rows, rows, tensor))


def _failing_when_run(tensor, reason):
  """`tensor`'s shape and dtype, but running it raises with `reason`."""
  message = ("replicate_model_fn: {} This export output exists only in a "
             "SavedModel, which builds the model_fn as one tower; the "
             "multi-tower graph has no value for it.".format(reason))
  with tf.name_scope("uncombinable_export_output"):
    check = tf.debugging.Assert(False, [message])
    with tf.control_dependencies([check]):
      return tf.identity(tensor)


def _combined_export_output(name, outputs, combiner):
  first = outputs[0]
  if isinstance(first, _export_outputs.ClassificationOutput):
    return _export_outputs.ClassificationOutput(
        scores=combiner.structure(name + ".scores",
                                  [o.scores for o in outputs]),
        classes=combiner.structure(name + ".classes",
                                   [o.classes for o in outputs]))
  if isinstance(first, _export_outputs.RegressionOutput):
    return _export_outputs.RegressionOutput(
        combiner.tensors(name + ".value", [o.value for o in outputs]))
  if isinstance(first, _export_outputs.PredictOutput):
    return _export_outputs.PredictOutput(
        combiner.structure(name, [o.outputs for o in outputs]))
  raise ValueError(
      "{} is a {}; replicate_model_fn can put back together PredictOutput, "
      "RegressionOutput and ClassificationOutput.".format(
          name, type(first).__name__))


def _static_rows(tower_inputs) -> Optional[int]:
  """The rows of a tower's shard, when its dense tensors say statically."""
  for value in tf.nest.flatten(tower_inputs):
    if isinstance(value, tf.Tensor) and value.shape.rank:
      rows = tf.compat.dimension_value(value.shape[0])
      if rows is not None:
        return rows
  return None


_REBUILT = (
    "{} is computed after ops where different rows of the batch meet (off "
    "the loss's path: an in-batch similarity, a py_func of the rows, a "
    "reordering of the rows), so replicate computes it again on the whole "
    "batch's rows, but {}. Fix: compute it from the whole batch's rows, "
    "replicate.all_rows(x), and take the tower's rows back, e.g. y = "
    "f(replicate.all_rows(x))[replicate.row_offset():][:tf.shape(x)[0]].")

"""Combining the towers' `EstimatorSpec`s into the one the Estimator sees.

On loss: the sum of the towers' weighted losses, the loss of the whole batch;
a tower with no rows adds exactly 0.

On TRAIN: the one train_op of the step (see `replicate.train_op`).

On EVAL: every metric over the whole batch (see `replicate.metrics`).

On PREDICT: predictions and every export output are concatenated along
dimension 0 in tower order, so they line up with the input rows; what a
tower computed on a stand-in row (see `sharding`) is left out, and its metric
updates are zeroed, not moved.

Scaffold and hooks are tower 0's: each tower makes the same ones, and tower
0's are what the unwrapped model_fn makes.
"""

from typing import List

import tensorflow as tf

from replicate import metrics
from replicate import sharding
from replicate import train_op as train_op_lib

ModeKeys = tf.estimator.ModeKeys
_export_outputs = tf.estimator.export


def combine_specs(mode: str, tower_specs: List[tf.estimator.EstimatorSpec],
                  context) -> tf.estimator.EstimatorSpec:
  """The EstimatorSpec of the whole batch, from one spec per tower."""
  _check_alike(tower_specs)
  fields = tower_specs[0]._asdict()
  fields["mode"] = mode
  concat = _Concatenator(context)
  fields["predictions"] = concat.structure(
      "predictions", [spec.predictions for spec in tower_specs])
  fields["export_outputs"] = _concat_export_outputs(tower_specs, concat)
  if tower_specs[0].loss is not None:
    fields["loss"] = _weighted_loss(tower_specs, context)
  fields.update(_COMBINERS[mode](tower_specs, context))
  return tf.estimator.EstimatorSpec(**fields)


def _check_alike(tower_specs):
  """Every tower's spec must have tower 0's parts, to be put together."""
  first = _outline(tower_specs[0])
  for index, spec in enumerate(tower_specs[1:], start=1):
    outline = _outline(spec)
    for part, expected in first.items():
      if outline[part] != expected:
        raise ValueError(
            "Tower {}'s EstimatorSpec differs from tower 0's in its {}: {} "
            "instead of {}. Each tower's model_fn must return the same "
            "structure, whatever its data.".format(index, part,
                                                    outline[part], expected))


def _outline(spec):
  """What must match across towers: which parts are set, and their keys."""
  def keys(value):
    return sorted(value) if isinstance(value, dict) else (
        "none" if value is None else "a single tensor")

  return {
      "loss": "none" if spec.loss is None else "a loss",
      "train_op": "none" if spec.train_op is None else "a train_op",
      "predictions": keys(spec.predictions),
      "eval_metric_ops keys": keys(spec.eval_metric_ops or None),
      "export_outputs keys": keys(spec.export_outputs or None),
  }


def _weighted_loss(tower_specs, context):
  with tf.name_scope("loss_over_towers"):
    terms = []
    for spec, weight, rows in zip(tower_specs, context.weights.all(),
                                  context.has_rows):
      if rows is False:
        continue
      loss = tf.convert_to_tensor(spec.loss)
      terms.append(sharding.zero_unless_rows(
          loss * tf.cast(weight, loss.dtype), rows))
    return tf.math.add_n(terms, name="sum")


def _train_fields(tower_specs, context):
  if all(spec.train_op is None for spec in tower_specs):
    return {}
  return {"train_op": train_op_lib.combine_train_op(tower_specs, context)}


def _eval_fields(tower_specs, context):
  return {"eval_metric_ops": metrics.combine_metrics(tower_specs, context)}


def _predict_fields(tower_specs, context):
  del tower_specs, context  # predictions and exports are done for every mode
  return {}


_COMBINERS = {
    ModeKeys.TRAIN: _train_fields,
    ModeKeys.EVAL: _eval_fields,
    ModeKeys.PREDICT: _predict_fields,
}


def _concat_export_outputs(tower_specs, concat):
  outputs = tower_specs[0].export_outputs
  if not outputs:
    return outputs
  return {
      key: _concat_export_output(
          key, [spec.export_outputs[key] for spec in tower_specs], concat)
      for key in outputs
  }


class _Concatenator:
  """Puts per-tower values back together along dimension 0, in tower order."""

  def __init__(self, context):
    self._context = context

  def structure(self, name, values):
    """A tensor or a dict of them, per tower, concatenated."""
    if values[0] is None:
      return None
    if isinstance(values[0], dict):
      return {key: self.tensors(name + "[{!r}]".format(key),
                                [v[key] for v in values])
              for key in values[0]}
    return self.tensors(name, values)

  def tensors(self, name, tensors):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if tensors[0].shape.rank == 0:
      raise ValueError(
          "{} is a scalar in each tower, so it cannot be put back together "
          "along the batch; return batch-major values (shape [batch, ...]) "
          "from the model_fn. Received: {!r}.".format(name, tensors[0]))
    if self._context.may_stand_in:
      # Keep each tower's real rows: none from a tower on a stand-in row.
      sizes = self._context.sizes
      tensors = [t[:sizes[i]] for i, t in enumerate(tensors)]
    return tf.concat(tensors, axis=0)


def _concat_export_output(key, outputs, concat):
  first = outputs[0]
  name = "export_outputs[{!r}]".format(key)
  if isinstance(first, _export_outputs.ClassificationOutput):
    return _export_outputs.ClassificationOutput(
        scores=concat.structure(name + ".scores", [o.scores for o in outputs]),
        classes=concat.structure(name + ".classes",
                                 [o.classes for o in outputs]))
  if isinstance(first, _export_outputs.RegressionOutput):
    return _export_outputs.RegressionOutput(
        concat.tensors(name + ".value", [o.value for o in outputs]))
  if isinstance(first, _export_outputs.PredictOutput):
    return _export_outputs.PredictOutput(
        concat.structure(name, [o.outputs for o in outputs]))
  raise ValueError(
      "{} is a {}; replicate_model_fn can put back together PredictOutput, "
      "RegressionOutput and ClassificationOutput.".format(
          name, type(first).__name__))

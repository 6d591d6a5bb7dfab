"""Combining the towers' `EstimatorSpec`s into the one the Estimator sees.

On loss: the sum of the towers' weighted losses, the loss of the whole batch;
a tower with no rows, or whose loss denominator is 0, adds exactly 0.

On TRAIN: the one train_op of the step (see `replicate.state.train_op`).

On EVAL: every metric over the whole batch (see `replicate.outputs.metrics`).

On predictions and export outputs (every mode): see `replicate.outputs.predictions`.
A tower on a stand-in row (see `sharding`) has its metric updates zeroed,
not moved.

Scaffold and hooks are tower 0's: each tower makes the same ones, and tower
0's are what the unwrapped model_fn makes. What tower 0's summaries and
`LoggingTensorHook`s read of values over the batch is the whole batch's
(see `replicate.outputs.summaries`). A `local_init_op` of the
model_fn's own also initialises the other towers' local state (see
`replicate.towers.scaffolds`).
"""

from typing import List

import tensorflow as tf

from replicate.gradients import touched
from replicate.outputs import metrics
from replicate.outputs import predictions as predictions_lib
from replicate.outputs import summaries
from replicate.outputs import whole_batch
from replicate.towers import scaffolds
from replicate.shard import sharding
from replicate.shard import rows_meet
from replicate.state import train_op as train_op_lib

ModeKeys = tf.estimator.ModeKeys


def combine_specs(mode: str, tower_specs: List[tf.estimator.EstimatorSpec],
                  *, layout, progress, records, weights,
                  variables, whole_values=None,
                  meeting=rows_meet.Meeting()) -> tf.estimator.EstimatorSpec:
  """The EstimatorSpec of the whole batch, from one spec per tower.

  The hand-off to step 6, after the towers are built and finished.

  Args:
    mode: the call's `tf.estimator.ModeKeys`.
    tower_specs: each tower's `EstimatorSpec`, in tower order.
    layout: the call's `replicate.call.layout.TowerLayout`.
    progress: the towers' `replicate.call.progress.BuildProgress`, done.
    records: their optimizer calls
      (`replicate.gradients.optimizer_calls.OptimizerRecords`).
    weights: their loss weights (`replicate.gradients.weighting.TowerWeights`).
    variables: what their variables are
      (`replicate.variables.tower_variables.TowerVariables`).
    whole_values: the towers' reductions over the batch axis made the
      whole batch's (`replicate.shard.batch_reductions.combine`'s), which a
      prediction or export output that is one of them is instead.
    meeting: tower 0's ops off the loss's path where rows meet
      (`replicate.shard.rows_meet.check`'s): a metric, prediction or export
      output computed from one is computed on the whole batch's rows.

  Returns:
    One `EstimatorSpec`: the batch's loss, the one `train_op` (every
    state change classified by `replicate.state.rule`), metrics over the
    batch, predictions in input order.

  Raises:
    ValueError: towers whose specs differ, or a state change or output
    that cannot be made one device's, with the fix.
  """
  _check_alike(tower_specs)
  fields = tower_specs[0]._asdict()
  fields["mode"] = mode
  if tower_specs[0].loss is not None:
    fields["loss"] = _weighted_loss(tower_specs, weights, progress)
    if mode == ModeKeys.TRAIN:
      fields["loss"] = layout.sum_over_tasks(fields["loss"], "loss_over_tasks")
  # What predictions, metrics and summaries read of the whole batch: built
  # once, when one asks (its analysis of tower 0's graph costs a pass).
  whole = _Once(lambda: whole_batch.WholeBatch(
      mode, tower_specs, layout, progress, fields.get("loss"),
      touched.is_backward, mixed=meeting.mixed))
  fields["predictions"], fields["export_outputs"] = (
      predictions_lib.combine_outputs(tower_specs, layout,
                                      frozenset(progress.tower_ops[0]),
                                      whole_values,
                                      whole if meeting.mixed else None))
  if mode == ModeKeys.TRAIN and any(
      spec.train_op is not None for spec in tower_specs):
    fields["train_op"] = train_op_lib.combine_train_op(
        tower_specs, layout, progress, records, variables, weights)
  elif mode == ModeKeys.EVAL:
    fields["eval_metric_ops"] = metrics.combine_metrics(
        tower_specs, layout, variables, tower_ops=progress.tower_ops,
        loss=fields.get("loss"), combining=meeting.for_metrics, whole=whole)
  # PREDICT: predictions and export outputs are done for every mode.
  fields["scaffold"] = scaffolds.initializing_towers(
      fields["scaffold"], progress.local_state_after_tower0, layout.graph)
  # Last: what the summaries and logged tensors read is built by then.
  fields.update(summaries.make_whole(tower_specs, layout=layout,
                                     progress=progress, whole=whole))
  return tf.estimator.EstimatorSpec(**fields)


class _Once:
  """A value made by `make()` the first time it is called for."""

  def __init__(self, make):
    self._make = make
    self._value = None

  def __call__(self):
    if self._value is None:
      self._value = self._make()
    return self._value


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


def _weighted_loss(tower_specs, weights, progress):
  """The sum of the towers' losses, each weighted as the loss rule reads it
  (`weighting.TowerWeights.weigh_spec_losses`): the optimizer's weighted
  loss where the spec's loss is the one it minimized."""
  with tf.name_scope("loss_over_towers"):
    weighted = weights.weigh_spec_losses([spec.loss for spec in tower_specs],
                                         progress.rows_of)
    terms = []
    # A tower that does not count (no rows, or a loss denominator of 0) is
    # chosen away, not weighed 0: its loss may be NaN (0 / 0).
    for loss, counts in zip(weighted, weights.counts()):
      if counts is False:
        continue
      terms.append(sharding.zero_unless_rows(loss, counts))
    return tf.math.add_n(terms, name="sum")

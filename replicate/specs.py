"""Combining the towers' `EstimatorSpec`s into the one the Estimator sees.

On loss: the sum of the towers' weighted losses, the loss of the whole batch;
a tower with no rows adds exactly 0.

On TRAIN: `train_op` runs every tower's `train_op`; the last tower's holds the
one aggregated update (see `TowerOptimizer`). A train_op that ends by
incrementing the global step itself does so in tower 0 only.

On EVAL: each metric's update op runs every tower's update, then moves what
towers 1..N-1 accumulated into tower 0's metric variables (matched by name)
and zeroes theirs. So tower 0's value op, read any number of times, reports
the metric over every row seen, with no side effect on read. This holds for
metrics whose variables are sums (every `tf.compat.v1.metrics` function and
Keras metric states such as `total`, `count`, true positives).

On predictions and export outputs (every mode): see `replicate.outputs`.
A tower on a stand-in row (see `sharding`) has its metric updates zeroed,
not moved.

Scaffold and hooks are tower 0's: each tower makes the same ones, and tower
0's are what the unwrapped model_fn makes. A `local_init_op` of the
model_fn's own also initialises the other towers' local state (see
`replicate.scaffolds`).
"""

from typing import List

import tensorflow as tf

from replicate import graphs
from replicate import outputs as outputs_lib
from replicate import scaffolds
from replicate import sharding

ModeKeys = tf.estimator.ModeKeys

# Op types that own a variable's storage: a metric's value leads back to these.
_VARIABLE_OP_TYPES = frozenset(["VarHandleOp", "VariableV2", "Variable"])


def combine_specs(mode: str, tower_specs: List[tf.estimator.EstimatorSpec],
                  context) -> tf.estimator.EstimatorSpec:
  """The EstimatorSpec of the whole batch, from one spec per tower."""
  _check_alike(tower_specs)
  fields = tower_specs[0]._asdict()
  fields["mode"] = mode
  fields["predictions"], fields["export_outputs"] = (
      outputs_lib.combine_outputs(tower_specs, context))
  if tower_specs[0].loss is not None:
    fields["loss"] = _weighted_loss(tower_specs, context)
  fields.update(_COMBINERS[mode](tower_specs, context))
  fields["scaffold"] = scaffolds.initializing_towers(
      fields["scaffold"], context.local_state_after_tower0, context.graph)
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
    for spec, weight, rows in zip(tower_specs, context.weights,
                                  context.has_rows):
      if rows is False:
        continue
      loss = tf.convert_to_tensor(spec.loss)
      terms.append(sharding.zero_unless_rows(
          loss * tf.cast(weight, loss.dtype), rows))
    return tf.math.add_n(terms, name="sum")


def _train_fields(tower_specs, context):
  train_ops = [spec.train_op for spec in tower_specs]
  if all(op is None for op in train_ops):
    return {}
  counts = [len(calls) for calls in context.optimizer_calls]
  if not any(counts):
    raise ValueError(
        "The model_fn built a train_op on {} towers without a "
        "TowerOptimizer, so each tower would update the variables with its "
        "own gradients. Please wrap optimizers with TowerOptimizer: "
        "replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(...)).".
        format(context.num_towers))
  if len(set(counts)) > 1:
    raise ValueError(
        "The towers made different numbers of TowerOptimizer.apply_gradients "
        "calls ({}): each tower's model_fn was supposed to make the same "
        "optimizer calls in the same order. Make the calls independent of "
        "the tower's data.".format(", ".join(
            "tower {}: {}".format(i, n) for i, n in enumerate(counts))))
  kept = [train_ops[0]] + [_without_step_increment(op)
                           for op in train_ops[1:]]
  train_op = tf.group(*[op for op in kept if op is not None],
                      name="train_op_over_towers")
  return {"train_op": _then_fold(train_op, context)}


def _then_fold(op, context):
  """`op`, then the fold of tower-local variables (see `replicate.variables`)."""
  with tf.control_dependencies([op]):
    fold = context.variables.fold_tower_local(context.has_rows)
  return op if fold is None else tf.group(op, fold)


def _without_step_increment(train_op):
  """A tower's train_op, less a global-step increment it ends with.

  Some model_fns increment the global step themselves once their training
  is done (the compat.v1 DNNLinearCombined estimators); run in every tower,
  that would advance it once per tower. Towers 1..N-1 keep what the
  increment waited for, and only tower 0 increments.
  """
  if train_op is None:
    return None
  op = getattr(train_op, "op", train_op)
  global_step = tf.compat.v1.train.get_global_step()
  if (global_step is not None and
      op.type in ("AssignAdd", "AssignAddVariableOp") and
      op.inputs[0].op is global_step.op):
    return tf.group(*op.control_inputs)
  return train_op


def _eval_fields(tower_specs, context):
  """Each metric over every tower; tower-local variables folded once per batch.

  The fold waits for every metric's update, so each combined update op runs
  them all (the Estimator runs them together anyway).
  """
  metrics = tower_specs[0].eval_metric_ops or {}
  reduced = {
      key: _reduced_metric(key, [spec.eval_metric_ops[key]
                                 for spec in tower_specs], context)
      for key in metrics
  }
  if reduced:
    every_update = tf.group(*[update for _, update in reduced.values()])
    folded = _then_fold(every_update, context)
    if folded is not every_update:
      reduced = {key: (value, folded) for key, (value, _) in reduced.items()}
  return {"eval_metric_ops": reduced}


def _predict_fields(tower_specs, context):
  del tower_specs, context  # predictions and exports are done for every mode
  return {}


_COMBINERS = {
    ModeKeys.TRAIN: _train_fields,
    ModeKeys.EVAL: _eval_fields,
    ModeKeys.PREDICT: _predict_fields,
}


def _reduced_metric(key, tower_metrics, context):
  """(tower 0's value, an update that also sums the towers into tower 0's)."""
  value, _ = tower_metrics[0]
  variables = _metric_variables(value)
  tower0_by_name = {v.op.name: v for v in variables}
  moves = {name: [] for name in tower0_by_name}
  for index, (other_value, _) in enumerate(tower_metrics[1:], start=1):
    for variable in _metric_variables(other_value):
      if context.variables.tower0_variable(variable) is not variable:
        continue  # a tower-local copy: folded into tower 0's separately
      name = context.to_tower0_name(variable.op.name, index)
      if name not in moves:
        raise ValueError(
            "eval_metric_ops[{!r}]: tower {}'s metric variable {!r} has no "
            "counterpart named {!r} in tower 0 (tower 0 has {}). Create the "
            "metric the same way in every tower, e.g. with a fixed name.".
            format(key, index, variable.op.name, name, sorted(moves)))
      moves[name].append((index, variable))
  with tf.name_scope("metric_over_towers"):
    with tf.control_dependencies([update for _, update in tower_metrics]):
      moved = [_move_into(tower0_by_name[name], others, context)
               for name, others in sorted(moves.items()) if others]
    return value, tf.group(*moved, *[u for _, u in tower_metrics])


def _move_into(target, sources, context):
  """Adds `sources` into `target`, then zeroes them (reads happen first).

  `sources` are (tower index, variable); a tower on a stand-in row adds 0.
  """
  kept = []
  for index, source in sources:
    rows = context.has_rows[index]
    if rows is False:
      continue
    kept.append(sharding.zero_unless_rows(tf.convert_to_tensor(source),
                                          rows))
  sources = [source for _, source in sources]
  if not kept:
    return tf.group(*[_zeroed(s) for s in sources])
  added = tf.compat.v1.assign_add(target, tf.math.add_n(kept))
  with tf.control_dependencies([added]):
    return tf.group(*[_zeroed(s) for s in sources])


def _zeroed(variable):
  return tf.compat.v1.assign(
      variable, tf.zeros(variable.shape, variable.dtype.base_dtype))


def _metric_variables(value):
  """The local and metric variables a metric's value is computed from."""
  graph = tf.compat.v1.get_default_graph()
  candidates = {
      v.op: v for collection in (tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
                                 tf.compat.v1.GraphKeys.METRIC_VARIABLES)
      for v in graph.get_collection(collection)
  }
  found = []
  for op in graphs.ops_behind(
      (t for t in tf.nest.flatten(value) if isinstance(t, tf.Tensor)),
      stop_at_types=_VARIABLE_OP_TYPES):
    if op in candidates and candidates[op] not in found:
      found.append(candidates[op])
  return found

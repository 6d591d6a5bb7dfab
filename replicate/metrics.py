"""Eval metrics over the whole batch, from each tower's metric variables.

On the fold: every tower updates its own metric variables on its rows; then
what towers 1..N-1 accumulated is added into tower 0's variables (matched by
name) and theirs are zeroed. So tower 0's value op, read any number of
times, reports the metric over every row seen, with no side effect on read.
This holds for metrics whose variables are sums (every
`tf.compat.v1.metrics` function, and Keras metric states such as `total`,
`count`, true positives).

On shared variables: some keys share metric variables (binary canned heads'
`label/mean` and `accuracy_baseline` read the same total and count). Each
variable is folded once per batch, whatever keys read it: every key's update
op is the same op, which runs every tower's update of every key and then
each fold once. The Estimator runs the update ops together anyway.

On towers without rows (a stand-in row): their updates add 0.

On per-batch values: a metric fed one value per batch (`metrics.mean(loss)`,
`metrics.mean(tf.reduce_max(x))`) is fed one value per tower, so it
averages the towers' values; feed it per-example values (the unreduced
losses, with their weights) to get the whole batch's metric.
"""

from typing import Dict, List

import tensorflow as tf

from replicate import graphs
from replicate import sharding

# Op types that own a variable's storage: a metric's value leads back to these.
_VARIABLE_OP_TYPES = frozenset(["VarHandleOp", "VariableV2", "Variable"])


def combine_metrics(tower_specs, context) -> Dict[str, tuple]:
  """`eval_metric_ops` over the whole batch: tower 0's values, one update."""
  keys = sorted(tower_specs[0].eval_metric_ops or {})
  if not keys:
    return {}
  targets = {}  # tower 0 variable name -> the variable
  sources = {}  # tower 0 variable name -> {tower variable ref: (index, var)}
  for key in keys:
    tower0_variables = _metric_variables(tower_specs[0].eval_metric_ops[key][0])
    by_name = {v.op.name: v for v in tower0_variables}
    targets.update(by_name)
    for index, spec in enumerate(tower_specs[1:], start=1):
      for variable in _metric_variables(spec.eval_metric_ops[key][0]):
        if context.variables.tower0_variable(variable) is not variable:
          continue  # a tower-local copy: folded into tower 0's separately
        if any(variable is v for v in tower0_variables):
          continue  # shared with tower 0 (get_local_variable under reuse)
        name = context.to_tower0_name(variable.op.name, index)
        if name not in by_name:
          raise ValueError(
              "eval_metric_ops[{!r}]: tower {}'s metric variable {!r} has no "
              "counterpart named {!r} in tower 0 (tower 0 has {}). Create "
              "the metric the same way in every tower, e.g. with a fixed "
              "name.".format(key, index, variable.op.name, name,
                             sorted(by_name)))
        sources.setdefault(name, {})[variable.ref()] = (index, variable)
  updates = [spec.eval_metric_ops[key][1] for spec in tower_specs
             for key in keys]
  with tf.name_scope("metric_over_towers"):
    with tf.control_dependencies(updates):
      moved = [_move_into(targets[name], list(sources[name].values()),
                          context) for name in sorted(sources)]
    update = tf.group(*moved, *updates)
  update = context.variables.then_fold(update, context.layout.has_rows)
  return {key: (tower_specs[0].eval_metric_ops[key][0], update)
          for key in keys}


def _move_into(target, sources, context):
  """Adds `sources` into `target`, then zeroes them (reads happen first).

  `sources` are (tower index, variable); a tower on a stand-in row adds 0.
  """
  kept = []
  for index, source in sources:
    rows = context.layout.has_rows[index]
    if rows is False:
      continue
    kept.append(sharding.zero_unless_rows(tf.convert_to_tensor(source),
                                          rows))
  variables = [source for _, source in sources]
  if not kept:
    return tf.group(*[_zeroed(v) for v in variables])
  added = tf.compat.v1.assign_add(target, tf.math.add_n(kept))
  with tf.control_dependencies([added]):
    return tf.group(*[_zeroed(v) for v in variables])


def _zeroed(variable):
  return tf.compat.v1.assign(
      variable, tf.zeros(variable.shape, variable.dtype.base_dtype))


def _metric_variables(value) -> List[tf.Variable]:
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

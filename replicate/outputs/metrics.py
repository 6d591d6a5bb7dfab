"""Eval metrics over the whole batch, from each tower's metric variables.

On the fold: every tower updates its own metric variables on its rows; then
what towers 1..N-1 accumulated is added into tower 0's variables and theirs
are zeroed. So tower 0's value op, read any number of times, reports the
metric over every row seen, with no side effect on read. This holds for
metrics whose variables are sums (every `tf.compat.v1.metrics` function,
and Keras metric states such as `total`, `count`, true positives).

On pairing: within each key, tower i's metric variables are paired with
tower 0's in the order they were created, with the same shapes and dtypes.
Not by name: a graph name depends on what else the graph holds (a
`Dataset.repeat()` makes an op named `count`, so a Keras metric's `count`
variable is `count_1` in tower 0 but `tower_1/count` in tower 1), while
every tower creates its metrics' variables in the same order. A tower
whose variables do not pair up is a `ValueError`, never a guess.

On shared variables: some keys share metric variables (binary canned heads'
`label/mean` and `accuracy_baseline` read the same total and count). Each
variable is folded once per batch, whatever keys read it: every key's update
op is the same op, which runs every tower's update of every key and then
each fold once. The Estimator runs the update ops together anyway.

On towers without rows (a stand-in row): their updates add 0.

On values over the batch: a metric fed one value per batch
(`metrics.mean(loss)`, `metrics.mean(tf.reduce_max(x))`) is fed the whole
batch's value in tower 0, whose update alone runs; one that cannot be
combined is refused with the fix (see `replicate.outputs.batch_inputs`).
"""

from typing import Dict, List

import tensorflow as tf

from replicate import graph_walk
from replicate.graph import op_types
from replicate.outputs import batch_inputs
from replicate.outputs import metric_rows
from replicate.shard import rows as rows_lib
from replicate.shard import sharding



def combine_metrics(tower_specs, layout, variables, *, tower_ops=None,
                    loss=None, combining=frozenset(),
                    whole=None) -> Dict[str, tuple]:
  """`eval_metric_ops` over the whole batch: tower 0's values, one update.

  `layout` is the call's `replicate.call.layout.TowerLayout`, `variables`
  its `replicate.variables.tower_variables.TowerVariables`, `tower_ops` the
  ops each tower built (None: values over the batch are not looked for),
  `loss` the combined spec's loss, `combining` tower 0's ops that only
  metrics read and that combine rows (an in-batch similarity, an op the
  rows rule does not know): a metric computed from one is computed on the
  whole batch's rows, even when what it adds up is per row; `whole()` the
  call's `replicate.outputs.whole_batch.WholeBatch`, which builds it.
  """
  keys = sorted(tower_specs[0].eval_metric_ops or {})
  if not keys:
    return {}
  variables_of = _MetricVariables(tf.compat.v1.get_default_graph())
  fed_once = _feed_batch_values(keys, tower_specs, layout, tower_ops, loss,
                                variables_of, combining, whole)
  paired = {}  # tower i variable ref -> (key, index, variable, tower 0's)
  for key in keys:
    tower0_variables = variables_of(tower_specs[0].eval_metric_ops[key][0])
    for index, spec in enumerate(tower_specs[1:], start=1):
      for target, source in _pairs(
          key, index, tower0_variables,
          variables_of(spec.eval_metric_ops[key][0]), variables):
        earlier = paired.setdefault(source.ref(), (key, index, source, target))
        if earlier[3] is not target:
          raise ValueError(
              "tower {}'s metric variable {!r} pairs with tower 0's {!r} in "
              "eval_metric_ops[{!r}] but with {!r} in eval_metric_ops[{!r}]: "
              "the towers create the variables these keys share in "
              "different orders. Create the metrics the same way in every "
              "tower (no branch on the tower).".format(
                  index, source.op.name, earlier[3].op.name, earlier[0],
                  target.op.name, key))
  sources = {}  # tower 0 variable ref -> [(tower index, variable)]
  for _, index, source, target in paired.values():
    sources.setdefault(target.ref(), []).append((index, source))
  updates = [spec.eval_metric_ops[key][1]
             for index, spec in enumerate(tower_specs)
             for key in keys if not (index and key in fed_once)]
  with tf.name_scope("metric_over_towers"):
    with tf.control_dependencies(updates):
      moved = [_move_into(target.deref(), towers, layout)
               for target, towers in sources.items()]
    update = tf.group(*moved, *updates)
  update = variables.then_fold(update, layout.has_rows)
  return {key: (tower_specs[0].eval_metric_ops[key][0], update)
          for key in keys}


def _feed_batch_values(keys, tower_specs, layout, tower_ops, loss,
                       variables_of, combining, whole):
  """The keys whose tower 0 update is fed values over the whole batch, and
  alone runs (see `replicate.outputs.batch_inputs`)."""
  if tower_ops is None:
    return set()
  towers = layout.towers
  rules = [rows_lib.TowerRows((t.features, t.labels), tower_ops[t.index])
           for t in towers]
  orders = [{op: i for i, op in enumerate(ops)} for ops in tower_ops]
  row_counts = [_static_rows((t.features, t.labels)) for t in towers]
  fed_once = set()
  for key in keys:
    pairs = [spec.eval_metric_ops[key] for spec in tower_specs]
    if all(update is pairs[0][1] for _, update in pairs):
      continue  # one update for every tower (a TPUEstimatorSpec's metric)
    found = [
        batch_inputs.find(key, update, variables_of(value), rules[i],
                          row_counts[i], tower_specs[i].loss, orders[i])
        for i, (value, update) in enumerate(pairs)]
    if any(value.kind == "rows" for value in found[0]) or (
        combining and not combining.isdisjoint(graph_walk.ops_behind(
            [pairs[0][1]], within=orders[0], follow_control=True))):
      metric_rows.feed_whole_batch(key, pairs[0][1], whole)
      fed_once.add(key)
    elif found[0]:
      batch_inputs.feed_once(key, found, layout.has_rows, loss)
      fed_once.add(key)
  return fed_once


def _static_rows(shard):
  """The rows of a shard, when its dense tensors say statically."""
  for value in tf.nest.flatten(shard):
    if isinstance(value, tf.Tensor) and value.shape.rank:
      rows = tf.compat.dimension_value(value.shape[0])
      if rows is not None:
        return rows
  return None


class _MetricVariables:
  """The local and metric variables a metric's value is computed from.

  In creation order: the order in which every tower made them.
  """

  def __init__(self, graph):
    candidates = {
        v.op: v for collection in (tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
                                   tf.compat.v1.GraphKeys.METRIC_VARIABLES)
        for v in graph.get_collection(collection)
    }
    # get_operations() lists ops as they were created.
    self._in_order = [(op, candidates[op]) for op in graph.get_operations()
                      if op in candidates]

  def __call__(self, value) -> List[tf.Variable]:
    behind = set(graph_walk.ops_behind(
        (t for t in tf.nest.flatten(value) if isinstance(t, tf.Tensor)),
        stop_at_types=op_types.VARIABLE_TYPES))
    return [variable for op, variable in self._in_order if op in behind]


def _pairs(key, index, tower0_variables, tower_variables, variables):
  """(tower 0's variable, tower `index`'s) to fold, for one key.

  A variable tower `index` reads from tower 0 itself (shared under reuse),
  or through a copy (folded with the tower-local variables), is not folded
  here; the rest pair in creation order.
  """
  reached = set()
  own = []
  tower0_refs = {v.ref() for v in tower0_variables}
  for variable in tower_variables:
    tower0 = variables.tower0_variable(variable)
    if tower0 is not variable or variable.ref() in tower0_refs:
      reached.add(tower0.ref())
    else:
      own.append(variable)
  targets = [v for v in tower0_variables if v.ref() not in reached]
  if len(own) != len(targets) or any(
      _kind(a) != _kind(b) for a, b in zip(own, targets)):
    raise ValueError(
        "eval_metric_ops[{!r}]: tower {}'s metric variables {} do not pair, "
        "in creation order, with tower 0's {}. Create "
        "the metric the same way in every tower: the same variables, in the "
        "same order, with the same shapes and dtypes (no branch on the "
        "tower).".format(key, index, [_described(v) for v in own],
                         [_described(v) for v in targets]))
  return zip(targets, own)


def _kind(variable):
  return variable.dtype.base_dtype.name, str(tf.TensorShape(variable.shape))


def _described(variable):
  return "{}: {} {}".format(variable.op.name, *_kind(variable))


def _move_into(target, sources, layout):
  """Adds `sources` into `target`, then zeroes them (reads happen first).

  `sources` are (tower index, variable); a tower on a stand-in row adds 0.
  """
  kept = []
  for index, source in sources:
    rows = layout.towers[index].has_rows
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

"""The one `train_op` of a step, from the towers' `train_op`s.

On the update: tower 0's optimizer calls built the one update of the step
(see `replicate.wrapping`); every tower's call returned it.

On other state changes: tower 0's `train_op` runs as the `model_fn` built it,
so what it changes once per step (a step counter grouped with the update,
an `ExponentialMovingAverage` made after it, an assignment of a constant or
of variables' values) changes once, after the update where the `model_fn`
made it wait. From towers 1..N-1 only the state changes that depend on the
tower's own rows run (`seen.assign_add(tf.size(labels))`: each tower counts
its rows, so the total is the batch's), and the writes to their
`tower_local_scope` copies. A change depends on the rows when its value is
computed from the tower's shard, or from its shape: with a batch of known
size TensorFlow folds `tf.size(x)` and `tf.shape(x)` to constants, which
this module recognises by the names TensorFlow gives them (`Size`, `Shape`);
a count taken from the static `x.shape` is a plain constant, and counts once.

On statistics: the variables the towers' `UPDATE_OPS` write (batch-norm
moving mean and variance), and the moving averages of their rows that the
train_op makes itself (a Keras `BatchNormalization`'s `updates` grouped with
it, as the TF 2 canned DNN does; TensorFlow names these `AssignMovingAvg`),
are written once per step, by tower 0's op, with the towers' values
combined by their share of the batch `n_i / n`; the other towers' writes
are made to change nothing. An `assign` of
`(1 - f) m + f x_i`, or an `assign_sub` of `f (m - x_i)`, becomes the same
with `x` the share-weighted mean of the `x_i`: the moving mean moves as it
would with the whole batch's mean.

On towers without rows (a stand-in row): their `UPDATE_OPS` values weigh 0,
and their other kept writes (`assign_add`, `assign_sub`, `assign`) are made
to change nothing.
"""

import re
from typing import List

import tensorflow as tf

from replicate import graphs
from replicate import sharding

# Variable writes: op type -> "add", "sub" or "set" (value input 1).
_WRITE_KINDS = {
    "Assign": "set", "AssignVariableOp": "set",
    "AssignAdd": "add", "AssignAddVariableOp": "add",
    "AssignSub": "sub", "AssignSubVariableOp": "sub",
}
# Other ops whose running is the point, beyond variable writes.
_EFFECT_TYPES = frozenset([
    "Assert", "Print", "PrintV2", "PyFunc", "EagerPyFunc", "CountUpTo",
    "ResourceCountUpTo"
])
_EFFECT_PREFIXES = ("Assign", "Scatter", "ResourceScatter")
# Ops a variable's handle or ref passes through on its way to a write.
_PASSING_TYPES = frozenset(["Enter", "RefEnter", "Identity", "RefIdentity",
                            "Switch", "RefSwitch"])
# What TensorFlow names a constant it folded from a tensor's shape known
# when the graph is built (`tf.size`, `tf.shape`, `tf.ones_like`,
# `tf.zeros_like`).
_FOLDED_SHAPE = re.compile(r"(Size|Shape|ones_like|zeros_like)(_[0-9]+)?")
# The name scope TensorFlow builds moving averages in (batch norm in Keras
# and tf.compat.v1.layers, moving_averages.assign_moving_average).
_MOVING_AVERAGE = re.compile(r"AssignMovingAvg(_[0-9]+)?")


def combine_train_op(tower_specs, context) -> tf.Operation:
  """Tower 0's train_op, the towers' own-row changes, then the fold."""
  _check_optimizer_calls(context)
  towers = [_Tower(index, spec.train_op, context)
            for index, spec in enumerate(tower_specs)]
  statistics = [tower.statistic_writes() for tower in towers]
  _combine_statistics(statistics, context)
  kept = []
  for tower, writes in zip(towers[1:], statistics[1:]):
    if tower.train_op is None or context.layout.has_rows[tower.index] is False:
      continue
    for op in tower.own_row_effects(exclude=set(writes)):
      _change_nothing_unless_rows(op, context.layout.has_rows[tower.index])
      kept.append(op)
  train_op = tf.group(tower_specs[0].train_op, *kept,
                      name="train_op_over_towers")
  return context.variables.then_fold(train_op, context.layout.has_rows)


def _combine_statistics(writes, context) -> None:
  """Makes tower 0's statistic writes write the towers' weighted values.

  `writes[i]` are tower i's writes of statistics, in build order.
  """
  for op in writes[0]:
    _check_rewritable(op)
  for index, tower_writes in enumerate(writes[1:], start=1):
    if [_written(op) for op in tower_writes] != [
        _written(op) for op in writes[0]]:
      raise ValueError(
          "Tower {}'s UPDATE_OPS and moving averages write {} and tower 0's "
          "write {}: each tower's model_fn must make the same updates (batch "
          "norm, moving averages), whatever its data.".format(
              index, [_written(op).name for op in tower_writes],
              [_written(op).name for op in writes[0]]))
  with tf.name_scope("update_ops_over_towers"):
    for position, tower0_write in enumerate(writes[0]):
      terms = []
      for index, tower_writes in enumerate(writes):
        rows = context.layout.has_rows[index]
        if rows is False:
          continue
        value = tower_writes[position].inputs[1]
        if not value.dtype.is_floating:  # a count: weighed in float
          value = tf.cast(value, tf.float64)
        share = tf.cast(context.layout.shares[index], value.dtype)
        terms.append(sharding.zero_unless_rows(value * share, rows))
      combined = _as_dtype_of(tf.math.add_n(terms), tower0_write.inputs[1])
      for tower_writes in writes[1:]:
        _change_nothing(tower_writes[position], after=tower0_write)
      tower0_write._update_input(1, combined)  # pylint: disable=protected-access


def _as_dtype_of(value, like):
  """`value` in `like`'s dtype, rounded to the nearest for an integer."""
  if like.dtype.is_floating:
    return value
  return tf.cast(tf.math.round(value), like.dtype)


def _check_optimizer_calls(context):
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


class _Tower:
  """What one tower built: its ops, in build order, and its rows."""

  def __init__(self, index, train_op, context):
    self.index = index
    self.train_op = train_op
    self._context = context
    self._order = {op: position for position, op in enumerate(
        context.tower_ops[index])}
    self._shard = _shard_tensors(context.layout.shards, index)
    self._statistics = context.variables.statistic_ops()

  def statistic_writes(self) -> List[tf.Operation]:
    """Writes of statistics of the rows, combined over towers, in order.

    Those behind the tower's `UPDATE_OPS`, and the moving averages of its
    rows its train_op makes (a Keras `BatchNormalization`'s updates grouped
    with the train_op, as the TF 2 canned DNN does).
    """
    found = set()
    for update in self._context.collections.update_ops(self.index):
      found.update(op for op in graphs.ops_behind(
          [update], within=self._order, follow_control=True)
                   if self._is_statistic_write(op))
    found.update(op for op in self._train_op_closure()
                 if self._is_statistic_write(op) and _is_moving_average(op)
                 and self._reads_rows(op))
    return sorted(found, key=self._order.get)

  def _is_statistic_write(self, op) -> bool:
    """A write of a global, non-trainable variable that is not tower-local."""
    return (op.type in _WRITE_KINDS and
            _written(op) in self._statistics)

  def own_row_effects(self, exclude) -> List[tf.Operation]:
    """The tower's state changes that depend on its own rows."""
    own_copies = self._context.variables.copy_ops(self.index)
    effects = []
    for op in self._train_op_closure():
      if not _is_effect(op) or op in exclude:
        continue
      writes_own_copy = bool(op.inputs) and op.inputs[0].op in own_copies
      if writes_own_copy or self._reads_rows(op):
        effects.append(op)
    return sorted(effects, key=self._order.get)

  def _train_op_closure(self):
    if self.train_op is None:
      return []
    return graphs.ops_behind([self.train_op], within=self._order,
                             follow_control=True)

  def _reads_rows(self, op) -> bool:
    """Whether `op`'s inputs are computed from the tower's rows."""
    pending = list(op.inputs)
    seen = set()
    while pending:
      tensor = pending.pop()
      if tensor.ref() in self._shard:
        return True
      if tensor.ref() in seen or tensor.op not in self._order:
        continue
      seen.add(tensor.ref())
      if tensor.op.type == "Const" and _FOLDED_SHAPE.fullmatch(
          tensor.op.name.split("/")[-1]):
        return True
      pending.extend(tensor.op.inputs)
    return False


def _shard_tensors(shards, index):
  leaves = tf.nest.flatten([shards.features[index], shards.labels[index]],
                           expand_composites=True)
  return {t.ref() for t in leaves if isinstance(t, tf.Tensor)}


def _is_effect(op) -> bool:
  return op.type in _EFFECT_TYPES or op.type.startswith(_EFFECT_PREFIXES)


def _is_moving_average(op) -> bool:
  return any(_MOVING_AVERAGE.fullmatch(part) for part in op.name.split("/"))


def _written(write_op):
  """The op of the variable a write op writes (through control flow's)."""
  op = write_op.inputs[0].op
  while op.type in _PASSING_TYPES and op.inputs:
    op = op.inputs[0].op
  return op



def _check_rewritable(op):
  if op._control_flow_context is not None or op.graph.building_function:  # pylint: disable=protected-access
    raise ValueError(
        "The UPDATE_OPS write {!r} is built inside control flow (a tf.cond, "
        "a while loop or a tf.function), where replicate_model_fn cannot "
        "combine the towers' updates. Build the update outside control "
        "flow.".format(op.name))


def _change_nothing(op, after):
  """Makes a write leave its variable as it is, once `after` has run."""
  _check_rewritable(op)
  if _WRITE_KINDS[op.type] == "set":
    with tf.control_dependencies([after]):
      value = _read(op)
  else:
    value = tf.zeros_like(op.inputs[1])
  op._update_input(1, value)  # pylint: disable=protected-access
  op._add_control_input(after)  # pylint: disable=protected-access


def _change_nothing_unless_rows(op, has_rows):
  """Where the tower may have no rows, its write changes nothing then."""
  if isinstance(has_rows, bool) or op.type not in _WRITE_KINDS:
    return
  _check_rewritable(op)
  value = op.inputs[1]
  if _WRITE_KINDS[op.type] == "set":
    unchanged = _read(op)
  else:
    unchanged = tf.zeros_like(value)
  op._update_input(1, tf.where(has_rows, value, unchanged))  # pylint: disable=protected-access


def _read(write_op):
  """The current value of the variable `write_op` writes."""
  target = write_op.inputs[0]
  if target.dtype == tf.resource:
    return tf.raw_ops.ReadVariableOp(resource=target,
                                     dtype=write_op.get_attr("dtype"))
  return tf.identity(target)

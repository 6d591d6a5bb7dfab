"""Tower 0's values over the batch built again on the whole batch's rows.

On what: a value tower 0 computed that has no axis of rows but depends on
them (the loss, a term of it, a reduction over the rows, a count, a ratio
of them, a `py_func` of the rows) is its shard's. `WholeBatch.of` builds
the whole batch's, once, for a reader that is not on the loss's path (a
summary, a logging hook, see `replicate.outputs.summaries`):
- the spec's loss: the combined spec's loss (`replicate.outputs.specs`);
- otherwise the ops from the value back to the tower's per-row tensors are
  built again: each per-row tensor (rows along a known axis,
  `replicate.graph.row_layout`; the shard's tensors) is read as the
  towers' concatenated along it in tower order (input order), each count
  of rows (`tf.shape(x)[0]`) as the towers' sum, the rest (variables,
  constants, the global step, values replicate made the batch's already)
  as it is; an op the analysis places no rows through is built again too.
  A mean over the rows is then the mean over every row, a ratio of sums
  the batch's ratio, a `py_func` of the rows is called on every row;
- a metric's update in TRAIN (`tf.compat.v1.metrics.*` whose `acc[1]` a
  summary shows, as tf_ner does): tower 0's metric variable writes that the
  value waits for are fed the whole batch's increments (each built again as
  above), so its update and value ops report the metric over every row
  seen, as one device's. In EVAL the metrics are `replicate.outputs.
  metrics`'s, which fold the towers' variables after every update.
A tower on a stand-in row (no rows of its own) adds no rows and counts 0.

A TF 1 cond (`tf.nn.zero_fraction` of the canned DNNs, under TF 1
behaviour) is built again with its Switch and Merge; a constant TensorFlow
folded from a static shape of the rows (`tf.size(x)`) is the towers' sum.

What it cannot build again, and leaves tower 0's: a value reached through
a TF 1 loop (`Enter` ... `Exit`), a stateful op other than a `py_func` (a
stateful function call: it may write state, which must not change twice),
a backward pass the user built with `tf.gradients` (`TowerOptimizer`'s
gradients are the batch's already), a
shape made for the tower's rows when built (`tf.reshape(x, [4, -1])` from
`x.shape`, refused by shape inference; a Python count `x.shape[0]` in
arithmetic is a constant, and stays the tower's), a value that needs more
than `_MOST_COPIES` ops built again, a tensor whose tower i counterpart it
cannot find, a metric update the `train_op` also runs (each tower updates
its own variables there). In a synchronous cluster of several tasks, the
concatenations and sums cover the task's towers (the loss is every task's).
"""

import re

import tensorflow as tf

from replicate import _tf
from replicate import graph_walk
from replicate.graph import op_types
from replicate.graph import row_layout
from replicate.graph.row_facts import ROWS, ROWS_K, SELECTED_COUNT, UNKNOWN
from replicate.outputs import counterparts
from replicate.shard import rows as rows_lib

_WRITES = op_types.VARIABLE_WRITE_TYPES
# State: a metric's writes are fed below; reads are what is there.
_STATE = _WRITES | op_types.VARIABLE_TYPES | {"ReadVariableOp"}
# A count of rows (or of entries of rows) sums over towers.
_COUNTS = ((ROWS,), (ROWS_K,), (SELECTED_COUNT,))
# Stateful ops that are still a function of their inputs.
_CALLED_AGAIN = op_types.PY_FUNC_TYPES
# At most this many ops are built again for one value: more means the rows
# were lost early, and the summary step would run the forward pass again,
# on the whole batch, on one device. It is left tower 0's instead.
_MOST_COPIES = 200
_UNIQUIFIED = re.compile(r"_[0-9]+$")
# A TF 1 cond's Switch and Merge are built again (`tf.nn.zero_fraction`'s
# cond of the size, under TF 1 behaviour), a TF 1 loop is not: its frame.
_NO_COPY = op_types.TF1_LOOP_TYPES | {"Placeholder",
                                      "PlaceholderWithDefault"}
_LOOPS = frozenset(["While", "StatelessWhile"])


class _Unknown(Exception):
  """A value whose whole batch's cannot be built: it stays tower 0's."""


class WholeBatch:
  """Builds, once each, the whole batch's value of tower 0's tensors."""

  def __init__(self, mode, tower_specs, layout, progress, combined_loss,
               is_backward):
    ops = [op for op in progress.tower_ops[0]
           if op not in progress.own_ops and op not in progress.update_built]
    backward = [op for op in ops if is_backward(op)]
    # A TF 2 loop's gradient feeds its accumulators into the forward `While`
    # (which then also returns each step's values): the walk stops there,
    # or every value after a `dynamic_rnn` would count as backward.
    after = graph_walk.ops_after(backward, stop=lambda op: (
        op.type in _LOOPS and not is_backward(op))) if backward else set()
    self.forward = frozenset(op for op in ops if op not in after)
    self._layout = layout
    self._progress = progress
    tower0 = layout.towers[0]
    shard = (tower0.features, tower0.labels)
    self._rows = rows_lib.TowerRows(shard, self.forward)
    self._facts = row_layout.RowLayout(shard, self.forward, self._rows.depend,
                                       self._rows.static_count())
    spec = tower_specs[0]
    self._loss = (tf.convert_to_tensor(spec.loss)
                  if spec.loss is not None else None)
    self._combined_loss = combined_loss
    self._metric_writes = mode == tf.estimator.ModeKeys.TRAIN
    self._specs = tower_specs
    self._step = None  # what the step runs, when first asked
    graph = layout.graph
    self._metric_variables = {v.op for key in (
        tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
        tf.compat.v1.GraphKeys.METRIC_VARIABLES)
                              for v in graph.get_collection(key)}
    self._towers_of = counterparts.Counterparts(layout, progress)
    self._values = {}  # tower 0's tensor ref -> the whole batch's
    self._copies = {}  # tower 0's op -> its copy on the whole batch
    self._walked = set()  # ops whose metric writes behind are fed
    self._budget = _MOST_COPIES  # ops `of` may still build, for one value

  def of(self, tensor: tf.Tensor) -> tf.Tensor:
    """The whole batch's value of tower 0's `tensor`, or `tensor` itself
    (a per-row tensor, one not from the rows, one it cannot build)."""
    if tensor.op not in self.forward:
      return tensor
    self._budget = _MOST_COPIES
    try:
      with self._progress.building_own_ops(), \
          tf.name_scope("summary_over_towers"):
        self._feed_metric_writes(tensor)
        fact = self._facts.fact(tensor)
        if tensor is not self._loss and (fact.carries or (
            fact.kind == UNKNOWN and tensor.shape.rank != 0)):
          return tensor  # rows (or possibly): tower 0's
        return self._whole(tensor)
    except _Unknown:
      return tensor

  def _feed_metric_writes(self, tensor):
    """Tower 0's metric variable writes `tensor` waits for, outside the
    step, add the whole batch's increments (TRAIN)."""
    if not self._metric_writes:
      return
    pending = [tensor.op]
    while pending:
      op = pending.pop()
      if op in self._walked or op not in self.forward:
        continue  # walked for an earlier value: its writes are fed
      self._walked.add(op)
      pending.extend(t.op for t in op.inputs)
      pending.extend(op.control_inputs)
      if (op.type not in _WRITES or
          _variable_op(op.inputs[0]) not in self._metric_variables or
          self._in_step(op)):
        continue
      try:
        value = self._whole(op.inputs[1])
      except _Unknown:
        continue
      if value is not op.inputs[1]:
        _tf.update_input(op, 1, value)

  def _whole(self, tensor: tf.Tensor) -> tf.Tensor:
    key = tensor.ref()
    if key not in self._values:
      self._values[key] = self._build(tensor)
    return self._values[key]

  def _build(self, tensor):
    op = tensor.op
    if self._loss is not None and tensor is self._loss:
      return tf.cast(self._combined_loss, tensor.dtype)
    if self._towers_of.is_leaf(tensor):
      return self._concatenated(tensor, 0)  # the shard's: the batch's
    if op not in self.forward or not self._rows.depend([tensor]):
      return tensor  # the same in every tower
    if op.type in _STATE:
      return tensor
    fact = self._facts.fact(tensor)
    if fact.carries:
      return self._concatenated(tensor, fact.axis)
    if op.type == "Const":
      return self._folded(tensor, fact)
    if tensor.shape.rank == 0 and fact.dims in _COUNTS:
      return self._summed(tensor)
    # No rows (or along no axis the analysis knows): built again on its
    # inputs' whole batch's values, back to the rows.
    return self._copy(op).outputs[tensor.value_index]

  def _folded(self, tensor, fact) -> tf.Tensor:
    """A constant TensorFlow folded from a static shape of the rows'
    (`tf.size(x)`, `tf.shape(x)`, `tf.ones_like(x)`): the whole batch's."""
    kind = _UNIQUIFIED.sub("", tensor.op.name.rpartition("/")[2])
    if kind == "Size":
      return self._summed(tensor)
    if kind == "Shape" and fact.dims and tensor.shape.rank == 1:
      entries = tf.unstack(tensor)
      for position, counts in enumerate(fact.dims):
        if counts == ROWS:
          entries[position] = self._summed(tensor, position)
      return tf.stack(entries)
    if kind in ("ones_like", "zeros_like") and tensor.shape.rank:
      return self._concatenated(tensor, 0)
    raise _Unknown()

  def _summed(self, tensor, position=None) -> tf.Tensor:
    """The towers' counts (entry `position` of them) summed."""
    try:
      return self._towers_of.summed(tensor, position)
    except counterparts.NotFound:
      raise _Unknown()

  def _concatenated(self, tensor, axis) -> tf.Tensor:
    try:
      return self._towers_of.concatenated(tensor, axis)
    except counterparts.NotFound:
      raise _Unknown()

  def _copy(self, op) -> tf.Operation:
    """`op` again, on its inputs' whole batch's values."""
    if op in self._copies:
      return self._copies[op]
    if op.type in _NO_COPY or (_tf.is_stateful(op) and
                               op.type not in _CALLED_AGAIN):
      raise _Unknown()
    inputs = [self._whole(t) for t in op.inputs]
    # A TF 1 cond's branch ops wait on its pivot: the copy's pivot.
    controls = [self._copy(c) if c in self.forward and self._rows.depend([c])
                else c for c in op.control_inputs]
    given = list(op.inputs) + list(op.control_inputs)
    if all(new is old for new, old in zip(inputs + controls, given)):
      copy = op
    else:
      self._budget -= 1
      if self._budget < 0:
        raise _Unknown()
      attrs = {name: value for name, value in op.node_def.attr.items()
               if name != "_class"}  # not colocated with tower 0's ops
      try:
        with tf.control_dependencies(controls):
          copy = self._layout.graph.create_op(
              op.type, inputs, [t.dtype for t in op.outputs],
              name=op.name.split("/")[-1], attrs=attrs)
      except (ValueError, TypeError, KeyError, tf.errors.OpError):
        # A shape made for the tower's rows, known when built
        # (`tf.reshape(x, [4, -1])` from `x.shape`): not the batch's.
        raise _Unknown()
    self._copies[op] = copy
    return copy

  def _in_step(self, op) -> bool:
    """Whether the step (the towers' train_ops and losses) runs `op`."""
    if self._step is None:
      self._step = set(graph_walk.ops_behind(
          [s.train_op for s in self._specs if s.train_op is not None] +
          [s.loss for s in self._specs if s.loss is not None],
          follow_control=True))
    return op in self._step


def _variable_op(tensor):
  op = tensor.op
  while op.type in ("Identity", "ReadVariableOp") and op.inputs:
    op = op.inputs[0].op
  return op

"""Tower 0's values built again on the whole batch's rows.

On what: a value tower 0 computed from its shard is its shard's. Where the
whole batch's is wanted off the loss's path, `WholeBatch` builds it, once:
- a value over the batch (no axis of rows: the loss, a term of it, a
  reduction, a count, a `py_func` of the rows) that a summary or a logging
  hook shows (`of`, lenient: `replicate.outputs.summaries`); in TRAIN,
  tower 0's metric variable writes such a value waits for (tf_ner's
  summary of `acc[1]`) add the whole batch's increments;
- a metric's update in EVAL fed a value no combination of the towers'
  gives, and a prediction or export output computed after ops where rows
  meet, off the loss's path (`rebuilt`, strict:
  `replicate.outputs.metric_rows`, `replicate.outputs.predictions`).

On how: the spec's loss is the combined spec's loss. Otherwise the ops
from the value back to the tower's per-row tensors are built again
(`replicate.outputs.op_copies`): each per-row tensor (rows along an axis
the row analysis follows, `replicate.graph.row_layout`: through a fused
LSTM, a TF 2 loop or cond, tf_ner's CRF; that counts no rows in its values
or other axes, `replicate.outputs.row_counts`; the shard's tensors; the
spec's predictions) is read as the towers' concatenated along it in input
order, each count of rows (`tf.shape(x)[0]`) as the towers' sum, a folded
shape as `replicate.outputs.folded_shapes` reads it, the rest (variables,
constants, values replicate made the batch's already) as it is. Past an op
where rows meet (`mixed`, the rows rule's: `replicate.shard.rows_meet`)
nothing is concatenated: it is built again on the whole batch's rows. A
mean over the rows is then the mean over every row, a `py_func` is called
on every row, an in-batch similarity is over every pair of rows. A tower
on a stand-in row adds no rows and counts 0. A TF 1 cond is built again
with its Switch and Merge; a TF 2 loop's TensorList from its tensor's.

What it cannot build again (`CannotBuild` says which, `op_copies` lists
them: a dropout's draw, met where the analysis lost the rows before it, as
in tf_ner's chars_lstm_lstm_crf, which reshapes `[rows * words, d]` back
to `[rows, words, d]` by a `words` known only when run; `of` then leaves
the value tower 0's), and also: a folded shape the towers cannot tell
(every tower holds one row), a tensor whose tower i counterpart it cannot
find, for `of` a value that needs more than `_MOST_COPIES` ops built
again, a metric update the `train_op` also runs (each tower updates its
own variables there). In a synchronous cluster of several tasks, the
concatenations and sums cover the task's towers (the loss is every task's).
"""

import contextlib

import tensorflow as tf

from replicate import _tf
from replicate import graph_walk
from replicate.graph import loop_layout
from replicate.graph import op_types
from replicate.graph import row_layout
from replicate.graph.row_facts import ROWS, ROWS_K, SELECTED_COUNT, UNKNOWN
from replicate.outputs import counterparts
from replicate.outputs import folded_shapes
from replicate.outputs import op_copies
from replicate.outputs import row_counts
from replicate.shard import rows as rows_lib

_WRITES = op_types.VARIABLE_WRITE_TYPES
# State: a metric's writes are fed below; reads are what is there.
_STATE = _WRITES | op_types.VARIABLE_TYPES | {"ReadVariableOp"}
# A count of rows (or of entries of rows) sums over towers.
_COUNTS = ((ROWS,), (ROWS_K,), (SELECTED_COUNT,))
# At most this many ops are built again for one value a summary shows: more
# means the rows were lost early, and the summary step would run the
# forward pass again, on the whole batch, on one device. It is left tower
# 0's instead. (A metric or a prediction asked for has no limit.)
_MOST_COPIES = 200

CannotBuild = op_copies.CannotBuild


class WholeBatch:
  """Builds, once each, the whole batch's value of tower 0's tensors.

  `mixed`: tower 0's ops where rows meet off the loss's path (the rows
  rule's): what is computed from them is built again, not concatenated.
  """

  def __init__(self, mode, tower_specs, layout, progress, combined_loss,
               is_backward, mixed=frozenset()):
    ops = [op for op in progress.tower_ops[0]
           if op not in progress.own_ops and op not in progress.update_built]
    backward = [op for op in ops if is_backward(op)]
    # A TF 2 loop's gradient feeds its accumulators into the forward `While`
    # (which then also returns each step's values): the walk stops there,
    # or every value after a `dynamic_rnn` would count as backward.
    after = graph_walk.ops_after(backward, stop=lambda op: (
        op.type in loop_layout.LOOPS and not is_backward(op))) if backward else set()
    self.forward = frozenset(op for op in ops if op not in after)
    self._mixed = (graph_walk.ops_after(mixed) & self.forward
                   if mixed else frozenset())
    self._layout = layout
    self._progress = progress
    tower0 = layout.towers[0]
    shard = (tower0.features, tower0.labels)
    # On a batch of unknown size no shape of the rows is folded to a
    # constant (a folded `tf.size` of a scalar is no count of rows).
    self._rows = rows_lib.TowerRows(
        shard, self.forward,
        count_folded=isinstance(layout.shards.sizes, list))
    self._static_rows = self._rows.static_count()
    self._facts = row_layout.RowLayout(shard, self.forward, self._rows.depend,
                                       self._static_rows)
    self._counts = row_counts.RowCounts(self.forward, self._rows.depend,
                                        self._facts.fact)
    spec = tower_specs[0]
    self._loss = (tf.convert_to_tensor(spec.loss)
                  if spec.loss is not None else None)
    # The spec's predictions have one row per input row (put back together
    # so), whatever the analysis can tell of them (after a TF 1 loop).
    self._batch_major = {
        t.ref() for t in tf.nest.flatten(spec.predictions)
        if isinstance(t, tf.Tensor) and t.shape.rank != 0 and
        t.op not in self._mixed}
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
    self._walked = set()  # ops whose metric writes behind are fed
    self._copies = op_copies.OpCopies(layout.graph, self._given_once,
                                      self._copied_control)

  def of(self, tensor: tf.Tensor) -> tf.Tensor:
    """The whole batch's value of tower 0's `tensor` over the batch, or
    `tensor` itself (a per-row tensor, one not from the rows, one it cannot
    build), for a summary or a logging hook."""
    if tensor.op not in self.forward:
      return tensor
    self._copies.budget = _MOST_COPIES
    try:
      with self._building("summary_over_towers"):
        self._feed_metric_writes(tensor)
        fact = self._facts.fact(tensor)
        if tensor is not self._loss and (fact.carries or (
            fact.kind == UNKNOWN and tensor.shape.rank != 0)):
          return tensor  # rows (or possibly): tower 0's
        return self._whole(tensor)
    except CannotBuild:
      return tensor
    finally:
      self._copies.budget = None

  def needed(self, tensor: tf.Tensor) -> bool:
    """Whether `tensor` is computed after an op where rows meet (`mixed`),
    so that the towers' values put together are not the whole batch's."""
    return tensor.op in self._mixed

  def rebuilt(self, tensor: tf.Tensor) -> tf.Tensor:
    """The whole batch's value of tower 0's `tensor` (per row or over the
    batch), built again on the whole batch's rows. Raises `CannotBuild`."""
    with self._building("outputs_over_towers"):
      return self._whole(tensor)

  @contextlib.contextmanager
  def _building(self, scope):
    """Ops built in it are replicate's own, under a name scope."""
    with self._progress.building_own_ops(), tf.name_scope(scope):
      yield

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
          variable_op(op.inputs[0]) not in self._metric_variables or
          self._in_step(op)):
        continue
      try:
        value = self._whole(op.inputs[1])
      except CannotBuild:
        continue
      if value is not op.inputs[1]:
        _tf.update_input(op, 1, value)

  def _whole(self, tensor: tf.Tensor) -> tf.Tensor:
    value = self._given_once(tensor)
    if value is None:
      value = self._copies.copy(tensor.op).outputs[tensor.value_index]
    return value

  def _given_once(self, tensor):
    """`_given`, remembered."""
    value = self._values.get(tensor.ref())
    if value is None:
      value = self._given(tensor)
      if value is not None:
        self._values[tensor.ref()] = value
    return value

  def _copied_control(self, op) -> bool:
    """A TF 1 cond's branch ops wait on its pivot: the copy's pivot. Other
    control inputs (a weights' shape assertion) stay tower 0's."""
    return (op in self.forward and _tf.built_in_control_flow(op) and
            self._rows.depend([op]))

  def _given(self, tensor):
    """The whole batch's value of `tensor` without building its op again,
    or None if its op must be."""
    op = tensor.op
    if self._loss is not None and tensor is self._loss:
      return tf.cast(self._combined_loss, tensor.dtype)
    if self._towers_of.is_leaf(tensor):
      return self._concatenated(tensor, 0)  # the shard's: the batch's
    if op not in self.forward or not self._rows.depend([tensor]):
      return tensor  # the same in every tower
    if op.type in _STATE:
      return tensor
    if tensor.ref() in self._batch_major:
      return self._concatenated(tensor, 0)
    if op in self._mixed:
      return None  # past rows that met: built again
    fact = self._facts.fact(tensor)
    if self._concatenable(tensor, fact):
      return self._concatenated(tensor, fact.axis)
    if op.type == "Const":
      try:
        return folded_shapes.whole(tensor, self._towers_of, self._layout)
      except folded_shapes.NotTold:
        raise CannotBuild(_FOLDED.format(tensor.name))
    if tensor.shape.rank == 0 and fact.dims in _COUNTS:
      return self._summed(tensor)
    return None  # no rows (or along no axis known): built again

  def _concatenable(self, tensor, fact) -> bool:
    """Whether the towers' `tensor`s put together along its rows' axis are
    the whole batch's: it has rows along one axis, its values count no
    rows (`tf.range(n)` holds positions in the tower's shard), and no other
    axis counts them (`tf.one_hot(rows, n)` has two). Not inside a TF 1
    cond either: the towers may take different branches."""
    # A TensorList (a TF 2 loop's) is a variant scalar whose elements have
    # the rows: built again, from its tensor's whole batch's.
    if (not fact.carries or fact.ids is not None or
        tensor.dtype == tf.variant or _tf.built_in_control_flow(tensor.op)):
      return False  # positions among the tower's rows are not the batch's
    if self._counts.values(tensor.op):
      return False
    if tensor.shape.rank is not None and all(
        size is not None and size != self._static_rows
        for axis, size in enumerate(tensor.shape.as_list())
        if axis != fact.axis):
      return True
    return not self._counts.shapes(tensor.op)

  def _summed(self, tensor) -> tf.Tensor:
    """The towers' counts summed."""
    try:
      return self._towers_of.summed(tensor)
    except counterparts.NotFound:
      raise CannotBuild(_NOT_FOUND.format(tensor.name))

  def _concatenated(self, tensor, axis) -> tf.Tensor:
    try:
      return self._towers_of.concatenated(tensor, axis)
    except counterparts.NotFound:
      raise CannotBuild(_NOT_FOUND.format(tensor.name))

  def _in_step(self, op) -> bool:
    """Whether the step (the towers' train_ops and losses) runs `op`."""
    if self._step is None:
      self._step = set(graph_walk.ops_behind(
          [s.train_op for s in self._specs if s.train_op is not None] +
          [s.loss for s in self._specs if s.loss is not None],
          follow_control=True))
    return op in self._step


def variable_op(tensor):
  """The variable a read or a handle of it (`tensor`) comes from."""
  op = tensor.op
  while op.type in ("Identity", "ReadVariableOp") and op.inputs:
    op = op.inputs[0].op
  return op


_FOLDED = (
    "it reads {!r}, a shape of the tower's shard TensorFlow folded to a "
    "constant on a batch of known size (tf.size(x), tf.shape(x), "
    "tf.ones_like(x)), of which replicate cannot tell the whole batch's "
    "(every tower holds one row, or it is no shape or size)")
_NOT_FOUND = ("tower 0's {!r} has no counterpart in every tower (build the "
              "model_fn the same way in every tower: no branch on the "
              "tower)")

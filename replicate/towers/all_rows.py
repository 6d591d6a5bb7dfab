"""`replicate.all_rows` and `replicate.row_offset`: rows that meet.

On why: a value that combines different rows of the batch (in-batch
negatives `tf.matmul(a, b, transpose_b=True)`) is, in a tower, combined over
the tower's shard only; `replicate.shard.rows_meet` refuses such ops. The fix
is to give each tower the whole batch's rows of the tensor it combines with:
`all_rows(b)` is `b` of every tower, concatenated in input order, and
`row_offset()` the index in the batch of the tower's first row.

On the forward pass (two phases, as `replicate.batch_norm.batch_norm_sites`):
the k-th `all_rows` call of tower i < N-1 reads a stand-in (see
`replicate.gradients.stand_ins`); the last tower's k-th call has every
tower's tensor, concatenates their real rows (a tower on a stand-in row
gives none) and connects the stand-ins to it. Calls are matched by their
position in the tower, and checked by dtype and inner shape.

On the backward pass: the value is a `tf.custom_gradient` whose gradient
with respect to tower i's own tensor is a stand-in for the sum over towers
k of the rows of tower k's upstream gradient that are tower i's, i.e.
`S[o_i:o_i + n_i]` with `S = sum_k dL_k/d all_rows`; the last tower's
gradient function makes `S` and connects every other tower's stand-in.
Since `TowerOptimizer` weights each tower's loss before it differentiates,
S is the gradient of the whole batch's loss; a gradient made outside it
(`tf.gradients` on the unweighted loss) is refused with the fix.

On synchronous clusters: refused with the fix, for now. Gathering rows
across tasks needs a collective whose shape changes with every step's rows
(padded to the most rows of any task); tried, TensorFlow aborted the
second step with "Shape mismatch in the collective instance" (an instance
key keeps the shape it first ran with), so it needs a fresh instance key
per step, or a fixed-size protocol, which `CrossTask` does not have yet.
"""

from typing import Any, List

import tensorflow as tf

from replicate.gradients import stand_ins
from replicate.shard import sharding
from replicate.call import current
from replicate import _tf


def all_rows(tensor: Any) -> tf.Tensor:
  """The whole batch's rows of `tensor` (the tower's rows in dimension 0).

  In input order, on the tower's device; the gradient with respect to the
  result flows back to each tower's own rows, summed over the towers that
  used them. Outside `replicate_model_fn` or with one tower: `tensor`.
  """
  context = _context("all_rows")
  tensor = tf.convert_to_tensor(tensor)
  if context is None:
    return tensor
  if tensor.shape.rank == 0:
    raise ValueError(
        "replicate.all_rows({!r}) needs a tensor with the tower's rows in "
        "dimension 0; this one is a scalar. Fix: pass a tensor of shape "
        "[rows, ...].".format(tensor.name))
  return context.all_rows.gather(context, tensor)


def row_offset() -> tf.Tensor:
  """The int32 index in the whole batch of the tower's first row.

  0 outside `replicate_model_fn` or with one tower. A tower built on a
  stand-in row (no rows of its own) gets 0, the stand-in's row.
  """
  context = _context("row_offset")
  if context is None:
    return tf.constant(0, tf.int32)
  index = context.progress.tower_index
  return tf.identity(tf.cast(
      _offsets(context.layout.shards.sizes)[index], tf.int32),
                     name="row_offset")


def _context(what):
  """The context of a multi-tower build, None outside one, or refused."""
  graph = tf.compat.v1.get_default_graph()
  if getattr(graph, "outer_graph", None) is not None:
    if any(current.current_context(outer) is not None
           for outer in _tf.enclosing_graphs(graph)):
      raise ValueError(
          "replicate.{}() is called inside a tf.function, a TF 2 tf.cond or "
          "tf.while_loop of a tower. Its value joins every tower's, which a "
          "function graph cannot. Fix: call it in the model_fn itself and "
          "pass the result in.".format(what))
    return None
  context = current.current_context(graph)
  if context is None:
    return None
  if context.progress.tower_index is None or not context.layout.combines:
    return None
  if context.layout.cross_task is not None:
    raise ValueError(
        "replicate.{}() in a synchronous cluster (chief and workers, no ps "
        "tasks): gathering rows across tasks is not supported yet. Fix: "
        "train it on one machine (several devices), or with ps tasks, "
        "where the batch's rows are the machine's.".format(what))
  return context


def _offsets(sizes) -> List[Any]:
  """Each tower's first row; a tower without rows gets 0, as its stand-in."""
  if isinstance(sizes, list):
    return [sum(sizes[:i]) if size else 0 for i, size in enumerate(sizes)]
  starts = tf.where(sizes > 0, tf.cumsum(sizes, exclusive=True), 0)
  return tf.unstack(starts, num=sizes.shape[0])


class AllRows:
  """The `all_rows` calls of one wrapped `model_fn` call, per tower."""

  def __init__(self, num_towers: int):
    self._calls = [[] for _ in range(num_towers)]
    self.own_ops = set()  # the ops values of `all_rows` come out of

  def gather(self, context, tensor: tf.Tensor) -> tf.Tensor:
    index = context.progress.tower_index
    layout = context.layout
    call = _Call(index, tensor, layout.has_rows[index],
                 len(self._calls[index]))
    self._check_counterpart(call)
    self._calls[index].append(call)
    graph = layout.graph
    first_op = len(graph.get_operations())
    with tf.name_scope("all_rows"):
      # Connected by `finish`, once every tower's gradients are made: a
      # gradient computed before sees no path from another tower's rows.
      whole = _open_rows(tensor, "pending_all_rows")
      call.pending_forward = whole
      whole = tf.stop_gradient(whole)
      if tensor.dtype.is_floating or tensor.dtype.is_complex:
        result = self._with_gradient(context, call, tensor, whole)
      else:
        result = tf.identity(whole)
    self.own_ops.update(graph.get_operations()[first_op:])
    return result

  def _check_counterpart(self, call):
    if call.tower == 0:
      return
    towers = self._calls[:call.tower]
    for index, calls in enumerate(towers):
      if len(calls) <= call.position:
        raise ValueError(
            "Tower {}'s replicate.all_rows call number {} has no "
            "counterpart in tower {}: every tower's model_fn must make the "
            "same all_rows calls in the same order, whatever its "
            "data.".format(call.tower, call.position + 1, index))
      other = calls[call.position].tensor
      if (other.dtype != call.tensor.dtype or
          not other.shape[1:].is_compatible_with(call.tensor.shape[1:])):
        raise ValueError(
            "Tower {}'s replicate.all_rows call number {} is given {} of "
            "shape {}, tower {}'s {} of shape {}: every tower's rows must "
            "have the same dtype and shape beyond dimension 0.".format(
                call.tower, call.position + 1, call.tensor.dtype.name,
                call.tensor.shape, index, other.dtype.name, other.shape))

  def _with_gradient(self, context, call, tensor, whole):

    @tf.custom_gradient
    def joined(own, whole):
      def grad(upstream):
        return self._own_gradient(context, call, upstream), None
      return tf.identity(whole), grad

    return joined(tensor, whole)

  def _own_gradient(self, context, call, upstream):
    """The gradient w.r.t. the tower's own rows: summed over towers."""
    _check_weighted(context, call, upstream)
    upstream = sharding.zero_unless_rows(tf.convert_to_tensor(upstream),
                                         call.has_rows)
    call.grads.append(upstream)
    position = len(call.grads) - 1
    last = len(self._calls) - 1
    if call.tower < last:
      own = call.own_rows_of(upstream, context)
      call.pending_grads.append(stand_ins.stand_in(own, "all_rows_gradient"))
      return call.pending_grads[-1]
    calls = [tower[call.position] for tower in self._calls]
    counts = [len(c.grads) for c in calls]
    if any(count <= position for count in counts):
      raise _unmatched(counts)
    with tf.name_scope("all_rows_gradient_over_towers"):
      summed = tf.math.add_n([c.grads[position] for c in calls
                              if c.has_rows is not False])
      for other in calls[:-1]:
        pending = other.pending_grads[position]
        with tf.device(pending.device):
          stand_ins.connect(pending, other.own_rows_of(summed, context))
      return call.own_rows_of(summed, context)

  def finish(self) -> None:
    """Connects every call to the whole batch's rows, on its tower's
    device; checks that every tower made the same calls and backward
    passes through them."""
    for position, call in enumerate(self._calls[0]):
      calls = [tower[position] if position < len(tower) else None
               for tower in self._calls]
      if None in calls:
        raise ValueError(
            "Tower {} made fewer replicate.all_rows calls than tower 0: "
            "every tower's model_fn must make the same all_rows calls in "
            "the same order, whatever its data.".format(calls.index(None)))
      counts = [len(c.grads) for c in calls]
      if len(set(counts)) > 1:
        raise _unmatched(counts)
      with tf.name_scope("all_rows_over_towers"):
        for call in calls:
          with tf.device(call.pending_forward.device):
            whole = tf.concat([c.real_rows() for c in calls
                               if c.has_rows is not False], axis=0)
          stand_ins.connect(call.pending_forward, whole)


class _Call:
  """One tower's call of `all_rows`."""

  def __init__(self, tower, tensor, has_rows, position):
    self.tower = tower
    self.tensor = tensor
    self.has_rows = has_rows  # a bool, or a scalar bool tensor
    self.position = position  # in the tower's calls
    self.pending_forward = None  # towers 0..N-2: the stand-in for the batch
    self.grads = []  # per backward pass: this tower's upstream gradient
    self.pending_grads = []  # per backward pass: stand-ins for its rows'

  def row_count(self) -> tf.Tensor:
    """The tower's real rows: 0 on a stand-in row."""
    rows = tf.shape(self.tensor, out_type=tf.int32)[0]
    if self.has_rows is True:
      return rows
    return tf.where(self.has_rows, rows, 0)

  def real_rows(self) -> tf.Tensor:
    if self.has_rows is True:
      return self.tensor
    return self.tensor[:self.row_count()]

  def own_rows_of(self, summed, context):
    """The rows of `summed` (over the whole batch) that are this tower's,
    shaped like its tensor (zeros on a stand-in row)."""
    start = _offsets(context.layout.shards.sizes)[self.tower]
    rows = tf.shape(self.tensor, out_type=tf.int32)[0]
    own = summed[start:start + rows]
    if self.has_rows is True:
      return own
    zeros = tf.zeros_like(self.tensor)
    if self.has_rows is False:
      return zeros
    return tf.where(self.has_rows, _padded_to(own, rows), zeros)


def _padded_to(value, rows):
  """`value` with rows of zeros added up to `rows` (an empty batch's)."""
  missing = rows - tf.shape(value, out_type=tf.int32)[0]
  paddings = tf.concat([[[0, missing]],
                        tf.zeros([tf.rank(value) - 1, 2], tf.int32)], 0)
  return tf.pad(value, paddings)


def _open_rows(tensor, name):
  """`tensor` through a stand-in with dimension 0 open (see `stand_ins`)."""
  shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
  opened = tf.compat.v1.placeholder_with_default(tensor, shape)
  return tf.compat.v1.placeholder_with_default(opened, shape, name=name)


def _check_weighted(context, call, upstream):
  """The upstream gradient comes from a loss `TowerOptimizer` weighted."""
  index = context.progress.tower_index
  weight = context.weights.of(index)
  if index == call.tower and (
      (isinstance(weight, float) and weight == 1.0) or
      _downstream_of_any(context.weights.weight_ops(index), upstream)):
    return
  raise ValueError(
      "A gradient through replicate.all_rows (tower {}, call number {}) is "
      "made outside TowerOptimizer.compute_gradients or minimize "
      "(tf.gradients, a GradientTape, or an optimizer not wrapped in "
      "TowerOptimizer). Every tower's rows feed every tower's loss through "
      "it, so only every tower's own weighted backward pass, summed, gives "
      "one device's gradient. Fix: use TowerOptimizer.compute_gradients (or "
      "minimize) and change the gradients it returns before "
      "apply_gradients.".format(call.tower, call.position + 1))


def _downstream_of_any(ops, tensor) -> bool:
  """Whether `tensor` is computed from any of `ops` (data edges)."""
  if not ops:
    return False
  pending = [tensor.op]
  seen = set()
  while pending:
    op = pending.pop()
    if op in ops:
      return True
    if op in seen:
      continue
    seen.add(op)
    pending.extend(t.op for t in op.inputs)
  return False


def _unmatched(counts):
  return ValueError(
      "The towers made different numbers of backward passes through "
      "replicate.all_rows ({}): its gradient is summed over towers, pass by "
      "pass, so every tower must differentiate through it with the same "
      "TowerOptimizer calls in the same order.".format(", ".join(
          "tower {}: {}".format(i, n) for i, n in enumerate(counts))))

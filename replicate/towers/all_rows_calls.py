"""The `replicate.all_rows` calls of one wrapped `model_fn` call, joined.

On the forward pass (two phases, as `replicate.batch_norm.batch_norm_sites`):
the k-th `all_rows` call of every tower reads a stand-in (see
`replicate.gradients.stand_ins`); once every tower is built (`finish`),
every tower's k-th call has every tower's tensor: their real rows are
concatenated in tower order (a tower on a stand-in row gives none) and
every stand-in connected to it. Calls are matched by their position in the
tower, and checked by dtype and inner shape. In a synchronous cluster the
task's rows are then gathered across tasks
(`replicate.cluster.rows_over_tasks`).

On the backward pass: the value is a `tf.custom_gradient` whose gradient
with respect to tower i's own tensor is a stand-in for the sum over towers
k of the rows of tower k's upstream gradient that are tower i's, i.e.
`S[o_i:o_i + n_i]` with `S = sum_k dL_k/d all_rows`; the last tower's
gradient function makes `S` (in a cluster, summed over tasks too) and
connects every other tower's stand-in. Since `TowerOptimizer` weights each
tower's loss before it differentiates, S is the gradient of the whole
batch's loss; a gradient made outside it (`tf.gradients` on the unweighted
loss) is refused with the fix.
"""

import tensorflow as tf

from replicate.cluster import rows_over_tasks
from replicate.gradients import stand_ins
from replicate.shard import sharding
from replicate.towers import all_rows as all_rows_lib


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
        if _in_extra_pass(context):
          return None, None
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
    cross = context.layout.cross_task
    if cross is not None:
      with context.progress.building_own_ops():
        summed = rows_over_tasks.sum_gradient(cross, summed)
    with tf.name_scope("all_rows_gradient_over_towers"):
      for other in calls[:-1]:
        pending = other.pending_grads[position]
        with tf.device(pending.device):
          stand_ins.connect(pending, other.own_rows_of(summed, context))
      return call.own_rows_of(summed, context)

  def finish(self, layout) -> None:
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
        _join(calls, layout.cross_task)


def _in_extra_pass(context) -> bool:
  """Whether `"replicated"`'s second pass in tower i (towards tower 0's own
  variables, `TowerOptimizer._tower_gradients`) is being built.

  A tower's rows reach tower 0's variables only through what joins every
  tower's values, a synchronized batch norm's moments, which let that pass
  through with nothing (`BatchNormSync.backward`); through `all_rows` it
  gets nothing either, and is no backward pass of its own: the first pass
  already gave the tower's copies the gradient through its rows.
  """
  return context.batch_norm is not None and context.batch_norm.in_extra_pass


def _join(calls, cross) -> None:
  """Every tower's real rows of `calls` (one call each), concatenated in
  tower order on each tower's device, then across tasks with `cross`."""
  if cross is not None:
    with tf.device(cross.device):
      whole = rows_over_tasks.gather_rows(cross, tf.concat(
          [c.real_rows() for c in calls if c.has_rows is not False], 0))
  for call in calls:
    if cross is None:
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
    start = all_rows_lib.first_row(context.layout, self.tower)
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

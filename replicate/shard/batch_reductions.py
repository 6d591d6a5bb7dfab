"""Reductions over the batch axis whose value flows back into the rows.

On what: a tower reduces over axis 0 of a value computed from its rows
(`tf.reduce_max(lengths)`, `tf.reduce_sum(mask)`, `tf.reduce_any(done)`,
a count) and uses the result in values that have rows again: a slice size
(`x[:, :tf.reduce_max(lengths)]`), `tf.sequence_mask(lengths, maxlen)`, a
value multiplied into or subtracted from the rows. On one device that
reduction is over the whole batch; in a tower it is over the tower's shard.
Once the last tower is built, `combine` makes every tower's reduction the
whole batch's: the towers' partial results are combined (max of maxes, sum
of sums, a mean from the towers' sums and element counts, any, all) and
every reader of each tower's partial result reads the combined value instead
(`replicate._tf.update_input`), so that a width taken from the batch is the
batch's in every tower, as on one device.

On what is not this module's: only a reduction whose value reaches an op
with rows again (an op of rank >= 1 with another input computed from the
rows, of a shape that may hold them), is a prediction or an export output
itself (which then is the whole batch's, static or unknown batch alike),
or reaches a `tf.compat.v1.summary.*` off the loss's path, counts. A
reduction that only flows into scalars (the loss, a denominator of it, a
metric's total) is the loss rule's and the metrics';
reductions inside a TF 1 loop or a function body (beam search's "are my rows
done", whose width is padded instead, see `replicate.outputs.predictions`)
stay the tower's; so do the moments replicate's batch norm built (its
own ops, by identity: `replicate.batch_norm.user_moments`) and reductions
that are not over axis 0. A user's own `tf.nn.moments` over the batch axis
is a synchronized batch-norm site in TRAIN, or refused; elsewhere its
reductions are combined here like any other. Every op the tower built on
its forward pass is looked at, whoever reads it (the spec's outputs, a
metric update reached only through its variable's control edge, a summary,
a hook's tensor, `UPDATE_OPS`): the decision is the op's, the same in
every mode and for a static or unknown batch. The backward pass, and what
is computed from it (clipping, the update), are not: they are the
gradients' rule.

On gradients: a tower differentiates its loss through its own partial
result before the others exist, so a differentiable reduction (a float
reduction of values computed from variables) on the way to the loss cannot
be made the batch's exactly: the gradient each tower's rows get from the
other towers' rows is missing. That is refused, naming the op, with the fix
(`replicate.all_rows`). Reductions of inputs (lengths, masks, weights) are
not differentiated and are combined.

In a synchronous cluster the task's value is combined with every other
task's too: sums and means through the sum over tasks, the others through
an all-gather of each task's value (a step collective, which the train_op
waits for, as every collective of the step).
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from replicate import _tf
from replicate import graph_walk
from replicate.shard import rows as rows_lib
from replicate.call import layout as layout_lib
from replicate.graph import op_types

_NOT_DIFFERENTIATED = frozenset(["StopGradient", "PreventGradient"])
# What `tf.compat.v1.summary.*` builds: a value over the batch it shows is
# the whole batch's (a tensor with rows stays tower 0's).
SUMMARY_TYPES = frozenset([
    "ScalarSummary", "HistogramSummary", "ImageSummary", "AudioSummary",
    "AudioSummaryV2", "TensorSummary", "TensorSummaryV2"])


def combine(layout, progress, tower_specs, mode,
            is_backward: Callable[[tf.Operation], bool] = lambda op: False,
            mixed=frozenset()) -> Dict[Any, tf.Tensor]:
  """Makes every tower's batch reductions flowing into rows the batch's.

  `mixed`: tower 0's ops off the loss's path where rows meet
  (`replicate.shard.rows_meet`'s): a reduction computed from one is no sum
  of the towers' (a sum of a diagonal of the rows) and is left alone; the
  whole batch's value of what reads it is built again
  (`replicate.outputs.whole_batch`).

  `is_backward(op)`: whether TensorFlow built `op` in a backward pass
  (`replicate.gradients.touched.is_backward`, handed down): the backward
  pass and what is computed from it (clipping, the update) are the
  gradients' rule, not values of the rows.

  Returns {a tower's reduction (`tensor.ref()`): the whole batch's value}:
  what a spec's prediction or export output that is one of them is
  instead (`replicate.outputs.predictions`).
  """
  if not layout.combines:
    return {}
  found = [_reductions_into_rows(layout, progress, index, is_backward, spec)
           for index, spec in enumerate(tower_specs)]
  after_mixed = graph_walk.ops_after(mixed) if mixed else frozenset()
  sites = []
  for name, (op, into_rows) in found[0].items():
    if op in after_mixed:
      continue
    ops = [op] + [found[index].get(name, (None,))[0] for index in
                  range(1, layout.num_towers)]
    if any(other is None for other in ops):
      continue  # not a reduction into rows in every tower: left alone
    differentiated = mode == tf.estimator.ModeKeys.TRAIN and (
        _is_differentiated(op, tower_specs[0].loss, progress.tower_ops[0]))
    if differentiated and over_batch_axis(op) and into_rows:
      raise ValueError(_gradient_refusal(name))
    # Only a prediction's on the loss's path: the spec's value is the
    # batch's, the loss's path stays the tower's.
    sites.append((ops, differentiated and into_rows,
                  into_rows or not differentiated))
  whole = {}
  with progress.building_own_ops():
    for ops, guarded, repoint in sites:
      readers = [[(reader, index) for reader in op.outputs[0].consumers()
                  for index, tensor in enumerate(reader.inputs)
                  if tensor is op.outputs[0]] for op in ops]
      with tf.name_scope("batch_reduction_over_towers"):
        if over_batch_axis(ops[0]):
          values = [_combined(ops, layout)] * len(ops)
          # The same in every tower: not the tower's rows (for what reads
          # it: a prediction, a write of state).
          setattr(values[0].op, rows_lib.WHOLE_BATCH, True)
        else:
          values = _if_over_batch_axis(ops, layout, guarded)
      for op, reader_list, value in zip(ops, readers, values):
        whole[op.outputs[0].ref()] = value
        for reader, index in reader_list:
          if not repoint and reader.type not in SUMMARY_TYPES:
            continue  # the loss's path stays the tower's
          _tf.update_input(reader, index, value)
  return whole


def _if_over_batch_axis(ops, layout, differentiated) -> List[tf.Tensor]:
  """Per tower, what reads its reduction of axes known only when run: the
  towers' combined value if the axes include the batch's, else its own.

  Differentiated (on the way to the loss), a run whose axes include the
  batch's fails, with the refusal's message: the tower's gradient cannot be
  the batch's. The combination is built inside the branch: towers' partial
  results over other axes have their own rows, and cannot be stacked.
  """
  op = ops[0]
  axes = tf.reshape(op.inputs[1], [-1])
  rank = tf.maximum(tf.rank(op.inputs[0]), 1)
  over_rows = tf.reduce_any(tf.equal(
      tf.math.floormod(axes, tf.cast(rank, axes.dtype)), 0))
  if differentiated:
    check = tf.debugging.Assert(tf.logical_not(over_rows), [_gradient_refusal(
        layout_lib.to_tower0_name(op.name, 0))])
    with tf.control_dependencies([check]):
      return [tf.identity(other.outputs[0]) for other in ops]
  return [tf.cond(over_rows, lambda: _combined(ops, layout),
                  lambda o=other: tf.identity(o.outputs[0]))
          for other in ops]


def _reductions_into_rows(layout, progress, index, is_backward,
                          spec) -> Dict[str, tuple]:
  """{tower 0's name: (op, whether into rows)} of tower `index`'s
  reductions into rows, into the spec's predictions and export outputs, or
  into a summary off the loss's path, which are then the whole batch's
  too, in every tower.

  Every op the tower built forward counts, whoever reads it: the spec's
  outputs, a metric's update reached only through its variable's control
  edge, a summary, a hook's tensor, `UPDATE_OPS`, or nothing at all; the
  decision is the op's, not its reader's.
  """
  tower = layout.towers[index]
  shard = (tower.features, tower.labels)
  forward = _forward_ops(progress, index, is_backward)
  tower_rows = rows_lib.TowerRows(shard, forward)
  shard_tensors = _row_values(shard)
  loss_path = (frozenset(graph_walk.ops_behind([spec.loss], within=forward))
               if spec.loss is not None else frozenset())
  outputs = _output_tensors(spec)
  found = {}
  for op in progress.tower_ops[index]:
    if (op not in forward or op.type not in _COMBINABLE or
        _tf.built_in_control_flow(op) or
        over_batch_axis(op) is False or
        not _from_row_values(op.inputs[0], shard_tensors, forward)):
      continue
    into_rows, summarized = _flows_into_rows(op, forward, tower_rows)
    # On the loss's path a summary's value is the loss rule's: a summary of
    # the loss reads the combined loss (`replicate.outputs.specs`).
    summarized = summarized and op not in loss_path
    if into_rows or summarized or op.outputs[0].ref() in outputs:
      found[layout_lib.to_tower0_name(op.name, index)] = (op, into_rows)
  return found


def _output_tensors(spec) -> frozenset:
  """The refs of the spec's predictions and export outputs' tensors."""
  values = [spec.predictions]
  for output in (spec.export_outputs or {}).values():
    values.extend(getattr(output, field, None) for field in (
        "outputs", "scores", "classes", "value"))
  return frozenset(t.ref() for t in tf.nest.flatten(values)
                   if isinstance(t, tf.Tensor))


def _forward_ops(progress, index, is_backward) -> frozenset:
  """The ops of tower `index`'s forward pass: not replicate's own, not the
  update tower 0 built, not a backward pass or what is computed from one."""
  ops = [op for op in progress.tower_ops[index]
         if op not in progress.own_ops and op not in progress.update_built]
  backward = [op for op in ops if is_backward(op)]
  after = graph_walk.ops_after(backward) if backward else set()
  return frozenset(op for op in ops if op not in after)


def _row_values(shard):
  """The shard's tensors of values: a sparse tensor's values, not its
  indices and dense shape, which are positions and shapes."""
  values = set()
  for leaf in tf.nest.flatten(shard):
    if isinstance(leaf, tf.SparseTensor):
      leaf = leaf.values
    elif isinstance(leaf, tf.RaggedTensor):
      leaf = leaf.flat_values
    if isinstance(leaf, tf.Tensor):
      values.add(leaf.ref())
  return values


def _from_row_values(tensor, shard_tensors, tower_ops) -> bool:
  """Whether `tensor` is computed from the values of the tower's rows.

  `replicate.shard.rows`'s rule, but not through shapes and positions: a
  reduction of a shape (`tf.reduce_prod(tf.shape(x)[1:])`, a sparse
  tensor's dense shape) or of indices is not over the batch's values.
  """
  pending, seen = [tensor], set()
  while pending:
    current = pending.pop()
    if current.ref() in shard_tensors:
      return True
    op = current.op
    if (current.ref() in seen or op not in tower_ops or
        # A tensor's shape is not its rows: `tf.reduce_prod(tf.shape(x)[1:])`.
        op.type in op_types.SHAPE_TYPES or _is_position(current) or
        # A TF 1 write's output is the variable's value, state: a metric's
        # total (tf_metrics' confusion matrix, read from its `assign_add`),
        # as TF 2's read after the write is.
        op.type in op_types.VARIABLE_WRITE_TYPES):
      continue
    seen.add(current.ref())
    pending.extend(op.inputs)
  return False


def _is_position(tensor) -> bool:
  """Whether `tensor` is an op's output of shapes or indices (by its name
  in the op's definition: `output_shape`, `output_indices`, `index`)."""
  op = tensor.op
  try:
    arguments = op.op_def.output_arg
  except (AttributeError, ValueError):
    return False
  if len(arguments) != len(op.outputs):
    return False  # list outputs: names do not map one to one
  name = arguments[tensor.value_index].name
  return "shape" in name or "indices" in name or name == "index"


def over_batch_axis(op) -> Optional[bool]:
  """Whether the reduction `op` reduces dimension 0 of its input: True or
  False when its axes and its input's rank are known when built, None when
  only the run knows (`axis=tf.compat.v1.placeholder_with_default(0, [])`).

  The one check of a reduction's axes: `replicate.gradients.loss_ops` and
  `replicate.outputs.batch_inputs` ask it too. None is "possibly the rows
  axis": never taken for "not over the batch".
  """
  rank = op.inputs[0].shape.rank
  axes = tf.get_static_value(op.inputs[1])
  if rank == 0:
    return False
  if axes is None or rank is None:
    return None
  return any(int(axis) % rank == 0 for axis in np.ravel(axes))


def _flows_into_rows(op, forward, tower_rows) -> Tuple[bool, bool]:
  """Whether the op's value reaches an op with rows from elsewhere too;
  whether it reaches a summary (which then shows the whole batch's)."""
  reached = {op}
  pending = [op]
  while pending:
    for tensor in pending.pop().outputs:
      for reader in tensor.consumers():
        if reader in forward and reader not in reached:
          reached.add(reader)
          pending.append(reader)
  rows = tower_rows.static_count()
  summarized = any(reader.type in SUMMARY_TYPES for reader in reached)
  for reader in reached - {op}:
    if not any(t.shape.rank != 0 for t in reader.outputs):
      continue  # a scalar: a loss, a denominator, a total
    if any(t.op not in reached and _may_carry_rows(t, rows) and
           tower_rows.depend([t]) for t in reader.inputs):
      return True, summarized
  return False, summarized


def _may_carry_rows(tensor, rows) -> bool:
  """Whether some axis of `tensor` may be the tower's rows: one of unknown
  size, or of the shard's size. A shape known when built, on a batch whose
  size is not (or of other sizes), is not rows: Keras' confusion
  matrices' `[thresholds]` counts, from which a total is subtracted."""
  shape = tensor.shape
  if shape.rank is None:
    return True
  return any(tf.compat.dimension_value(size) in (None, rows)
             for size in shape)


def _is_differentiated(op, loss, tower_ops) -> bool:
  """Whether tower 0's loss is differentiated through the reduction."""
  if loss is None or not op.outputs[0].dtype.is_floating:
    return False
  if not any(behind.type in op_types.VARIABLE_TYPES
             for behind in graph_walk.ops_behind([op.inputs[0]])):
    return False
  loss_op = tf.convert_to_tensor(loss).op
  pending, seen = [op], {op}
  while pending:
    current = pending.pop()
    if current is loss_op:
      return True
    for tensor in current.outputs:
      if not tensor.dtype.is_floating:
        continue
      for reader in tensor.consumers():
        if (reader not in seen and reader in tower_ops and
            reader.type not in _NOT_DIFFERENTIATED):
          seen.add(reader)
          pending.append(reader)
  return False


def _gradient_refusal(name) -> str:
  return (
      "The reduction {!r} is over the batch axis of values computed from the "
      "variables, and its value flows back into per-row values on the way "
      "to the loss: on one device each row's gradient goes through the "
      "whole batch's value, but each tower differentiates its own loss "
      "through its own shard's before the other towers exist, so the "
      "gradient cannot be the batch's. Fix: reduce replicate.all_rows("
      "tensor) (every tower gets the whole batch's rows, with the gradient "
      "summed back to each tower's), or wrap the reduction in "
      "tf.stop_gradient if no gradient should flow through it.".format(name))


def _combined(ops: List[tf.Operation], layout) -> tf.Tensor:
  """The whole batch's value of the towers' reductions `ops`.

  A tower (or a task) without rows adds the reduction's identity: 0 to a
  sum, 1 to a product, the lowest value to a max, and so on.
  """
  kind = ops[0].type
  partials = [op.outputs[0] for op in ops]
  if kind == "Mean":
    value = _mean(ops, layout)
  else:
    kept = [_unless_no_rows(p, rows, kind) for p, rows in
            zip(partials, layout.has_rows) if rows is not False] or [
                tf.fill(tf.shape(partials[0]),
                        _identity(kind, partials[0].dtype))]
    value = _REDUCE[kind](tf.stack(kept), axis=0)
    if layout.spans_tasks:
      value = _over_tasks(value, kind, layout)
  shape = partials[0].shape
  for partial in partials[1:]:
    shape = shape.merge_with(partial.shape)
  value.set_shape(shape)
  return value


_REDUCE = {"Sum": tf.reduce_sum, "Prod": tf.reduce_prod,
           "Max": tf.reduce_max, "Min": tf.reduce_min,
           "Any": tf.reduce_any, "All": tf.reduce_all}
# The reductions whose towers' partial results combine into the batch's
# (a mean from sums and counts); not `EuclideanNorm`.
_COMBINABLE = frozenset(_REDUCE) | {"Mean"}
_COLLECTIVE_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def _over_tasks(value, kind, layout):
  """A task's value combined with every other task's, in a sync cluster."""
  if kind == "Sum":
    return layout.sum_over_tasks(value, "sum_over_tasks")
  dtype = value.dtype
  carried = tf.int32 if dtype == tf.bool else dtype
  if carried not in _COLLECTIVE_DTYPES:
    raise ValueError(
        "A {} over the batch axis of {} values flows back into per-row "
        "values ({!r}); a synchronous cluster combines float16/32/64 and "
        "int32/64 across tasks. Fix: cast the values to one of those "
        "before reducing them.".format(kind, dtype.name, value.name))
  gathered = layout.cross_task.gather(
      tf.expand_dims(tf.cast(value, carried), 0))
  reduce = {"Any": tf.reduce_max, "All": tf.reduce_min}.get(
      kind, _REDUCE[kind])
  return tf.cast(reduce(gathered, axis=0), dtype)


def _mean(ops, layout) -> tf.Tensor:
  """From each tower's sum and element count, so integers divide once."""
  sums, counts = [], []
  for op, rows in zip(ops, layout.has_rows):
    if rows is False:
      continue
    keepdims = op.get_attr("keep_dims")
    total = tf.reduce_sum(op.inputs[0], op.inputs[1], keepdims=keepdims)
    count = tf.size(op.inputs[0], out_type=tf.int64) // tf.maximum(
        tf.size(total, out_type=tf.int64), 1)
    sums.append(_unless_no_rows(total, rows, "Sum"))
    counts.append(_unless_no_rows(count, rows, "Sum"))
  total = layout.sum_over_tasks(tf.add_n(sums), "sum_over_tasks")
  count = layout.sum_over_tasks(tf.add_n(counts), "count_over_tasks")
  dtype = ops[0].outputs[0].dtype
  if dtype.is_floating or dtype.is_complex:
    return total / tf.cast(count, dtype)
  return tf.math.truncatediv(total, tf.cast(count, dtype))


def _unless_no_rows(value, rows, kind):
  """`value`, or the identity of `kind` where the tower has no rows."""
  if not isinstance(rows, tf.Tensor):
    return value
  return tf.where(rows, value, tf.fill(tf.shape(value),
                                       _identity(kind, value.dtype)))


def _identity(kind, dtype):
  if kind in ("Any", "All"):
    return tf.constant(kind == "All")
  if kind in ("Max", "Min"):
    if dtype.is_floating:
      limit = float("-inf") if kind == "Max" else float("inf")
    else:
      limit = dtype.min if kind == "Max" else dtype.max
    return tf.constant(limit, dtype)
  return tf.constant(1 if kind == "Prod" else 0, dtype)

"""A metric fed a value no combination of the towers' values gives: its
update is computed once, on the whole batch's rows.

On what: a metric whose update reads a value over the batch made by an op
that is no sum, count, maximum, minimum, any, all or mean of the rows (a
`py_func` corpus score such as BLEU or ROUGE, a median, an op the rows rule
does not know). Each tower's value is over its shard only, and no
combination of them is one device's value.

On how: the ops of tower 0's update that read the rows are built again,
reading the whole batch's: each of their inputs from the rows (a
prediction's per-row logits, a feature, the labels) is the towers' tensors
concatenated along dimension 0 in tower order, each padded to the widest,
as `replicate.all_rows` and a `TPUEstimatorSpec`'s `eval_metrics`
(`replicate.outputs.tpu_spec`) give the whole batch, in input order; the
spec's loss is the combined spec's loss. Every op computed from those
inputs is copied, its shapes inferred again from the whole batch's (so a
batch of known size works as one of unknown size), up to the metric's
state: its variables' writes read the copies. Tower 0's update alone runs
(`replicate.outputs.metrics`). The ops on the loss's and the predictions'
paths are not touched: they stay per tower, and their per-row values are
what is gathered. A rows rule refusal of the same op stays where it is on
those paths (the gradient path, and what is put back together by rows).

Refused, naming the value, with the fix: an input that has no rows to
gather (a value over the tower's shard that is not the loss); a value the
copies would read that holds the shard's row count itself (a shape
TensorFlow folded to a constant on a batch of known size: `tf.size(x)`);
a copy TensorFlow cannot build for the whole batch's shapes (a reshape to
the shard's rows); and ops inside a TF 1 `while_loop`.
"""

from typing import Any, List, Sequence

import numpy as np
import tensorflow as tf

from replicate import _tf
from replicate import graph_walk
from replicate.call import layout as layout_lib
from replicate.graph import op_types
from replicate.outputs import predictions as predictions_lib
from replicate.shard import rows as rows_lib


def feed_whole_batch(key: str, updates: Sequence[Any], tower_specs,
                     tower_ops: Sequence[List[tf.Operation]], layout,
                     combined_loss) -> None:
  """Tower 0's update of `key` computes on the whole batch's rows.

  `updates`: each tower's update of the key; `tower_ops`: the ops each
  tower built; `combined_loss`: the combined spec's loss.
  """
  within = frozenset(tower_ops[0])
  kept = set(graph_walk.ops_behind(_path_outputs(tower_specs[0]),
                                   within=within))
  metric_ops = set(graph_walk.ops_behind(
      [updates[0]], within=within, follow_control=True)) - kept
  tower0 = layout.towers[0]
  # On a batch of unknown size no shape of the rows is folded to a constant
  # (a folded `tf.size` of a scalar is no count of rows).
  rows = rows_lib.TowerRows((tower0.features, tower0.labels), within,
                            count_folded=isinstance(layout.shards.sizes,
                                                    list))
  reads = [tensor
           for op in sorted(metric_ops, key=lambda o: o.name)
           for tensor in op.inputs
           if tensor.op not in metric_ops and rows.depend([tensor])]
  folded = {t.ref(): t for t in reads if rows_lib.folded_shape_kind(t.op)}
  folded.update((op.outputs[0].ref(), op.outputs[0])
                for op in sorted(metric_ops, key=lambda o: o.name)
                if rows_lib.folded_shape_kind(op) and rows.depend([op]))
  whole = {}  # tower 0's tensor ref -> the whole batch's
  for tensor in reads:
    if tensor.ref() not in whole and tensor.ref() not in folded:
      whole[tensor.ref()] = _whole_batch(key, tensor, tower_specs, tower_ops,
                                         layout, combined_loss)
  for tensor in folded.values():
    whole[tensor.ref()] = _whole_count(key, tensor, tower_ops, layout)
  order = {op: index for index, op in enumerate(tower_ops[0])}
  with tf.name_scope("metric_rows_over_towers"):
    _build_again(key, _inputs_first(metric_ops, order), whole, rows)


def _inputs_first(ops, order):
  """`ops` with each after the ops among them it reads (data or control),
  else in build order: a TF 1 `cond` rewires its branches' inputs to the
  `Switch` ops it builds after them. A loop (a TF 1 `while_loop`'s
  `NextIteration`) leaves its ops in build order."""
  waiting = {op: {t.op for t in op.inputs} | set(op.control_inputs)
             for op in ops}
  waiting = {op: needs & ops for op, needs in waiting.items()}
  readers = {}
  for op, needs in waiting.items():
    for need in needs:
      readers.setdefault(need, []).append(op)
  ready = sorted((op for op, needs in waiting.items() if not needs),
                 key=order.get)
  ordered = []
  while ready:
    op = ready.pop(0)
    ordered.append(op)
    for reader in readers.get(op, ()):
      waiting[reader].discard(op)
      if not waiting[reader]:
        ready.append(reader)
    ready.sort(key=order.get)
  done = set(ordered)
  return ordered + sorted((op for op in ops if op not in done), key=order.get)


def _build_again(key, metric_ops, whole, rows):
  """Copies every op of `metric_ops` (in build order) computed from a
  tensor of `whole`, reading the whole batch's; the metric's state ops
  read the copies."""
  copied = {}  # op -> its copy
  for op in metric_ops:
    if _keeps_state(op) or not any(t.ref() in whole for t in op.inputs):
      continue
    if op.type in op_types.TF1_LOOP_TYPES:
      raise ValueError(_LOOP.format(key=key, op=op.name))
    inputs = [whole.get(t.ref(), t) for t in op.inputs]
    for old, new in zip(op.inputs, inputs):
      if new is old and rows.depend([old]):
        raise ValueError(_SHARD_VALUE.format(key=key, tensor=old.name,
                                             op=op.name))
    try:
      copy = _tf.copy_op(op, inputs,
                         [copied.get(c, c) for c in op.control_inputs],
                         op.name.replace("/", "_"))
    except (ValueError, tf.errors.InvalidArgumentError) as error:
      raise ValueError(_STATIC.format(key=key, op=op.name,
                                      error=str(error).split("\n")[0]))
    copied[op] = copy
    for old, new in zip(op.outputs, copy.outputs):
      whole[old.ref()] = new
  for op in metric_ops:
    if op in copied:
      continue
    for index, tensor in enumerate(op.inputs):
      new = whole.get(tensor.ref())
      if new is None:
        continue
      if not tensor.shape.is_compatible_with(new.shape):
        raise ValueError(_STATIC.format(
            key=key, op=op.name, error="it holds {} where the whole batch "
            "gives {}".format(tensor.shape, new.shape)))
      _tf.update_input(op, index, new)
    for control in op.control_inputs:
      if control in copied:
        _tf.add_control_input(op, copied[control])


def _keeps_state(op):
  """A metric op that reads or writes a variable: it is not built again."""
  return (op.type in op_types.VARIABLE_TYPES or
          op.type == "ReadVariableOp" or
          any(t.dtype == tf.resource or _tf.is_ref_dtype(t.dtype)
              for t in op.inputs))


def _whole_count(key, tensor, tower_ops, layout):
  """The whole batch's value of a shape TensorFlow folded to a constant
  from tower 0's (`tf.shape(x)`, `tf.size(x)` on a batch of known size),
  read off the towers' constants: an entry that is each tower's rows times
  one `k` is the whole batch's rows times `k`; one the same in every tower
  of unequal shards stays. Refused where the towers cannot tell (every
  shard one row), and for other folded values (`tf.ones_like(x)`)."""
  sizes = layout.shards.sizes
  kind = rows_lib.folded_shape_kind(tensor.op)
  if kind in ("Shape", "Size"):
    towers = [index for index in range(layout.num_towers) if sizes[index]]
    values = [tf.get_static_value(
        _counterpart(tensor, index, tower_ops[index], layout))
              for index in towers]
    rows = np.array([sizes[index] for index in towers])
    if all(value is not None for value in values):
      stacked = np.stack([np.reshape(value, [-1]) for value in values])
      whole = [_whole_entry(stacked[:, entry], rows)
               for entry in range(stacked.shape[1])]
      if all(entry is not None for entry in whole):
        value = np.reshape(np.array(whole), np.shape(values[0]))
        return tf.constant(value.astype(values[0].dtype), tensor.dtype)
  raise ValueError(_FOLDED.format(key=key, tensor=tensor.name))


def _whole_entry(values, rows):
  """One entry of a folded shape over the towers with rows: the whole
  batch's, or None when the towers cannot tell."""
  same = (values == values[0]).all()
  if same and ((rows != rows[0]).any() or values[0] % rows[0]):
    return int(values[0])  # not the rows: unequal shards would differ
  if (values % rows == 0).all() and len(set(values // rows)) == 1 and (
      rows > 1).any():
    return int(values[0] // rows[0] * rows.sum())
  return None


def _path_outputs(spec):
  """What the loss's and the predictions' paths end in."""
  values = [spec.loss, spec.predictions]
  for output in (spec.export_outputs or {}).values():
    values.extend(getattr(output, field, None) for field in (
        "outputs", "scores", "classes", "value"))
  return [t for t in tf.nest.flatten(values)
          if isinstance(t, (tf.Tensor, tf.Operation))]


def _whole_batch(key, tensor, tower_specs, tower_ops, layout,
                 combined_loss):
  """The towers' counterparts of tower 0's `tensor`, in tower order."""
  loss = tower_specs[0].loss
  if loss is not None and tensor is tf.convert_to_tensor(loss):
    return tf.cast(combined_loss, tensor.dtype)
  if not tensor.shape.rank:
    raise ValueError(_NO_ROWS.format(key=key, tensor=tensor))
  parts = [_counterpart(tensor, index, tower_ops[index], layout)
           for index in range(layout.num_towers)]
  shards = layout.shards
  kept = []
  for index, part in enumerate(parts):
    if layout.towers[index].has_rows is False:
      continue
    kept.append(part[:shards.sizes[index]] if shards.may_stand_in else part)
  with tf.name_scope("metric_rows_over_towers"):
    return predictions_lib.concat_padded(kept)


def _counterpart(tensor, index, ops, layout):
  """Tower `index`'s tensor for tower 0's `tensor`: the same leaf of its
  shard, or the output of its op of the same name."""
  if index == 0:
    return tensor
  towers = layout.towers
  leaves = [tf.nest.flatten((t.features, t.labels), expand_composites=True)
            for t in (towers[0], towers[index])]
  for leaf, other in zip(*leaves):
    if leaf is tensor:
      return other
  for op in ops:
    if layout_lib.to_tower0_name(op.name, index) == tensor.op.name:
      return op.outputs[tensor.value_index]
  raise ValueError(
      "tower {} has no counterpart of tower 0's {!r}, which a metric reads: "
      "build the model_fn the same way in every tower (no branch on the "
      "tower).".format(index, tensor.name))


_FIX = (
    "Fix: return a tf.compat.v1.estimator.tpu.TPUEstimatorSpec whose "
    "eval_metrics=(metric_fn, tensors) passes the per-row tensors (one row "
    "per input row) and computes this value in metric_fn; replicate calls "
    "metric_fn once, on the whole batch's tensors. Or feed the metric "
    "per-row values.")
_INTRO = (
    "eval_metric_ops[{key!r}] is fed a value over each tower's rows that no "
    "combination of the towers' values gives (a py_func corpus score, a "
    "median), so replicate computes it again on the whole batch's rows, ")
_STATIC = _INTRO + (
    "but the op {op!r} cannot be built for the whole batch's rows: "
    "{error}. " + _FIX)
_SHARD_VALUE = _INTRO + (
    "but the op {op!r} reads {tensor!r}, computed from the tower's shard "
    "alone (from a shape TensorFlow folded to a constant on a batch of "
    "known size) and no input replicate can gather. " + _FIX)
_FOLDED = _INTRO + (
    "but it reads {tensor!r}, a shape of the tower's shard TensorFlow "
    "folded to a constant on a batch of known size (tf.size(x), "
    "tf.shape(x), tf.ones_like(x)), of which replicate cannot tell the "
    "whole batch's (every tower holds one row, or it is no shape or "
    "size). " + _FIX)
_LOOP = _INTRO + (
    "but the op {op!r} is part of a TF 1 tf.while_loop, which cannot be "
    "built again op by op. " + _FIX)
_NO_ROWS = (
    "eval_metric_ops[{key!r}] is computed, once, on the whole batch's rows "
    "(its value over the batch is no sum, count, maximum, minimum or mean "
    "of them), but it reads {tensor!r}, a value over each tower's rows "
    "with no row to gather. Fix: compute the metric from per-row tensors "
    "(one row per input row), or return a "
    "tf.compat.v1.estimator.tpu.TPUEstimatorSpec whose eval_metrics="
    "(metric_fn, tensors) passes them; replicate calls metric_fn once, on "
    "the whole batch's tensors.")

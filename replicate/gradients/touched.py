"""Gradients from `tf.gradients` or a `GradientTape` that user code touches.

On what: `TowerOptimizer.compute_gradients` gives the whole batch's
gradients itself (see `replicate.gradients.apply_once`). A `model_fn` that
differentiates on its own (`grads = tf.gradients(loss, tvars)`, BERT's way;
`tape.gradient(loss, tvars)`) and changes the result before
`apply_gradients` (`tf.clip_by_global_norm`, a scale, logging the norm) gets
the tower's own gradients, so this module makes the code it ran on them
read the whole batch's instead, when `apply_gradients` shows it.

On finding them: walking back from what `apply_gradients` received, through
the user's ops, the walk stops at the outputs of a backward pass (ops in a
`gradients`, `gradients_N` or `gradient_tape` name scope, where TensorFlow
builds them): those are the gradients the user's code read. Each is given
a stand-in for its weighted sum over towers (`stand_ins`), and the user's
ops on the walked path, and those that log them, read the stand-in instead.
The last tower's `apply_gradients` sums each over towers (matched by
position, since every tower runs the same code) and
connects every tower's stand-in. What `apply_gradients` received is then the
whole batch's, and is applied once (`gradient_weights.whole_batch`).

On `IndexedSlices` (embeddings): their values and indices are summed as a
pair (concatenated, duplicates kept, as one device's gradient has them); a
received gradient keeps its values, computed from the stand-in's, and gets
the stand-in's indices.
"""

import re
from typing import Any, List, NamedTuple

import tensorflow as tf

from replicate import _tf
from replicate.gradients import stand_ins
from replicate.shard import sharding

# The name scopes TensorFlow builds a backward pass in.
_BACKWARD = re.compile(r"(gradients|gradient_tape)(_[0-9]+)?")


class Touched(NamedTuple):
  """One gradient the user's code read, in one tower."""
  key: str  # the kind of op that made it (see `_key`)
  own: Any  # the tower's gradient, weighted (Tensor or IndexedSlices)
  stand_in: Any  # what the user's code now reads instead


def is_backward(op: tf.Operation) -> bool:
  """Whether TensorFlow built `op` as part of a backward pass."""
  return any(_BACKWARD.fullmatch(part) for part in op.name.split("/")[:-1])


def made_whole(context, grads_and_vars: list, weigh, whole_ops) -> tuple:
  """Re-points the user's code between the backward pass and `grads_and_vars`.

  Returns (grads_and_vars, touched): the pairs, with `IndexedSlices` whose
  values were re-pointed given the stand-in's indices, and the `Touched`
  records of this tower. `weigh(grad)` weights a gradient of the tower's
  loss by the tower's weight; `whole_ops` are ops already the whole batch's.
  """
  starts = []
  for grad, _ in grads_and_vars:
    for tensor in _parts(grad):
      if not is_backward(tensor.op) and tensor.op not in whole_ops:
        starts.append(tensor.op)
  if not starts:
    return grads_and_vars, []
  walked, boundary = _walk_back(starts, whole_ops)
  rows = context.progress.rows_of(context.progress.tower_index)
  boundary = [t for t in boundary if rows.depend([t])]
  if not boundary:
    return grads_and_vars, []
  touched = []
  replaced = {}  # raw tensor ref -> the stand-in tensor
  for group in _groups(boundary, grads_and_vars):
    own = group if not isinstance(group, tuple) else tf.IndexedSlices(*group)
    # The user's readers, before this module adds its own.
    readers = [list(raw.consumers()) for raw in _parts(own)]
    weighted = weigh(own)
    stand_in = stand_ins.whole_batch(weighted)
    touched.append(Touched(_key(_parts(own)[0]), weighted, stand_in))
    for raw, new, consumers in zip(_parts(own), _parts(stand_in), readers):
      replaced[raw.ref()] = new
      _repoint(raw, new, consumers, walked)
  result = []
  for grad, variable in grads_and_vars:
    if isinstance(grad, tf.IndexedSlices) and grad.indices.ref() in replaced:
      grad = tf.IndexedSlices(grad.values, replaced[grad.indices.ref()],
                              grad.dense_shape)
    result.append((grad, variable))
  return result, touched


def connect(context, touched_per_tower: List[List[Touched]], scopes) -> None:
  """Sums each touched gradient over towers; connects every tower's."""
  if not any(touched_per_tower):
    return
  keys = [t.key for t in touched_per_tower[0]]
  for index, tower in enumerate(touched_per_tower):
    if [t.key for t in tower] != keys:
      raise ValueError(
          "Tower {} changes other gradients from tf.gradients (or a "
          "GradientTape) before apply_gradients than tower 0 does ({} "
          "against {}): each tower's model_fn was supposed to run the same "
          "code. Make the gradient code independent of the tower's data, or "
          "take gradients with TowerOptimizer.compute_gradients.".format(
              index, [t.key for t in tower], keys))
  counts = context.weights.counts()
  per_tower = [[None if rows is False else sharding.zero_unless_rows(
      t.own, rows) for t in tower] for tower, rows in zip(touched_per_tower,
                                                          counts)]
  with scopes:  # tower 0's, unless the strategy places its sums
    summed = context.layout.strategy.sum_gradients(per_tower,
                                                   context.layout.devices)
    for tower, sums in zip(touched_per_tower, summed):
      for record, total in zip(tower, sums):
        stand_ins.connect(record.stand_in, total)


def _parts(grad) -> List[tf.Tensor]:
  if grad is None:
    return []
  if isinstance(grad, tf.IndexedSlices):
    return [grad.values, grad.indices]
  return [tf.convert_to_tensor(grad)]


def _walk_back(starts, whole_ops):
  """The ops walked back from `starts`, and the backward outputs they read."""
  walked, boundary, seen = set(), [], set()
  stack = list(starts)
  while stack:
    op = stack.pop()
    if op in walked:
      continue
    walked.add(op)
    for tensor in op.inputs:
      source = tensor.op
      if source in whole_ops:
        continue
      if is_backward(source):
        if tensor.ref() not in seen:
          seen.add(tensor.ref())
          boundary.append(tensor)
        continue
      stack.append(source)
  return walked, boundary


def _groups(boundary, grads_and_vars):
  """The gradients in `boundary`: dense tensors, and (values, indices,
  dense_shape) of `IndexedSlices`, paired by the backward op's name scope."""
  slices_of = {}  # indices ref -> the received IndexedSlices
  for grad, _ in grads_and_vars:
    if isinstance(grad, tf.IndexedSlices):
      slices_of[grad.indices.ref()] = grad
  indices = {}  # name scope -> (indices tensor, dense_shape)
  for grad in slices_of.values():
    if is_backward(grad.indices.op):
      indices[_scope(grad.indices)] = (grad.indices, grad.dense_shape)
  for tensor in boundary:
    if tensor.dtype.is_integer and _scope(tensor) not in indices:
      indices[_scope(tensor)] = (tensor, None)
  groups, used = [], set()
  for tensor in boundary:
    if tensor.dtype.is_integer:
      continue
    pair = indices.get(_scope(tensor))
    if pair is None:
      groups.append(tensor)
      continue
    used.add(_scope(tensor))
    groups.append((tensor,) + pair)
  unpaired = [t for s, (t, _) in indices.items()
              if s not in used and any(t is b for b in boundary)]
  if unpaired:
    raise ValueError(
        "The model_fn reads the indices {!r} of a sparse gradient "
        "(IndexedSlices, from an embedding lookup) made by tf.gradients or a "
        "GradientTape, whose values replicate_model_fn cannot find, so it "
        "cannot make them the whole batch's. Fix: take the gradients with "
        "TowerOptimizer.compute_gradients(loss), which gives the whole "
        "batch's, or pass the change as TowerOptimizer(..., "
        "gradient_transformers=[...]).".format(unpaired[0].name))
  return groups


def _repoint(raw: tf.Tensor, new: tf.Tensor, consumers, walked) -> None:
  """The user's ops reading `raw` read `new`: those on the walked path to
  `apply_gradients`, and those that only log it (nothing differentiates
  what they compute)."""
  for consumer in consumers:
    if is_backward(consumer):
      continue
    if consumer not in walked and _feeds_backward(consumer):
      continue  # e.g. a gradient penalty in a loss: left as it is
    if _tf.built_in_control_flow(consumer):
      raise ValueError(
          "The op {!r} reads the gradient {!r} inside a tf.cond or "
          "tf.while_loop, where replicate_model_fn cannot make it read the "
          "whole batch's gradient. Fix: take the gradients with "
          "TowerOptimizer.compute_gradients(loss), or pass the change as "
          "TowerOptimizer(..., gradient_transformers=[...]).".format(
              consumer.name, raw.name))
    for position, tensor in enumerate(consumer.inputs):
      if tensor is raw:
        _tf.update_input(consumer, position, new)


def _feeds_backward(op) -> bool:
  seen, stack = set(), [op]
  while stack:
    current = stack.pop()
    for output in current.outputs:
      for consumer in output.consumers():
        if is_backward(consumer):
          return True
        if consumer not in seen:
          seen.add(consumer)
          stack.append(consumer)
  return False


def _scope(tensor) -> str:
  return tensor.op.name.rpartition("/")[0]


def _key(tensor) -> str:
  """What must match between towers: the kind of op that made `tensor`.

  Towers are matched by position, since every tower runs the same code and
  the walk visits the same graph in the same order; names do not match
  (tower 0 shares the outer name scope, so its ops are numbered on).
  """
  return "{}:{} {}".format(tensor.op.type, tensor.value_index,
                           tensor.dtype.name)

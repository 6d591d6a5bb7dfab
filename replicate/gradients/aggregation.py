"""Summing the towers' gradients into one update.

On dense gradients: one `add_n` per variable, placed with the variable, so
each tower sends its gradient once to where the update runs; in a ps
cluster, on the worker instead, so the worker sends one sum to the ps.

On sparse gradients (`IndexedSlices`, from embedding lookups): the towers'
slices are concatenated, duplicates allowed, `dense_shape` kept; the
optimizer's sparse update sums duplicate indices itself. Nothing is densified.

On empty towers: a tower with no rows contributes nothing. When that is only
known at run time its gradient is chosen away with `Switch` and `Merge`
(`sharding.zero_unless_rows`: no copy on a step where it has rows; never
multiplied by 0, which would keep a NaN).
"""

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from replicate.communication import allreduce
from replicate.shard import sharding

GradsAndVars = List[Tuple[Any, tf.Variable]]


def sum_grads_and_vars(per_tower: Sequence[GradsAndVars],
                       has_rows: Sequence[Any],
                       device: Optional[str] = None) -> GradsAndVars:
  """Sums each variable's gradient over towers; all-`None` stays `None`.

  `per_tower[i]` is tower i's `(gradient, variable)` list; every tower lists
  the same variables in the same order (checked by the caller). Each sum
  runs on `device`, or by default with its variable.
  """
  summed = []
  for position, (_, variable) in enumerate(per_tower[0]):
    grads = [(tower[position][0], rows)
             for tower, rows in zip(per_tower, has_rows)
             if tower[position][0] is not None and rows is not False]
    if not grads:
      summed.append((None, variable))
      continue
    with tf.device(device or variable.device), tf.name_scope(
        _op_name(variable) + "_sum_over_towers"):
      summed.append((add_gradients(
          [sharding.zero_unless_rows(g, rows) for g, rows in grads]),
                     variable))
  return summed


def all_reduce_grads_and_vars(per_tower: Sequence[GradsAndVars],
                              has_rows: Sequence[Any], devices: Sequence[str],
                              algorithm: str,
                              compact: bool, cross=None) -> GradsAndVars:
  """Every tower's variables (or copies) with the sum over towers, all-reduced.

  For replicated variables: `per_tower[i]` pairs tower i's gradients with
  its own copies. The result pairs each copy with the summed gradient, on
  the copy's device, so one `apply_gradients` updates every copy alike. A
  variable a tower shares with tower 0 (it made no copy) is updated once.
  """
  grads = [[None if rows is False or g is None else
             sharding.zero_unless_rows(g, rows) for g, _ in tower]
            for tower, rows in zip(per_tower, has_rows)]
  summed = allreduce.all_reduce_grads(grads, devices, algorithm, compact,
                                      cross)
  tower0_variables = [variable for _, variable in per_tower[0]]
  combined = []
  for index, tower in enumerate(per_tower):
    for position, (_, variable) in enumerate(tower):
      if index == 0 or variable is not tower0_variables[position]:
        combined.append((summed[index][position], variable))
  return combined


def add_gradients(grads):
  """The sum of gradients of one variable: dense, `IndexedSlices` or mixed."""
  if len(grads) == 1:
    return grads[0]
  if any(isinstance(g, tf.IndexedSlices) for g in grads):
    return _concat_slices(grads)
  return tf.math.add_n(grads)


def _concat_slices(grads):
  slices = [as_slices(g) for g in grads]
  dense_shape = next(
      (s.dense_shape for s in slices if s.dense_shape is not None), None)
  return tf.IndexedSlices(
      tf.concat([s.values for s in slices], axis=0),
      tf.concat([tf.cast(s.indices, tf.int64) for s in slices], axis=0),
      dense_shape)


def as_slices(value):
  """`value` as `IndexedSlices`: a dense gradient becomes slices of every row.

  So it can join sparse ones, or take the place of a sparse one.
  """
  if isinstance(value, tf.IndexedSlices):
    return value
  dense = value
  rows = tf.shape(dense, out_type=tf.int64)[0]
  return tf.IndexedSlices(dense, tf.range(rows),
                          tf.shape(dense, out_type=tf.int64))


def _op_name(variable):
  return variable.op.name.replace(":", "_")

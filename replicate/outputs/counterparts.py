"""Tower i's counterparts of tower 0's tensors, and the towers' values put
together: concatenated along their rows in tower order (input order), or
summed (counts). A tower on a stand-in row (no rows of its own) adds no
rows and counts 0. (`replicate.outputs.whole_batch` reads them.)
"""

import re
from typing import Optional

import tensorflow as tf

from replicate.call import layout as layout_lib
from replicate.shard import sharding

_UNIQUIFIED = re.compile(r"_[0-9]+$")


class NotFound(Exception):
  """A tower has no counterpart of tower 0's tensor (or no known rank)."""


class Counterparts:
  """The towers' tensors of `layout`, as `progress` recorded them built."""

  def __init__(self, layout, progress):
    self._towers = layout.towers
    self._progress = progress
    shard = (self._towers[0].features, self._towers[0].labels)
    self._leaves = [_row_leaves(shard, (tower.features, tower.labels))
                    for tower in self._towers]
    self._alike = {}  # tower index -> its _Alike, when first asked

  def is_leaf(self, tensor) -> bool:
    """Whether `tensor` is a tensor of tower 0's shard (a sparse one's
    values included)."""
    return tensor.ref() in self._leaves[0]

  def of(self, tensor, index) -> tf.Tensor:
    """Tower `index`'s tensor for tower 0's `tensor`."""
    leaf = self._leaves[index].get(tensor.ref())
    if leaf is not None:
      return leaf
    if index == 0:
      return tensor
    other = self._alike_of(index).ops.get(
        self._alike_of(0).keys.get(tensor.op))
    if (other is None or other.type != tensor.op.type or
        len(other.outputs) != len(tensor.op.outputs)):
      raise NotFound()
    return other.outputs[tensor.value_index]

  def summed(self, tensor, position: Optional[int] = None) -> tf.Tensor:
    """The towers' counts `tensor` (their entry `position`) summed."""
    parts = []
    for index, tower in enumerate(self._towers):
      if tower.has_rows is False:
        continue  # a stand-in row
      part = self.of(tensor, index)
      part = part if position is None else part[position]
      parts.append(sharding.zero_unless_rows(part, tower.has_rows))
    return tf.math.add_n(parts)

  def concatenated(self, tensor, axis: int) -> tf.Tensor:
    """The towers' tensors along their rows' `axis`, in tower order."""
    parts = []
    for index, tower in enumerate(self._towers):
      if tower.has_rows is False:
        continue  # a stand-in row
      part = self.of(tensor, index)
      if part.shape.rank is None:
        raise NotFound()
      if not isinstance(tower.has_rows, bool):
        count = tf.where(tower.has_rows, tf.shape(part)[axis], 0)
        part = tf.gather(part, tf.range(count), axis=axis)
      parts.append(part)
    if axis == 0:
      return concat_padded(parts)
    return tf.concat(parts, axis=axis)

  def _alike_of(self, index) -> "_Alike":
    if index not in self._alike:
      self._alike[index] = _Alike(self._progress.tower_ops[index], index,
                                  self._progress)
    return self._alike[index]


class _Alike:
  """Tower `index`'s ops by what makes them tower 0's counterparts: their
  scope, type and base name (tower 0's names, without TensorFlow's `_N`),
  and their rank among the tower's ops of that key, in build order.

  Not by full name: tower 0's unique names, in the outer scope, count the
  split's ops too (`strided_slice_6` there is `tower_1/strided_slice`).
  """

  def __init__(self, ops, index, progress):
    self.keys = {}  # op -> its key
    self.ops = {}  # key -> op
    counts = {}
    for op in ops:
      if op in progress.own_ops or op in progress.update_built:
        continue
      name = layout_lib.to_tower0_name(op.name, index)
      scope, _, base = name.rpartition("/")
      group = (scope, _UNIQUIFIED.sub("", base), op.type)
      rank = counts.get(group, 0)
      counts[group] = rank + 1
      self.keys[op] = group + (rank,)
      self.ops[group + (rank,)] = op


def concat_padded(tensors):
  """The towers' values along dimension 0, each first padded to the widest.

  A dimension past 0 that the towers' static shapes do not agree on is
  padded, at run time, to the largest tower's size: zeros of the dtype (empty
  strings, False). A dimension every tower has statically the same stays
  as it is, and keeps its static size.
  """
  ranks = {t.shape.rank for t in tensors}
  if len(tensors) == 1 or None in ranks or len(ranks) != 1:
    return tf.concat(tensors, axis=0)
  rank = ranks.pop()
  open_dims = [
      dim for dim in range(1, rank)
      if len({tf.compat.dimension_value(t.shape[dim]) for t in tensors}) != 1
      or tf.compat.dimension_value(tensors[0].shape[dim]) is None]
  if not open_dims:
    return tf.concat(tensors, axis=0)
  with tf.name_scope("padded_to_widest_tower"):
    shapes = [tf.shape(t) for t in tensors]
    widest = {dim: tf.reduce_max(tf.stack([s[dim] for s in shapes]))
              for dim in open_dims}
    fill = _zero_of(tensors[0].dtype)
    padded = []
    for tensor, shape in zip(tensors, shapes):
      paddings = [[0, widest[dim] - shape[dim]] if dim in widest else [0, 0]
                  for dim in range(rank)]
      padded.append(tf.pad(tensor, paddings, constant_values=fill))
    return tf.concat(padded, axis=0)


def _zero_of(dtype):
  if dtype == tf.string:
    return ""
  if dtype == tf.bool:
    return False
  return tf.zeros([], dtype)


def _row_leaves(shard, other) -> dict:
  """{tower 0's shard tensor ref: tower i's}: dense leaves, a sparse
  tensor's values (its indices and shape are positions, not rows)."""
  found = {}
  for leaf, counterpart in zip(tf.nest.flatten(shard),
                               tf.nest.flatten(other)):
    if isinstance(leaf, tf.SparseTensor):
      leaf, counterpart = leaf.values, counterpart.values
    if isinstance(leaf, tf.Tensor) and leaf.shape.rank != 0:
      found[leaf.ref()] = counterpart
  return found

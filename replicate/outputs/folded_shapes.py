"""The whole batch's value of a shape TensorFlow folded to a constant.

On why: on a batch of known size TensorFlow folds `tf.shape(x)`,
`tf.size(x)` and `tf.ones_like(x)` of the rows to constants when it builds
tower 0's ops: each holds the shard's rows, not the batch's. Built again on
the whole batch (`replicate.outputs.whole_batch`), they must count every
row.

On how: a `Shape` or `Size` is read off the towers' constants: an entry
that is each tower's rows times one `k` is the whole batch's rows times
`k`; one the same in every tower of unequal shards is no count of rows and
stays. A folded `ones_like` or `zeros_like` of rows is the towers'
concatenated. Where the towers cannot tell (every tower holds one row) or
the constant is no shape, it is refused (`whole_batch.CannotBuild`).
"""

import numpy as np
import tensorflow as tf

from replicate.outputs import counterparts
from replicate.shard import rows as rows_lib


class NotTold(Exception):
  """The whole batch's value of a folded constant cannot be told."""


def whole(tensor, towers_of, layout) -> tf.Tensor:
  """The whole batch's value of tower 0's folded `tensor`.

  `towers_of`: a `replicate.outputs.counterparts.Counterparts`.
  Raises `NotTold`.
  """
  kind = rows_lib.folded_shape_kind(tensor.op)
  sizes = layout.shards.sizes
  if kind in ("ones_like", "zeros_like") and tensor.shape.rank:
    try:
      return towers_of.concatenated(tensor, 0)
    except counterparts.NotFound:
      raise NotTold()
  if kind not in ("Shape", "Size") or not isinstance(sizes, list):
    raise NotTold()
  towers = [index for index in range(layout.num_towers) if sizes[index]]
  try:
    values = [tf.get_static_value(towers_of.of(tensor, index))
              for index in towers]
  except counterparts.NotFound:
    raise NotTold()
  if any(value is None for value in values):
    raise NotTold()
  rows = np.array([sizes[index] for index in towers])
  stacked = np.stack([np.reshape(value, [-1]) for value in values])
  entries = [_whole_entry(stacked[:, entry], rows)
             for entry in range(stacked.shape[1])]
  if any(entry is None for entry in entries):
    raise NotTold()
  value = np.reshape(np.array(entries), np.shape(values[0]))
  return tf.constant(value.astype(values[0].dtype), tensor.dtype)


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

"""Splitting a batch into one shard per tower, and each shard's weight.

On sharding: every dense tensor (or numpy value) and every `SparseTensor` in
`features` and `labels` is split along dimension 0 into N contiguous shards, in
order. When the batch size n does not divide evenly, the first `n % N` shards
get one extra row; when n < N, the last towers get no rows at all. The
leaves and their batch size are read by `replicate.shard.batch_leaves`.

On towers without rows: such a tower is built on a stand-in, a copy of the
batch's first row, because much model code cannot run on an empty batch
(feature columns reshape to `[batch, -1]`, which fails on 0 rows). Its weight
is 0 and everything it computes is discarded: its loss and gradients (see
`aggregation`), its metric updates and its predictions (see `specs`). A
batch known to be empty when the graph is built has no row to stand in:
every tower gets it empty, and tower 0's outputs count, as the unwrapped
`model_fn`'s would.

On shares: tower i's share of the batch is `n_i / n`; with an averaging
loss reduction it is the tower's loss weight (with `Reduction.SUM` every
tower's loss counts fully), so that the weighted sum of per-shard means is
the mean over the whole batch. A batch found empty at run time gives every
tower share 0, never NaN; one known to be empty gives tower 0 share 1.
"""

from typing import Any, List, NamedTuple, Optional, Tuple, Union

import tensorflow as tf

from replicate.shard import batch_leaves


class Shards(NamedTuple):
  """One batch split for N towers."""
  features: List[Any]  # features[i] is tower i's features
  labels: List[Any]  # labels[i] is tower i's labels (None when labels are)
  sizes: Union[tf.Tensor, List[int]]  # real rows per tower, int32 [N]
  batch_size: Union[tf.Tensor, int]
  may_stand_in: bool  # whether a tower may be built on a stand-in row
  # In PREDICT with batch sizes known only at run time, each leaf is split
  # by its own rows: per leaf, (tower 0's part of it, the leaf's sizes).
  # None when every leaf is split by `sizes`.
  leaf_sizes: Optional[List[Tuple[Any, Any]]] = None

  def shares(self, total_rows: Any = None) -> List[Any]:
    """Each shard's share of `total_rows` (default: the batch's), `n_i / n`
    (`shard_shares`)."""
    return shard_shares(
        self.sizes, self.batch_size if total_rows is None else total_rows)

  def has_rows(self) -> List[Any]:
    """Whether each shard's outputs count (`shard_has_rows`)."""
    return shard_has_rows(self.sizes)


def split_batch(features, labels, num_shards: int,
                is_prediction: bool = False) -> Shards:
  """Splits `features` and `labels` (tensors, numpy values, nested dicts).

  Step 1's hand-off to step 2: what each tower is built on.

  With `is_prediction`, features whose dimension 0 turns out to disagree at
  run time are each split by their own rows, where training and evaluation
  refuse them: each prediction is put back with the rows of the feature it
  is computed from (see `replicate.outputs.predictions`), as unwrapped.

  Args:
    features: the batch's features, as the `input_fn` gave them.
    labels: its labels, or None.
    num_shards: how many towers.
    is_prediction: whether the call is PREDICT (features split by their
      own rows when their batch sizes are known only at run time).

  Returns:
    The `Shards`: per tower its features and labels (the same structures),
    the rows per tower (`sizes`), the batch size, and whether a tower may
    be built on a stand-in row.

  Raises:
    ValueError: no tensor to split, or leaves whose batch sizes disagree.
  """
  features = batch_leaves.to_tensors("features", features)
  labels = batch_leaves.to_tensors("labels", labels)
  named_leaves = (batch_leaves.named_leaves("features", features) +
                  batch_leaves.named_leaves("labels", labels))
  if not named_leaves:
    raise ValueError(
        "features and labels hold no tensor to split into {} shards; "
        "replicate_model_fn needs batch-major tensors in features. "
        "Received features={!r}, labels={!r}.".format(
            num_shards, features, labels))
  batch_size = batch_leaves.batch_size_of(named_leaves,
                                          is_checked=not is_prediction)
  sizes = shard_sizes(batch_size, num_shards)
  may_stand_in = not (isinstance(sizes, list) and all(sizes))
  if is_prediction and not isinstance(batch_size, int):
    return _split_by_own_rows(features, labels, num_shards, sizes, batch_size)
  ranges = _row_ranges(sizes, num_shards)
  split = lambda structure: _split_structure(
      structure, lambda value: _split_one(value, sizes, ranges, may_stand_in),
      num_shards)
  return Shards(split(features),
                [None] * num_shards if labels is None else split(labels),
                sizes, batch_size, may_stand_in)


def _split_by_own_rows(features, labels, num_shards, sizes, batch_size):
  """Each leaf split by its own dimension 0 (PREDICT, sizes known late)."""
  leaf_sizes = []

  def split_one(value):
    own_sizes = shard_sizes(batch_leaves.dynamic_dim0(value), num_shards)
    parts = _split_one(value, own_sizes, _row_ranges(own_sizes, num_shards),
                       may_stand_in=True)
    leaf_sizes.append((parts[0], own_sizes))
    return parts

  split = lambda structure: _split_structure(structure, split_one, num_shards)
  return Shards(split(features),
                [None] * num_shards if labels is None else split(labels),
                sizes, batch_size, True, leaf_sizes)


def shard_sizes(batch_size, num_shards: int):
  """Rows per shard: `n // N` each, plus one for the first `n % N`."""
  if isinstance(batch_size, int):
    base, extra = divmod(batch_size, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]
  base = batch_size // num_shards
  extra = batch_size % num_shards
  return base + tf.cast(tf.range(num_shards) < extra, tf.int32)


def shard_shares(sizes, batch_size) -> List[Any]:
  """Each shard's share of the batch, `n_i / n`.

  A batch known to be empty is all tower 0's (see `shard_has_rows`): its
  share is 1, the others' 0. One empty at run time gives every shard 0.
  """
  num_shards = _num_shards(sizes)
  if isinstance(batch_size, int):
    if not batch_size:
      return [1.0] + [0.0] * (num_shards - 1)
    return [size / batch_size for size in sizes]
  shares = tf.math.divide_no_nan(
      tf.cast(sizes, tf.float32), tf.cast(batch_size, tf.float32))
  return tf.unstack(shares, num=num_shards, name="tower_shares")


def weight_as(weight, dtype) -> tf.Tensor:
  """A share or weight (Python number or tensor) as a tensor of `dtype`.

  A Python number becomes a constant of `dtype` directly: `tf.cast` would
  make a float32 of it first, and a float64 model would weigh 7/13 to
  float32's precision.
  """
  if isinstance(weight, (int, float)):
    return tf.constant(weight, dtype)
  return tf.cast(weight, dtype)


def _num_shards(sizes) -> int:
  if isinstance(sizes, list):
    return len(sizes)
  return batch_leaves.static_dim0(sizes)


def shard_has_rows(sizes) -> List[Any]:
  """Whether each shard's outputs count (Python bools when known).

  A shard counts when it has at least one row. A batch known to be empty
  when the graph is built counts in tower 0, as the whole batch: tower 0
  runs the model_fn on it exactly as unwrapped (its loss, its zero
  gradients: a no-op step that still advances the global step), where
  discarding every tower would leave no gradient at all to apply.
  """
  if isinstance(sizes, list):
    if not any(sizes):
      return [True] + [False] * (len(sizes) - 1)
    return [size > 0 for size in sizes]
  return tf.unstack(sizes > 0, num=_num_shards(sizes))


def zero_unless_rows(value, has_rows):
  """`value`, or zeros where its shard turned out to have no rows.

  Chosen with `Switch` and `Merge`, the two ops a TF 1 `cond` is made of:
  on a step where the shard has rows the tensor passes through as it is,
  with no copy (a `tf.where` copies every element of every tower's gradient
  on every step), and the zeros are made only on a step where it has none.
  Never multiplied by 0, which would keep a NaN a stand-in row produced.
  Placed with `value`, so the choice moves nothing between devices.
  `value` may be `IndexedSlices`; `has_rows` is a Python bool or a scalar
  bool tensor.
  """
  if isinstance(has_rows, bool):
    return value
  if isinstance(value, tf.IndexedSlices):
    return tf.IndexedSlices(zero_unless_rows(value.values, has_rows),
                            value.indices, value.dense_shape)
  with tf.device(value.device), tf.name_scope("zero_unless_rows"):
    without_rows, with_rows = tf.raw_ops.Switch(data=value, pred=has_rows)
    # A shape known when building makes zeros_like a constant, always live:
    # behind the untaken side's identity (as `cond`'s pivot), it is made
    # only when that side is taken.
    with tf.control_dependencies([tf.identity(without_rows).op]):
      zeros = tf.zeros_like(without_rows)
    chosen, _ = tf.raw_ops.Merge(inputs=[with_rows, zeros])
  chosen.set_shape(value.shape)
  return chosen


def _row_ranges(sizes, num_shards):
  """(first row, row count) per tower; a tower without rows gets row 0."""
  if isinstance(sizes, list):
    offsets = [sum(sizes[:i]) for i in range(num_shards)]
    return [(offset if size else 0, max(size, 1))
            for offset, size in zip(offsets, sizes)]
  starts = tf.where(sizes > 0, tf.cumsum(sizes, exclusive=True), 0)
  counts = tf.maximum(sizes, 1)
  return list(zip(tf.unstack(starts, num=num_shards),
                  tf.unstack(counts, num=num_shards)))


def _split_structure(structure, split_one, num_shards):
  split = [split_one(value) for value in tf.nest.flatten(structure)]
  return [tf.nest.pack_sequence_as(structure, [parts[i] for parts in split])
          for i in range(num_shards)]


def _split_one(value, sizes, ranges, may_stand_in):
  if isinstance(value, tf.SparseTensor):
    return [_sparse_rows(value, start, count) for start, count in ranges]
  if not may_stand_in:  # one op when every shard is known to have rows
    return tf.split(value, sizes, num=len(sizes), axis=0)
  return [value[start:start + count] for start, count in ranges]


def _sparse_rows(value, start, count):
  """Rows [start, start + count) of a SparseTensor.

  `tf.sparse.split` refuses a batch with fewer rows than shards, and
  `tf.sparse.slice` shrinks `dense_shape` to the last row holding a value;
  the shard keeps its full row count so it lines up with the dense features.
  """
  start = tf.cast(start, tf.int64)
  count = tf.cast(count, tf.int64)
  trailing_zeros = tf.zeros_like(value.dense_shape[1:])
  size = tf.concat([[count], value.dense_shape[1:]], axis=0)
  part = tf.sparse.slice(value, tf.concat([[start], trailing_zeros], axis=0),
                         size)
  return tf.SparseTensor(part.indices, part.values, size)

"""Splitting a batch into one shard per tower, and each shard's weight.

On sharding: every dense tensor (or numpy value) and every `SparseTensor` in
`features` and `labels` is split along dimension 0 into N contiguous shards, in
order. When the batch size n does not divide evenly, the first `n % N` shards
get one extra row; when n < N, the last towers get no rows at all.

On towers without rows: such a tower is built on a stand-in, a copy of the
batch's first row, because much model code cannot run on an empty batch
(feature columns reshape to `[batch, -1]`, which fails on 0 rows). Its weight
is 0 and everything it computes is discarded: its loss and gradients (see
`aggregation`), its metric updates and its predictions (see `specs`). A
batch known to be empty when the graph is built has no row to stand in:
every tower gets it empty, and tower 0's outputs count, as the unwrapped
`model_fn`'s would.

On weights: with `Reduction.SUM` every tower's loss counts fully (weight 1);
with any other reduction tower i's loss is weighted by `n_i / n`, so that the
weighted sum of per-shard means is the mean over the whole batch. A batch
found empty at run time gives every tower weight 0, never NaN; one known to
be empty gives tower 0 weight 1.
"""

from typing import Any, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

Reduction = tf.compat.v1.losses.Reduction


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


def split_batch(features, labels, num_shards: int,
                is_prediction: bool = False) -> Shards:
  """Splits `features` and `labels` (tensors, numpy values, nested dicts).

  With `is_prediction`, features whose dimension 0 turns out to disagree at
  run time are each split by their own rows, where training and evaluation
  refuse them: each prediction is put back with the rows of the feature it
  is computed from (see `replicate.outputs`), as unwrapped.
  """
  features = _to_tensors("features", features)
  labels = _to_tensors("labels", labels)
  named_leaves = (_named_leaves("features", features) +
                  _named_leaves("labels", labels))
  if not named_leaves:
    raise ValueError(
        "features and labels hold no tensor to split into {} shards; "
        "replicate_model_fn needs batch-major tensors in features. "
        "Received features={!r}, labels={!r}.".format(
            num_shards, features, labels))
  batch_size = _batch_size(named_leaves, is_checked=not is_prediction)
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
    own_sizes = shard_sizes(_dynamic_dim0(value), num_shards)
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


def shard_weights(sizes, batch_size, loss_reduction: str) -> List[Any]:
  """Each tower's loss weight: 1 for SUM, else its share `n_i / n`."""
  if loss_reduction == Reduction.SUM:
    return [1.0] * _num_shards(sizes)
  return shard_shares(sizes, batch_size)


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


def _num_shards(sizes) -> int:
  return len(sizes) if isinstance(sizes, list) else _static_dim0(sizes)


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


def _to_tensors(prefix, structure):
  """The same structure with every leaf a Tensor or SparseTensor."""
  if structure is None:
    return None
  leaves = [_as_tensor(name, value) for name, value in
            zip(_leaf_names(prefix, structure), tf.nest.flatten(structure))]
  return tf.nest.pack_sequence_as(structure, leaves)


def _named_leaves(prefix, structure):
  if structure is None:
    return []
  return list(zip(_leaf_names(prefix, structure), tf.nest.flatten(structure)))


def _leaf_names(prefix, structure):
  """A readable name per leaf, e.g. "features['age']", in tf.nest order."""
  if isinstance(structure, dict):
    return [name for key in sorted(structure)
            for name in _leaf_names("{}[{!r}]".format(prefix, key),
                                    structure[key])]
  if isinstance(structure, (list, tuple)) and tf.nest.is_nested(structure):
    return [name for index, value in enumerate(structure)
            for name in _leaf_names("{}[{}]".format(prefix, index), value)]
  return [prefix]


def _as_tensor(name, value):
  if isinstance(value, tf.RaggedTensor):
    raise ValueError(
        "{} is a RaggedTensor, which replicate_model_fn cannot split by row "
        "yet; convert it in the input_fn with .to_sparse() or "
        ".to_tensor().".format(name))
  if isinstance(value, (tf.SparseTensor, tf.compat.v1.SparseTensorValue)):
    return tf.compat.v1.convert_to_tensor_or_sparse_tensor(value)
  if isinstance(value, (np.ndarray, np.generic, list, tuple, int, float)):
    value = tf.convert_to_tensor(value)
  if not isinstance(value, tf.Tensor):
    raise ValueError(
        "{} is a {}; replicate_model_fn splits Tensors, numpy arrays and "
        "SparseTensors along dimension 0. Received: {!r}.".format(
            name, type(value).__name__, value))
  if value.shape.rank == 0:
    raise ValueError(
        "{} is a scalar ({!r}); replicate_model_fn splits every feature and "
        "label along dimension 0 (the batch), so each needs shape [batch, "
        "...]. Batch it in the input_fn or give it a leading dimension of "
        "the batch size.".format(name, value))
  return value


def _batch_size(named_leaves, is_checked=True):
  """The common dimension 0: a Python int when known, else a tensor.

  A tensor is checked at run time to be every leaf's dimension 0, unless
  not `is_checked` (then it is the first leaf's).
  """
  static = {}
  for name, value in named_leaves:
    dim = _static_dim0(value)
    if dim is not None:
      static.setdefault(dim, name)
  if len(static) > 1:
    (size_a, name_a), (size_b, name_b) = list(static.items())[:2]
    raise ValueError(
        "features and labels must share dimension 0 (the batch) to be split "
        "across towers, but {} has {} rows and {} has {}. Give every feature "
        "and label the same batch size.".format(name_a, size_a, name_b,
                                                size_b))
  if static and len(static) == 1 and all(
      _static_dim0(value) is not None for _, value in named_leaves):
    return next(iter(static))
  first_name, first = named_leaves[0]
  batch_size = _dynamic_dim0(first)
  if not is_checked:
    return batch_size
  checks = [
      tf.debugging.assert_equal(
          _dynamic_dim0(value), batch_size,
          message="replicate_model_fn: {} and {} must share dimension 0 (the "
          "batch) to be split across towers; give every feature and label the "
          "same batch size.".format(name, first_name))
      for name, value in named_leaves[1:]
  ]
  with tf.control_dependencies(checks):
    return tf.identity(batch_size, name="batch_size")


def _static_dim0(value):
  """Dimension 0 as an int, or None when unknown.

  Read through `dimension_value`: under TF 1 behaviour
  (`disable_v2_behavior`) `shape[0]` is a `Dimension`, unhashable, and
  `Dimension(None)` when unknown.
  """
  if isinstance(value, tf.SparseTensor):
    rows = tf.get_static_value(value.dense_shape[0])
    return None if rows is None else int(rows)
  return tf.compat.dimension_value(value.shape[0])


def _dynamic_dim0(value):
  if isinstance(value, tf.SparseTensor):
    return tf.cast(value.dense_shape[0], tf.int32)
  return tf.shape(value, out_type=tf.int32)[0]


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

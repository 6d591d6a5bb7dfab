"""A batch's leaves: their names, their conversion, their dimension 0.

`replicate.shard.sharding` splits every leaf of `features` and `labels` along
dimension 0; this module turns each leaf into a `Tensor` or `SparseTensor`
(numpy values too), names it for error messages (`features['age']`), and
finds the batch size they share, refusing with a clear error what cannot be
split by row: a scalar, a `RaggedTensor`, an unknown type, leaves whose
dimension 0 differ (when building, or checked at run time).
"""

import numpy as np
import tensorflow as tf


def to_tensors(prefix, structure):
  """The same structure with every leaf a Tensor or SparseTensor."""
  if structure is None:
    return None
  leaves = [_as_tensor(name, value) for name, value in
            zip(_leaf_names(prefix, structure), tf.nest.flatten(structure))]
  return tf.nest.pack_sequence_as(structure, leaves)


def named_leaves(prefix, structure):
  """(readable name, leaf) pairs of `structure`, in tf.nest order."""
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


def static_dim0(value):
  """Dimension 0 as an int, or None when unknown.

  Read through `dimension_value`: under TF 1 behaviour
  (`disable_v2_behavior`) `shape[0]` is a `Dimension`, unhashable, and
  `Dimension(None)` when unknown.
  """
  if isinstance(value, tf.SparseTensor):
    rows = tf.get_static_value(value.dense_shape[0])
    return None if rows is None else int(rows)
  return tf.compat.dimension_value(value.shape[0])


def dynamic_dim0(value):
  """Dimension 0 as an int32 tensor, read at run time."""
  if isinstance(value, tf.SparseTensor):
    return tf.cast(value.dense_shape[0], tf.int32)
  return tf.shape(value, out_type=tf.int32)[0]


def batch_size_of(leaves, is_checked=True):
  """The batch size all `leaves` share: an int when known, else a tensor.

  `leaves` are (name, leaf) pairs, as `named_leaves` makes them. A tensor is checked at run time to be every leaf's dimension 0, unless
  not `is_checked` (then it is the first leaf's).
  """
  static = {}
  for name, value in leaves:
    dim = static_dim0(value)
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
      static_dim0(value) is not None for _, value in leaves):
    return next(iter(static))
  first_name, first = leaves[0]
  batch_size = dynamic_dim0(first)
  if not is_checked:
    return batch_size
  checks = [
      tf.debugging.assert_equal(
          dynamic_dim0(value), batch_size,
          message="replicate_model_fn: {} and {} must share dimension 0 (the "
          "batch) to be split across towers; give every feature and label the "
          "same batch size.".format(name, first_name))
      for name, value in leaves[1:]
  ]
  with tf.control_dependencies(checks):
    return tf.identity(batch_size, name="batch_size")

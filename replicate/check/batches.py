"""The batches a check replays: the first `steps` of the user's input_fn.

On why: a run that reads the `input_fn` itself would see other rows than
one device when the input shuffles, repeats without end or draws at
random. The batches are read once, as numpy values, and every run is given
the same ones, through a `tf.data` pipeline (as the Estimator gives
batches: a `PREDICT` graph whose features are placeholders is a
SavedModel's, built as one tower).
"""

import inspect
from typing import Any, List, NamedTuple, Optional

import numpy as np
import tensorflow as tf


class Batch(NamedTuple):
  features: Any
  labels: Any  # None when the input_fn gives features only

  @property
  def rows(self) -> int:
    for leaf in tf.nest.flatten(self.features):
      if isinstance(leaf, tf.compat.v1.SparseTensorValue):
        return int(leaf.dense_shape[0])
      leaf = np.asarray(leaf)
      if leaf.ndim:
        return int(leaf.shape[0])
    return 0


def read(input_fn, steps: int, mode: str, params=None, config=None
         ) -> List[Batch]:
  """The first `steps` batches of `input_fn` (fewer if it ends first)."""
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(0)
    got = _call(input_fn, mode, params, config)
    if isinstance(got, tf.data.Dataset):
      got = tf.compat.v1.data.make_one_shot_iterator(got).get_next()
    features, labels = (got if isinstance(got, (tuple, list)) and
                        len(got) == 2 else (got, None))
    batches = []
    with tf.compat.v1.Session(graph=graph) as session:
      session.run(tf.compat.v1.tables_initializer())
      for _ in range(steps):
        try:
          value = session.run({"f": features, "l": labels}
                              if labels is not None else {"f": features})
        except tf.errors.OutOfRangeError:
          break
        batches.append(Batch(value["f"], value.get("l")))
  if not batches:
    raise ValueError(
        "replicate.check: the input_fn {!r} gave no batch. Fix: pass an "
        "input_fn that yields at least one batch.".format(input_fn))
  return batches


def _call(input_fn, mode, params, config):
  """Calls `input_fn` with what it takes of the Estimator's arguments."""
  names = inspect.signature(input_fn).parameters
  kwargs = {}
  if "mode" in names:
    kwargs["mode"] = mode
  if "params" in names:
    kwargs["params"] = params or {}
  if "config" in names:
    kwargs["config"] = config
  return input_fn(**kwargs)


def dataset(batches: List[Batch], with_labels: bool = True
            ) -> tf.data.Dataset:
  """A pipeline that yields `batches` in order, once."""
  def one(batch):
    features = tf.nest.map_structure(_as_tensor, batch.features)
    if with_labels and batch.labels is not None:
      return tf.data.Dataset.from_tensors(
          (features, tf.nest.map_structure(_as_tensor, batch.labels)))
    return tf.data.Dataset.from_tensors(features)

  found = one(batches[0])
  for batch in batches[1:]:
    found = found.concatenate(one(batch))
  return found


def next_batch(batches: List[Batch], with_labels: bool = True):
  """(features, labels) tensors of a new pipeline over `batches` (labels
  None when there are none)."""
  got = tf.compat.v1.data.make_one_shot_iterator(
      dataset(batches, with_labels)).get_next()
  if with_labels and batches[0].labels is not None:
    return got
  return got, None


def _as_tensor(value):
  if isinstance(value, tf.compat.v1.SparseTensorValue):
    return tf.SparseTensor(value.indices, value.values, value.dense_shape)
  return tf.constant(value)


def shard_rows(rows: int, towers: int) -> List[Optional[int]]:
  """Each tower's rows of a batch of `rows`, as the wrapper splits it: `n //
  N` each, one more for the first `n % N`."""
  base, extra = divmod(rows, towers)
  return [base + (1 if i < extra else 0) for i in range(towers)]

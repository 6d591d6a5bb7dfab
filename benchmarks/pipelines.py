"""The benchmark models' input pipelines: as users write them, and the fast one.

On the two pipelines:

- `dynamic` (the default, the path users take): in-memory numpy arrays
  through `Dataset.from_tensor_slices(...).shuffle(...).batch(b).repeat()`
  and `.prefetch(1)`. Dimension 0 of a batch is unknown to the graph
  (`.batch()` without `drop_remainder`), and the data set's size is not a
  multiple of any power-of-two batch, so each epoch ends with one partial
  batch, as a user's last batch does. For the canned `DNNClassifier` the
  arrays hold serialized `tf.train.Example`s, parsed with
  `tf.io.parse_example` after `.batch(b)`, as users of that estimator do.
- `static`: one fixed batch, `Dataset.from_tensors(batch).repeat()`, whose
  shape the graph knows; kept to measure what the dynamic path costs.

On the data set's size: `dataset_rows(global_batch)` is 20 global batches and
a quarter more plus one row, so an epoch is 20 full batches and one of a
quarter (for a batch of a power of two, a per-replica one too), and the
partial batch is one step in 21, a small part of any cell. The shuffle
buffer is 10 global batches and its seed is fixed, so every configuration
sees the same sequence of rows.

On `.prefetch(1)`: users are told to end a pipeline with it (the tf.data
performance guide, the official models, tf_cnn_benchmarks), so the dynamic
path has it; the static path has none because its one batch costs nothing
to produce.

On counting rows: a step does not always consume a full batch, so
examples/sec must count the rows the steps took, not steps x batch. Those
rows follow from the layout: with `.batch(b).repeat()` over `rows` rows, the
k-th batch has `b` rows unless it is an epoch's last, and a step takes one
batch (a MirroredStrategy step one batch per replica, handed out in turn).
`rows_per_step` computes them exactly from that; a test checks its sizes
against the data set's own, and once, with a `py_func` counting each
replica's rows inside an Estimator's MirroredStrategy model_fn, the
replicas' sums per step matched it.
"""

from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

PIPELINES = ("dynamic", "static")
_SEED = 0


def dataset_rows(global_batch: int) -> int:
  """Rows in every model's data set: 20 global batches, and a remainder."""
  return 20 * global_batch + global_batch // 4 + 1


def shuffle_buffer(global_batch: int) -> int:
  """Rows, not batches: the same under MirroredStrategy's smaller batch."""
  return 10 * global_batch


def arrays_input_fn(arrays: Dict[str, np.ndarray], label: str, pipeline: str,
                    batch: int, global_batch: int,
                    parse: Optional[Callable] = None) -> Callable:
  """An input_fn over in-memory `arrays` (a dict, rows first).

  `label` names the labels' array; the features are the one other array, or
  a dict of the others if there are several. `parse(serialized_batch)`, if
  given, turns the batched `"serialized"` array into the features dict (the
  dynamic path parses after batching; the static path's batch is parsed
  once, ahead).
  """
  _check_pipeline(pipeline)
  if pipeline == "static":
    # Parsed here, eagerly: the input_fn runs inside the Estimator's graph.
    batch_columns = {name: np.asarray(values) for name, values in
                     _parsed(_head(arrays, batch), parse).items()}
    return lambda: tf.data.Dataset.from_tensors(
        _split(batch_columns, label)).repeat()

  def input_fn():
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    dataset = dataset.shuffle(shuffle_buffer(global_batch), seed=_SEED)
    dataset = dataset.batch(batch)
    dataset = dataset.map(lambda columns: _split(_parsed(columns, parse),
                                                 label))
    return dataset.repeat().prefetch(1)

  return input_fn


def rows_per_step(pipeline: str, rows: int, batch: int,
                  batches_per_step: int, first_step: int,
                  steps: int) -> List[int]:
  """Rows each of `steps` steps from `first_step` (0-based) takes.

  `batches_per_step` is 1, or the number of replicas under MirroredStrategy
  (each replica takes the next batch in turn).
  """
  _check_pipeline(pipeline)
  if pipeline == "static":
    return [batch * batches_per_step] * steps
  batches_per_epoch = -(-rows // batch)
  remainder = rows - (batches_per_epoch - 1) * batch

  def batch_rows(index):
    is_last = index % batches_per_epoch == batches_per_epoch - 1
    return remainder if is_last else batch

  return [sum(batch_rows(step * batches_per_step + replica)
              for replica in range(batches_per_step))
          for step in range(first_step, first_step + steps)]


def _check_pipeline(pipeline):
  if pipeline not in PIPELINES:
    raise ValueError("Unknown pipeline {!r}; the pipelines are: {}.".format(
        pipeline, ", ".join(PIPELINES)))


def _head(arrays, batch):
  return {name: values[:batch] for name, values in arrays.items()}


def _parsed(columns, parse):
  """`columns` with its `"serialized"` column parsed into features."""
  if not parse:
    return columns
  parsed = dict(parse(columns["serialized"]))
  parsed.update((name, values) for name, values in columns.items()
                if name != "serialized")
  return parsed


def _split(columns, label):
  features = {name: v for name, v in columns.items() if name != label}
  if len(features) == 1:
    (features,) = features.values()
  return features, columns[label]

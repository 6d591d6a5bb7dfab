"""Input pipelines and serving receivers of the oracle, from a model's data.

Every pipeline reads the same rows in the same order, so the wrapped and
the unwrapped estimator see the same batches:
- "from_tensors": `Dataset.from_tensors` of all the rows (a static batch);
- "batch": `.batch(b)`, a remainder batch at the end (7 rows: 3, 3, 1);
- "drop_remainder": `.batch(b, drop_remainder=True)` (static: 3, 3);
- "repeat": `.repeat().batch(b)`, endless; a fixed number of steps;
- "numpy_input_fn": `tf.compat.v1.estimator.inputs.numpy_input_fn` (queues);
- "tf_example": serialized `tf.Example`s, `.batch(b)`, then
  `tf.io.parse_example` (`VarLenFeature`s become `SparseTensor`s).
TRAIN reads the finite pipelines twice (`.repeat(2)` / `num_epochs=2`) so
that every cell trains at least two steps; EVAL and PREDICT read them once.
Sparse features (`ZooModel.sparse_keys`) are `SparseTensor`s in the tf.data
pipelines and the 0-padded dense arrays in `numpy_input_fn`.
"""

import base64
from typing import Callable, Optional, Tuple

import numpy as np
import tensorflow as tf

PIPELINES = ("from_tensors", "batch", "drop_remainder", "repeat",
             "numpy_input_fn", "tf_example")
TRAIN_EPOCHS = 2
REPEAT_STEPS = {"train": 3, "eval": 2}
LABEL = "label"


def input_fn(pipeline: str, model, rows: int, batch: int, mode: str
             ) -> Tuple[Callable, Optional[int], Optional[int]]:
  """(input_fn, steps, limit): `limit` is how many predictions to read."""
  features, labels = _rows(model, rows)
  if mode == "predict":
    labels = None
  epochs = TRAIN_EPOCHS if mode == "train" else 1
  steps = REPEAT_STEPS.get(mode) if pipeline == "repeat" else None
  limit = 2 * batch if pipeline == "repeat" and mode == "predict" else None
  if pipeline == "numpy_input_fn":
    return tf.compat.v1.estimator.inputs.numpy_input_fn(
        features, labels, batch_size=batch, shuffle=False,
        num_epochs=epochs), steps, limit
  if pipeline == "tf_example":
    return _example_input_fn(model, features, labels, batch, epochs), steps, limit

  def make():
    element = _tensors(model, features)
    if labels is not None:
      element = (element, tf.constant(labels))
    if pipeline == "from_tensors":
      return tf.data.Dataset.from_tensors(element).repeat(epochs)
    dataset = tf.data.Dataset.from_tensor_slices(element)
    if pipeline == "repeat":
      return dataset.repeat().batch(batch)
    return dataset.batch(
        batch, drop_remainder=pipeline == "drop_remainder").repeat(epochs)

  return make, steps, limit


def serialized_examples(model, rows: int = None) -> list:
  """The model's rows (labels included) as serialized `tf.Example`s."""
  features, labels = _rows(model, rows)
  columns = dict(features)
  if labels is not None:
    columns[LABEL] = labels
  count = len(next(iter(columns.values())))
  return [_example(model, {key: value[row] for key, value in columns.items()})
          for row in range(count)]


def serving_receiver(model, pipeline: str) -> Callable:
  """Parsed `tf.Example`s for the "tf_example" pipeline, else raw tensors."""
  if pipeline == "tf_example":
    spec = {key: value for key, value in model.example_spec.items()
            if key in model.serving_keys}
    return tf.estimator.export.build_parsing_serving_input_receiver_fn(spec)
  features, _ = model.data
  return tf.estimator.export.build_raw_serving_input_receiver_fn(
      {key: tf.constant(features[key][:1]) for key in model.serving_keys})


def serving_request(model, rows: int) -> dict:
  """What the serving process feeds: raw columns and serialized examples."""
  features, _ = _rows(model, rows)
  raw = {}
  for key in model.serving_keys:
    value = features[key]
    if value.dtype == object:
      value = np.vectorize(lambda b: b.decode())(value)
    raw[key] = value.tolist()
  examples = [base64.b64encode(e).decode()
              for e in serialized_examples(model, rows)]
  return {"raw": raw, "examples": examples}


def _rows(model, rows):
  features, labels = model.data
  features = {key: value[:rows] for key, value in features.items()}
  return features, None if labels is None else labels[:rows]


def _tensors(model, features):
  return {key: _sparse(value) if key in model.sparse_keys else
          tf.constant(value) for key, value in features.items()}


def _sparse(dense):
  indices = np.argwhere(dense != 0)
  return tf.SparseTensor(indices.astype(np.int64), dense[dense != 0],
                         np.array(dense.shape, np.int64))


def _example_input_fn(model, features, labels, batch, epochs):
  examples = serialized_examples(model, len(next(iter(features.values()))))
  spec = dict(model.example_spec)
  if labels is None:
    spec.pop(LABEL, None)

  def parse(serialized):
    parsed = tf.io.parse_example(serialized, spec)
    if labels is None:
      return parsed
    label = parsed.pop(LABEL)
    return parsed, label

  def make():
    return tf.data.Dataset.from_tensor_slices(examples).batch(batch).repeat(
        epochs).map(parse)

  return make


def _example(model, row):
  feature = {}
  for key, value in row.items():
    if key not in model.example_spec:
      continue
    value = np.asarray(value).ravel()
    if key in model.sparse_keys:
      value = value[value != 0]
    if value.dtype == object or value.dtype.kind == "S":
      feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(
          value=[bytes(v) for v in value]))
    elif value.dtype.kind in "iu":
      feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(
          value=value.tolist()))
    else:
      feature[key] = tf.train.Feature(float_list=tf.train.FloatList(
          value=value.tolist()))
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()

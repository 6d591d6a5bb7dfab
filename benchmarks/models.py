"""The benchmark models and their synthetic in-memory data.

Each model is a `model_fn` builder plus its data: random arrays of
`pipelines.dataset_rows(global_batch)` rows, made with a fixed seed, so that
every configuration trains on the same rows. `make_input_fn(pipeline,
batch)` gives an `input_fn` of batches of `batch` rows (the global batch, or
the per-replica batch under MirroredStrategy) on either pipeline of
`benchmarks.pipelines`.

On the DNNClassifier's features: a user of the canned estimator reads
`tf.train.Example`s and declares feature columns, so its data is serialized
Examples with a numeric image `x`, a numeric `age` that the model
bucketizes, an `occupation` from a vocabulary list (an indicator column) and
a `city` hashed into buckets (an embedding column): the four kinds of
column whose transformations run inside each tower.
"""

import functools
from typing import Callable, Dict, NamedTuple, Optional

import numpy as np
import tensorflow as tf

import replicate
from benchmarks import configs, pipelines

WIDE_VOCABULARY = 100_000
WIDE_IDS_PER_ROW = 8


class Model(NamedTuple):
  """A benchmark model: how to build the estimator's model_fn and its data."""
  description: str
  global_batch: int
  # make_model_fn(wrap_optimizer) -> model_fn; for the canned estimator the
  # model_fn of a fresh DNNClassifier.
  make_model_fn: Callable[[bool], Callable]
  # make_arrays(rows, rng) -> {name: array}, the labels under "y"
  make_arrays: Callable[[int, np.random.RandomState], Dict[str, np.ndarray]]
  # parse(serialized batch) -> features, when the arrays hold Examples
  parse: Optional[Callable] = None

  def make_input_fn(self, pipeline: str, batch: int) -> Callable:
    """An input_fn of `batch`-row batches on `pipeline` (dynamic or static)."""
    return pipelines.arrays_input_fn(_arrays(self), "y", pipeline, batch,
                                     self.global_batch, self.parse)


@functools.lru_cache(maxsize=None)
def _arrays(model):
  """The model's data, made once a process (Examples take seconds)."""
  return model.make_arrays(pipelines.dataset_rows(model.global_batch),
                           np.random.RandomState(0))


def _optimizer(wrap, learning_rate=0.01):
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(learning_rate)
  return replicate.TowerOptimizer(optimizer) if wrap else optimizer


def _classifier_spec(mode, logits, labels, wrap):
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = _optimizer(wrap).minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _mlp(wrap):

  def model_fn(features, labels, mode):
    hidden = features
    for index in range(2):
      hidden = tf.compat.v1.layers.dense(hidden, 1024, tf.nn.relu,
                                         name="hidden_{}".format(index))
    logits = tf.compat.v1.layers.dense(hidden, 10, name="logits")
    return _classifier_spec(mode, logits, labels, wrap)

  return model_fn


def _convnet(wrap):

  def model_fn(features, labels, mode):
    images = tf.reshape(features, [-1, 28, 28, 1])
    conv = tf.compat.v1.layers.conv2d(images, 32, 5, activation=tf.nn.relu,
                                      name="conv_0")
    conv = tf.compat.v1.layers.max_pooling2d(conv, 2, 2)
    conv = tf.compat.v1.layers.conv2d(conv, 64, 5, activation=tf.nn.relu,
                                      name="conv_1")
    conv = tf.compat.v1.layers.max_pooling2d(conv, 2, 2)
    hidden = tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(conv), 256,
                                       tf.nn.relu, name="hidden")
    logits = tf.compat.v1.layers.dense(hidden, 10, name="logits")
    return _classifier_spec(mode, logits, labels, wrap)

  return model_fn


def _bn_convnet(fused):
  """Four conv + batch norm blocks, for `sync_batch_norm`'s cost.

  `fused` picks the batch-norm kernel: the fused one (the default of
  `tf.compat.v1.layers` on images) or plain math ops.
  """

  def make_model_fn(wrap):

    def model_fn(features, labels, mode):
      hidden = tf.reshape(features, [-1, 28, 28, 1])
      for index, (filters, strides) in enumerate([(16, 1), (32, 2),
                                                  (32, 1), (64, 2)]):
        hidden = tf.compat.v1.layers.conv2d(
            hidden, filters, 3, strides, padding="same", use_bias=False,
            name="conv_{}".format(index))
        hidden = tf.nn.relu(tf.compat.v1.layers.batch_normalization(
            hidden, training=mode == tf.estimator.ModeKeys.TRAIN,
            fused=fused, name="bn_{}".format(index)))
      logits = tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(hidden),
                                         10, name="logits")
      with tf.control_dependencies(tf.compat.v1.get_collection(
          tf.compat.v1.GraphKeys.UPDATE_OPS)):
        return _classifier_spec(mode, logits, labels, wrap)

    return model_fn

  return make_model_fn


def _wide(wrap):

  def model_fn(features, labels, mode):
    table = tf.compat.v1.get_variable(
        "embedding", [WIDE_VOCABULARY, 16],
        initializer=tf.compat.v1.random_normal_initializer(stddev=0.01))
    # A gather: IndexedSlices gradients, as a wide model's embedding has.
    embedded = tf.reduce_sum(tf.nn.embedding_lookup(table, features), axis=1)
    logits = tf.compat.v1.layers.dense(embedded, 2, name="logits")
    return _classifier_spec(mode, logits, labels, wrap)

  return model_fn


_AGE_BOUNDARIES = [25.0, 35.0, 45.0, 55.0, 65.0]
_OCCUPATIONS = ["clerk", "driver", "engineer", "farmer", "nurse", "teacher",
                "writer", "other"]
_CITY_BUCKETS = 1000


def _dnn_classifier(wrap):
  optimizer = lambda: tf.keras.optimizers.legacy.Adagrad(0.05)  # noqa: E731
  canned = tf.estimator.DNNClassifier(
      hidden_units=[256, 128],
      feature_columns=_feature_columns(),
      n_classes=10,
      optimizer=replicate.TowerOptimizer(optimizer) if wrap else optimizer)
  return canned.model_fn


def _feature_columns():
  column = tf.feature_column
  return [
      column.numeric_column("x", shape=[784]),
      column.bucketized_column(column.numeric_column("age"),
                               _AGE_BOUNDARIES),
      column.indicator_column(column.categorical_column_with_vocabulary_list(
          "occupation", _OCCUPATIONS)),
      column.embedding_column(column.categorical_column_with_hash_bucket(
          "city", _CITY_BUCKETS), dimension=8),
  ]


def _dense_arrays(rows, rng):
  return {"x": rng.rand(rows, 784).astype(np.float32),
          "y": rng.randint(0, 10, size=rows).astype(np.int64)}


def _ids_arrays(rows, rng):
  return {"ids": rng.randint(0, WIDE_VOCABULARY,
                             size=(rows, WIDE_IDS_PER_ROW)).astype(np.int64),
          "y": rng.randint(0, 2, size=rows).astype(np.int64)}


def _example_arrays(rows, rng):
  """Serialized Examples of the DNNClassifier's four features, and labels."""
  x = rng.rand(rows, 784).astype(np.float32)
  age = rng.uniform(18, 80, size=rows).astype(np.float32)
  occupation = rng.choice(_OCCUPATIONS + ["unknown"], size=rows)
  city = ["city_{}".format(i) for i in rng.randint(0, 5000, size=rows)]

  def example(row):
    feature = tf.train.Feature
    return tf.train.Example(features=tf.train.Features(feature={
        "x": feature(float_list=tf.train.FloatList(value=x[row].tolist())),
        "age": feature(float_list=tf.train.FloatList(value=[age[row]])),
        "occupation": feature(bytes_list=tf.train.BytesList(
            value=[occupation[row].encode()])),
        "city": feature(bytes_list=tf.train.BytesList(
            value=[city[row].encode()])),
    })).SerializeToString()

  return {"serialized": np.array([example(row) for row in range(rows)],
                                 dtype=object),
          "y": rng.randint(0, 10, size=rows).astype(np.int64)}


def _parse_examples(serialized):
  return tf.io.parse_example(serialized, {
      "x": tf.io.FixedLenFeature([784], tf.float32),
      "age": tf.io.FixedLenFeature([1], tf.float32),
      "occupation": tf.io.FixedLenFeature([1], tf.string),
      "city": tf.io.FixedLenFeature([1], tf.string),
  })


MODELS: Dict[str, Model] = {
    "mlp": Model("MLP 784-1024-1024-10", 256, _mlp, _dense_arrays),
    "wide": Model("wide: 100,000 x 16 embedding, 8 ids a row", 256, _wide,
                  _ids_arrays),
    "convnet": Model("convnet: 2 conv + 1 dense on 28x28", 64, _convnet,
                     _dense_arrays),
    "dnn_classifier": Model(
        "canned tf.estimator.DNNClassifier [256, 128] on parsed Examples",
        256, _dnn_classifier, _example_arrays, _parse_examples),
    "bn_convnet": Model(
        "bn_convnet: 4 conv + fused batch norm on 28x28, then dense", 64,
        _bn_convnet(fused=True), _dense_arrays),
    "bn_convnet_plain": Model(
        "bn_convnet_plain: bn_convnet with non-fused batch norm", 64,
        _bn_convnet(fused=False), _dense_arrays),
}
DEFAULT_MODELS = configs.DEFAULT_MODELS  # what `python -m benchmarks` runs

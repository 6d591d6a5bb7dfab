"""The benchmark models and their synthetic in-memory input.

Each model is a `model_fn` builder plus an input of one fixed batch repeated
forever, so that every configuration trains on the same data: the
`input_fn` makes a batch of `batch_size` rows (the global batch, or the
per-replica batch under MirroredStrategy).
"""

from typing import Callable, Dict, NamedTuple

import numpy as np
import tensorflow as tf

import replicate

WIDE_VOCABULARY = 100_000
WIDE_IDS_PER_ROW = 8


class Model(NamedTuple):
  """A benchmark model: how to build the estimator's model_fn and its input."""
  description: str
  global_batch: int
  measured_steps: int  # steps timed per cell in the full run (about 1 s)
  # make_model_fn(wrap_optimizer) -> model_fn; for the canned estimator the
  # model_fn of a fresh DNNClassifier.
  make_model_fn: Callable[[bool], Callable]
  make_input_fn: Callable[[int], Callable]


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


def _dnn_classifier(wrap):
  optimizer = lambda: tf.keras.optimizers.legacy.Adagrad(0.05)  # noqa: E731
  canned = tf.estimator.DNNClassifier(
      hidden_units=[256, 128],
      feature_columns=[tf.feature_column.numeric_column("x", shape=[784])],
      n_classes=10,
      optimizer=replicate.TowerOptimizer(optimizer) if wrap else optimizer)
  return canned.model_fn


def _dense_input(rows, width, classes, as_dict=False):
  """One fixed batch of `rows` random rows, repeated forever."""
  rng = np.random.RandomState(0)
  x = rng.rand(rows, width).astype(np.float32)
  y = rng.randint(0, classes, size=rows).astype(np.int64)

  def input_fn():
    features = {"x": x} if as_dict else x
    return tf.data.Dataset.from_tensors((features, y)).repeat()

  return input_fn


def _ids_input(rows):
  rng = np.random.RandomState(0)
  ids = rng.randint(0, WIDE_VOCABULARY,
                    size=(rows, WIDE_IDS_PER_ROW)).astype(np.int64)
  y = rng.randint(0, 2, size=rows).astype(np.int64)
  return lambda: tf.data.Dataset.from_tensors((ids, y)).repeat()


MODELS: Dict[str, Model] = {
    "mlp": Model("MLP 784-1024-1024-10", 256, 60, _mlp,
                 lambda rows: _dense_input(rows, 784, 10)),
    "wide": Model("wide: 100,000 x 16 embedding, 8 ids a row", 256, 1500,
                  _wide,
                  _ids_input),
    "convnet": Model("convnet: 2 conv + 1 dense on 28x28", 64, 100, _convnet,
                     lambda rows: _dense_input(rows, 784, 10)),
    "dnn_classifier": Model("canned tf.estimator.DNNClassifier [256, 128]",
                            256, 300, _dnn_classifier,
                            lambda rows: _dense_input(rows, 784, 10, True)),
}

"""The across-workers jobs' models: the dense MLP and the CTR model.

Both are the same shape: inputs (the MLP's features, or the CTR model's
embedded fields), ReLU layers of `hidden` units, a loss, and one optimizer
that `wrap(optimizer)` turns into the approach's (`TowerOptimizer`,
`SyncReplicasOptimizer` and its hook, or as it is), with the hooks it needs.
Imported by the job's processes only (`benchmarks/across_workers_job.py`,
`benchmarks.step_trace`): it imports TensorFlow.
"""

from typing import Callable, Iterable

import numpy as np
import tensorflow as tf

from benchmarks import ctr_model

FEATURES = 784
CLASSES = 10


def mlp_model_fn_for(hidden: Iterable[int], learning_rate: float,
                     wrap: Callable):
  """The MLP 784-`hidden`-10's model_fn, plain gradient descent."""
  hidden = list(hidden)

  def model_fn(features, labels, mode):
    logits = tf.compat.v1.layers.dense(_dense_layers(features, hidden),
                                       CLASSES, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    return _trained(mode, loss, wrap(
        tf.compat.v1.train.GradientDescentOptimizer(learning_rate)))

  return model_fn


def mlp_input_fn_for(rank: int, rows: int):
  """This task's one fixed batch of `rows` rows, repeated."""
  random = np.random.RandomState(rank)
  x = random.rand(rows, FEATURES).astype(np.float32)
  y = random.randint(0, CLASSES, size=rows).astype(np.int64)
  return lambda: tf.data.Dataset.from_tensors((x, y)).repeat()


def ctr_model_fn_for(fields: int, rows_a_table: int, dim: int, shards: int,
                     hidden: Iterable[int], learning_rate: float,
                     wrap: Callable):
  """The CTR model's model_fn: `fields` embedding tables of `rows_a_table`
  x `dim`, each in `shards` partitions, an MLP `hidden` on top, Adagrad."""
  hidden = list(hidden)

  def model_fn(features, labels, mode):
    embedded = []
    for name in ctr_model.field_names(fields):
      table = tf.compat.v1.get_variable(
          "embedding_" + name, [rows_a_table, dim], tf.float32,
          initializer=tf.compat.v1.random_normal_initializer(stddev=0.05),
          partitioner=tf.compat.v1.fixed_size_partitioner(shards))
      embedded.append(tf.compat.v1.nn.embedding_lookup(
          table, features[name], partition_strategy="div"))
    net = _dense_layers(tf.concat(embedded, axis=1), hidden)
    logits = tf.compat.v1.layers.dense(net, 1, name="logit")
    loss = tf.compat.v1.losses.sigmoid_cross_entropy(labels, logits)
    return _trained(mode, loss, wrap(
        tf.compat.v1.train.AdagradOptimizer(learning_rate)))

  return model_fn


def _dense_layers(net, hidden):
  for index, units in enumerate(hidden):
    net = tf.compat.v1.layers.dense(net, units, tf.nn.relu,
                                    name="hidden_{}".format(index))
  return net


def _trained(mode, loss, wrapped):
  """The spec that trains `loss` with `wrapped`, (optimizer, hooks)."""
  optimizer, hooks = wrapped
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    training_hooks=hooks)

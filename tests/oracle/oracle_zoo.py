"""The oracle's zoo: `model_fn`s written the way their authors write them.

Each entry is a model a team could have in production, written for one
device; the only concession to `replicate` is `replicate.TowerOptimizer`
around its optimizer (and, for the masked loss, `replicate.loss_denominator`,
which does nothing unwrapped). Nothing is shaped to suit the wrapper: the
CIFAR-10 tutorial reads its own `'losses'` collection and pins its variables
to `/cpu:0`, BERT clips with `tf.clip_by_global_norm` between `tf.gradients`
and its own optimizer's `apply_gradients`, the GAN makes its generator step
wait for its discriminator step, and so on.

Two choices make the oracle meaningful where one device and N towers cannot
agree by design (both are stated again at the model):
- Dropout: a tower draws its own mask for its own rows, so no N-tower mask
  equals one device's mask on the whole batch. The Keras model builds its
  `Dropout` layer from `params["dropout"]`, and the oracle runs it with rate
  0.0 (the layer is in the graph; it draws no mask).
- Batch norm in training: by default (`sync_batch_norm=True`) a tower
  normalizes with the whole batch's moments, so loss, gradients, variables
  and moving statistics equal one device on the whole batch; per-tower
  moments only when asked for (`sync_batch_norm=False`). The batch-norm
  models are wrapped with the default, so every mode is compared exactly.
  (EVAL, PREDICT and export use the moving statistics, where the flag
  changes nothing.)

Every model starts from one shared checkpoint (oracle_harness.py), except
the seeded one, which is compared from its initial values as a team
comparing from seeds would (docs/guarantees.md, "Seeding a comparison").
A model whose cells differ in nothing but the factors that do not touch
what it tests names the values its cells take (`ZooModel.only`), so the
cross grows by what it tests.

An entry is a `ZooModel`: its data (7 rows; the first 2 for "a batch smaller
than the towers"), how to parse it from `tf.Example`s, what serving feeds,
and how to build the unwrapped or the wrapped `Estimator` on a `model_dir`.
"""

import dataclasses
import itertools
import re
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

import oracle_zoo_losses
import oracle_zoo_metrics
import oracle_zoo_rows
import replicate

Reduction = tf.compat.v1.losses.Reduction
ModeKeys = tf.estimator.ModeKeys
ROWS = 7  # the whole data; uneven over 2 (4 + 3) and 3 (3 + 2 + 2) towers


@dataclasses.dataclass(frozen=True)
class ZooModel:
  """One model of the zoo.

  `build(model_dir, config, wrap)` returns the unwrapped `Estimator` when
  `wrap` is None, else the `Estimator` of `replicate_model_fn(model_fn,
  **wrap_kwargs, **wrap)` (`wrap` holds the cell's `variable_strategy`).
  `data` is `(features, labels)` as numpy, ROWS rows; `sparse_keys` are
  features the tf.data pipelines deliver as `SparseTensor`s (0 in the numpy
  array is padding, not an id).
  """
  name: str
  build: Callable[[str, tf.estimator.RunConfig, Optional[dict]],
                  tf.estimator.Estimator]
  data: Tuple[Dict[str, np.ndarray], Optional[np.ndarray]]
  example_spec: Dict[str, object]
  serving_keys: Tuple[str, ...]
  sparse_keys: Tuple[str, ...] = ()
  # The values its cells take, by factor ("pipeline", "mode", ...): a
  # factor not named takes every value. Empty: the whole cross.
  only: Dict[str, Tuple[str, ...]] = dataclasses.field(default_factory=dict)
  # False: no shared start checkpoint; both runs start from the initial
  # values the seeds give (`build` seeds itself).
  warm_start: bool = True


def _custom(name, model_fn, data, example_spec, serving_keys, params=None,
            sparse_keys=(), only=None, seed=None, unwrapped_model_fn=None,
            **wrap_kwargs):
  """`unwrapped_model_fn`: what the unwrapped Estimator runs instead of
  `model_fn` (a TPUEstimatorSpec converted as TPUEstimator does on CPU)."""
  def build(model_dir, config, wrap):
    function = unwrapped_model_fn or model_fn
    if wrap is not None:
      function = replicate.replicate_model_fn(model_fn, **wrap_kwargs, **wrap)
    if seed is not None:
      # "Seeding a comparison": before each Estimator, wrapped or not, with
      # RunConfig(tf_random_seed=...) (the harness's run_config).
      tf.keras.utils.set_random_seed(seed)
    return tf.estimator.Estimator(function, model_dir=model_dir,
                                  config=config, params=params)
  return ZooModel(name, build, data, example_spec, tuple(serving_keys),
                  tuple(sparse_keys), dict(only or {}), seed is None)


def _fixed(shape, dtype=tf.float32):
  return tf.io.FixedLenFeature(shape, dtype)


def _rng(seed):
  return np.random.RandomState(seed)


# ---------------------------------------------------------------------------
# Keras functional model with batch norm and dropout.


def _keras_classifier(params):
  inputs = tf.keras.Input(shape=(4,), name="x")
  # No bias before batch norm, as Keras models write it: its gradient is 0
  # up to rounding, which Adam would turn into full-size steps either way.
  hidden = tf.keras.layers.Dense(8, use_bias=False, name="hidden")(inputs)
  hidden = tf.keras.layers.BatchNormalization(name="batch_norm")(hidden)
  hidden = tf.keras.layers.Activation("relu")(hidden)
  # Rate 0.0 in the zoo: no N-tower dropout mask can equal one device's.
  hidden = tf.keras.layers.Dropout(params["dropout"], seed=1)(hidden)
  logits = tf.keras.layers.Dense(3, name="logits")(hidden)
  return tf.keras.Model(inputs=inputs, outputs=logits)


def keras_model_fn(features, labels, mode, params):
  model = _keras_classifier(params)
  logits = model(features["x"], training=mode == ModeKeys.TRAIN)
  predictions = {"class_ids": tf.argmax(logits, axis=1),
                 "probabilities": tf.nn.softmax(logits)}
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      labels, logits, from_logits=True))
  if mode == ModeKeys.EVAL:
    accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    accuracy.update_state(labels, logits)
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, eval_metric_ops={
            "accuracy": accuracy,
            "mean_probability": tf.compat.v1.metrics.mean(
                predictions["probabilities"])})
  optimizer = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(0.05))
  # The Keras guide's pattern for a model called inside a model_fn.
  update_ops = (model.get_updates_for(None) +
                model.get_updates_for(features["x"]))
  minimize = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step(),
      var_list=model.trainable_variables)
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(minimize, *update_ops))


def _keras_data():
  rng = _rng(1)
  return ({"x": rng.randn(ROWS, 4).astype(np.float32)},
          rng.randint(0, 3, ROWS).astype(np.int64))


# ---------------------------------------------------------------------------
# tf.compat.v1.layers CNN with batch norm (UPDATE_OPS).


def cnn_model_fn(features, labels, mode):
  net = tf.compat.v1.layers.conv2d(features["image"], 4, 3, padding="same",
                                   use_bias=False, name="conv1")
  net = tf.compat.v1.layers.batch_normalization(
      net, training=mode == ModeKeys.TRAIN, name="bn1")
  net = tf.nn.relu(net)
  net = tf.compat.v1.layers.max_pooling2d(net, 2, 2)
  net = tf.compat.v1.layers.flatten(net)
  logits = tf.compat.v1.layers.dense(net, 3, name="logits")
  predictions = {"classes": tf.argmax(logits, axis=1),
                 "probabilities": tf.nn.softmax(logits, name="softmax")}
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(
        mode, predictions=predictions, export_outputs={
            "serving_default": tf.estimator.export.PredictOutput(predictions)})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(labels,
                                                  predictions["classes"]),
        "mean_per_class_accuracy": tf.compat.v1.metrics.mean_per_class_accuracy(
            labels, predictions["classes"], 3)})
  update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update_ops):
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _image_data(channels, seed):
  rng = _rng(seed)
  return ({"image": rng.rand(ROWS, 6, 6, channels).astype(np.float32)},
          rng.randint(0, 3, ROWS).astype(np.int64))


# ---------------------------------------------------------------------------
# The CIFAR-10 tutorial (cifar10.py): weight decay in a 'losses' collection,
# loss averages applied before the gradients, variable averages after.


def _variable_on_cpu(name, shape, initializer):
  with tf.device("/cpu:0"):
    return tf.compat.v1.get_variable(name, shape, initializer=initializer,
                                     dtype=tf.float32)


def _variable_with_weight_decay(name, shape, stddev, wd):
  var = _variable_on_cpu(
      name, shape, tf.compat.v1.truncated_normal_initializer(stddev=stddev))
  if wd is not None:
    weight_decay = tf.multiply(tf.nn.l2_loss(var), wd, name="weight_loss")
    tf.compat.v1.add_to_collection("losses", weight_decay)
  return var


def _cifar10_inference(images):
  with tf.compat.v1.variable_scope("conv1") as scope:
    kernel = _variable_with_weight_decay("weights", [3, 3, 3, 4], 5e-2, None)
    conv = tf.nn.conv2d(images, kernel, [1, 1, 1, 1], padding="SAME")
    biases = _variable_on_cpu("biases", [4],
                              tf.compat.v1.constant_initializer(0.0))
    conv1 = tf.nn.relu(tf.nn.bias_add(conv, biases), name=scope.name)
  pool1 = tf.nn.max_pool2d(conv1, ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1],
                           padding="SAME", name="pool1")
  norm1 = tf.nn.lrn(pool1, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75,
                    name="norm1")
  with tf.compat.v1.variable_scope("local3") as scope:
    reshape = tf.reshape(norm1, [-1, 3 * 3 * 4])
    weights = _variable_with_weight_decay("weights", [36, 8], 0.04, 0.004)
    biases = _variable_on_cpu("biases", [8],
                              tf.compat.v1.constant_initializer(0.1))
    local3 = tf.nn.relu(tf.matmul(reshape, weights) + biases, name=scope.name)
  with tf.compat.v1.variable_scope("softmax_linear") as scope:
    weights = _variable_with_weight_decay("weights", [8, 3], 1 / 8.0, None)
    biases = _variable_on_cpu("biases", [3],
                              tf.compat.v1.constant_initializer(0.0))
    softmax_linear = tf.add(tf.matmul(local3, weights), biases,
                            name=scope.name)
  return softmax_linear


def _cifar10_loss(logits, labels):
  labels = tf.cast(labels, tf.int64)
  cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits, name="cross_entropy_per_example")
  cross_entropy_mean = tf.reduce_mean(cross_entropy, name="cross_entropy")
  tf.compat.v1.add_to_collection("losses", cross_entropy_mean)
  return tf.add_n(tf.compat.v1.get_collection("losses"), name="total_loss")


def _add_loss_summaries(total_loss):
  loss_averages = tf.train.ExponentialMovingAverage(0.9, name="avg")
  losses = tf.compat.v1.get_collection("losses")
  loss_averages_op = loss_averages.apply(losses + [total_loss])
  for l in losses + [total_loss]:
    tf.compat.v1.summary.scalar(l.op.name + "_raw", l)
    tf.compat.v1.summary.scalar(l.op.name, loss_averages.average(l))
  return loss_averages_op


def _cifar10_train(total_loss, global_step):
  lr = tf.compat.v1.train.exponential_decay(0.1, global_step, 2, 0.5,
                                            staircase=True)
  loss_averages_op = _add_loss_summaries(total_loss)
  with tf.control_dependencies([loss_averages_op]):
    opt = replicate.TowerOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr))
    grads = opt.compute_gradients(total_loss)
  apply_gradient_op = opt.apply_gradients(grads, global_step=global_step)
  variable_averages = tf.train.ExponentialMovingAverage(0.9999, global_step)
  with tf.control_dependencies([apply_gradient_op]):
    variables_averages_op = variable_averages.apply(
        tf.compat.v1.trainable_variables())
  return variables_averages_op


def cifar10_model_fn(features, labels, mode):
  logits = _cifar10_inference(features["image"])
  predictions = {"classes": tf.argmax(logits, axis=1),
                 "probabilities": tf.nn.softmax(logits)}
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  loss = _cifar10_loss(logits, labels)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "precision_at_1": tf.compat.v1.metrics.mean(tf.cast(
            tf.compat.v1.nn.in_top_k(logits, labels, 1), tf.float32))})
  train_op = _cifar10_train(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


# ---------------------------------------------------------------------------
# BERT-style: tf.gradients, clip_by_global_norm, an AdamW optimizer of its
# own (as google-research/bert's optimization.py writes it), and the global
# step assigned by hand.


class AdamWeightDecayOptimizer(tf.compat.v1.train.Optimizer):
  """Adam with decoupled weight decay, applying its own update."""

  def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9,
               beta_2=0.999, epsilon=1e-6, exclude_from_weight_decay=None,
               name="AdamWeightDecayOptimizer"):
    super().__init__(False, name)
    self.learning_rate = learning_rate
    self.weight_decay_rate = weight_decay_rate
    self.beta_1 = beta_1
    self.beta_2 = beta_2
    self.epsilon = epsilon
    self.exclude_from_weight_decay = exclude_from_weight_decay

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    assignments = []
    for (grad, param) in grads_and_vars:
      if grad is None or param is None:
        continue
      param_name = self._get_variable_name(param.name)
      m = tf.compat.v1.get_variable(
          name=param_name + "/adam_m", shape=param.shape.as_list(),
          dtype=tf.float32, trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
      v = tf.compat.v1.get_variable(
          name=param_name + "/adam_v", shape=param.shape.as_list(),
          dtype=tf.float32, trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
      next_m = (tf.multiply(self.beta_1, m) +
                tf.multiply(1.0 - self.beta_1, grad))
      next_v = (tf.multiply(self.beta_2, v) +
                tf.multiply(1.0 - self.beta_2, tf.square(grad)))
      update = next_m / (tf.sqrt(next_v) + self.epsilon)
      if self._do_use_weight_decay(param_name):
        update += self.weight_decay_rate * param
      update_with_lr = self.learning_rate * update
      next_param = param - update_with_lr
      assignments.extend(
          [param.assign(next_param), m.assign(next_m), v.assign(next_v)])
    return tf.group(*assignments, name=name)

  def _do_use_weight_decay(self, param_name):
    if not self.weight_decay_rate:
      return False
    for r in self.exclude_from_weight_decay or ():
      if re.search(r, param_name) is not None:
        return False
    return True

  def _get_variable_name(self, param_name):
    m = re.match("^(.*):\\d+$", param_name)
    if m is not None:
      param_name = m.group(1)
    return param_name


BERT_CLIP_NORM = 0.5  # BERT: 1.0; these norms are 0.8 to 2.8


def _create_optimizer(loss, init_lr, num_train_steps, num_warmup_steps,
                      clip_norm):
  global_step = tf.compat.v1.train.get_or_create_global_step()
  learning_rate = tf.constant(value=init_lr, shape=[], dtype=tf.float32)
  learning_rate = tf.compat.v1.train.polynomial_decay(
      learning_rate, global_step, num_train_steps, end_learning_rate=0.0,
      power=1.0, cycle=False)
  if num_warmup_steps:
    global_steps_int = tf.cast(global_step, tf.int32)
    warmup_steps_int = tf.constant(num_warmup_steps, dtype=tf.int32)
    global_steps_float = tf.cast(global_steps_int, tf.float32)
    warmup_steps_float = tf.cast(warmup_steps_int, tf.float32)
    warmup_percent_done = global_steps_float / warmup_steps_float
    warmup_learning_rate = init_lr * warmup_percent_done
    is_warmup = tf.cast(global_steps_int < warmup_steps_int, tf.float32)
    learning_rate = ((1.0 - is_warmup) * learning_rate +
                     is_warmup * warmup_learning_rate)
  optimizer = replicate.TowerOptimizer(AdamWeightDecayOptimizer(
      learning_rate=learning_rate, weight_decay_rate=0.01, beta_1=0.9,
      beta_2=0.999, epsilon=1e-6,
      exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]))
  tvars = tf.compat.v1.trainable_variables()
  grads = tf.gradients(loss, tvars)
  # BERT clips at 1.0: "bert_adamw" clips at a norm these small models never
  # reach, keeping its comparison about the rest; "bert_clip_active" at one
  # they exceed on every batch (test_oracle.py checks it), so towers
  # clipping their own gradients would be far from one device.
  (grads, _) = tf.clip_by_global_norm(grads, clip_norm=clip_norm)
  train_op = optimizer.apply_gradients(zip(grads, tvars),
                                       global_step=global_step)
  new_global_step = global_step + 1
  train_op = tf.group(train_op, [global_step.assign(new_global_step)])
  return train_op


def _layer_norm(input_tensor, name):
  with tf.compat.v1.variable_scope(name):
    depth = input_tensor.shape[-1]
    gamma = tf.compat.v1.get_variable(
        "gamma", [depth], initializer=tf.compat.v1.ones_initializer())
    beta = tf.compat.v1.get_variable(
        "beta", [depth], initializer=tf.compat.v1.zeros_initializer())
    mean, variance = tf.nn.moments(input_tensor, [-1], keepdims=True)
    return (input_tensor - mean) * tf.math.rsqrt(variance + 1e-12) * gamma + beta


def bert_model_fn(features, labels, mode, params):
  input_ids = features["input_ids"]
  input_mask = tf.cast(tf.not_equal(input_ids, 0), tf.float32)
  initializer = tf.compat.v1.truncated_normal_initializer(stddev=1.0)
  with tf.compat.v1.variable_scope("bert"):
    with tf.compat.v1.variable_scope("embeddings"):
      embedding_table = tf.compat.v1.get_variable(
          "word_embeddings", [8, 4], initializer=initializer)
      embedded = tf.gather(embedding_table, input_ids)
      embedded = _layer_norm(embedded, "LayerNorm")
    with tf.compat.v1.variable_scope("encoder"):
      hidden = tf.compat.v1.layers.dense(embedded, 4, activation=tf.tanh,
                                         name="dense",
                                         kernel_initializer=initializer)
      hidden = _layer_norm(hidden + embedded, "LayerNorm")
      mask = tf.expand_dims(input_mask, -1)
      pooled = tf.reduce_sum(hidden * mask, axis=1) / tf.maximum(
          tf.reduce_sum(mask, axis=1), 1.0)
    with tf.compat.v1.variable_scope("pooler"):
      pooled = tf.compat.v1.layers.dense(pooled, 4, activation=tf.tanh,
                                         name="dense",
                                         kernel_initializer=initializer)
  output_weights = tf.compat.v1.get_variable(
      "output_weights", [2, 4], initializer=initializer)
  output_bias = tf.compat.v1.get_variable(
      "output_bias", [2], initializer=tf.compat.v1.zeros_initializer())
  logits = tf.nn.bias_add(tf.matmul(pooled, output_weights, transpose_b=True),
                          output_bias)
  probabilities = tf.nn.softmax(logits, axis=-1)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(
        mode, predictions={"probabilities": probabilities})
  log_probs = tf.nn.log_softmax(logits, axis=-1)
  one_hot_labels = tf.one_hot(labels, depth=2, dtype=tf.float32)
  per_example_loss = -tf.reduce_sum(one_hot_labels * log_probs, axis=-1)
  loss = tf.reduce_mean(per_example_loss)
  if mode == ModeKeys.EVAL:
    predictions = tf.argmax(logits, axis=-1, output_type=tf.int32)
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "eval_accuracy": tf.compat.v1.metrics.accuracy(
            labels=labels, predictions=predictions),
        "eval_loss": tf.compat.v1.metrics.mean(values=per_example_loss)})
  train_op = _create_optimizer(loss, params["learning_rate"],
                               params["num_train_steps"],
                               params["num_warmup_steps"],
                               params.get("clip_norm", 1e6))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _token_data(seed, vocabulary, length=5):
  """Token ids 1..vocabulary-1, each row padded with 0 after its length."""
  rng = _rng(seed)
  ids = rng.randint(1, vocabulary, (ROWS, length)).astype(np.int64)
  lengths = [3, 0, 5, 2, 4, 1, 5][:ROWS]  # row 1 is all padding
  for row, kept in enumerate(lengths):
    ids[row, kept:] = 0
  return ids


# ---------------------------------------------------------------------------
# Sparse ids through a partitioned embedding.


def embedding_model_fn(features, labels, mode):
  ids = features["ids"]
  if not isinstance(ids, tf.SparseTensor):  # dense ids, 0-padded
    ids = tf.sparse.from_dense(ids)
  embeddings = tf.compat.v1.get_variable(
      "embeddings", [10, 4],
      partitioner=tf.compat.v1.fixed_size_partitioner(2),
      initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.3))
  embedded = tf.nn.safe_embedding_lookup_sparse(embeddings, ids,
                                                combiner="mean")
  net = tf.concat([embedded, features["x"]], axis=1)
  net = tf.compat.v1.layers.dense(net, 4, activation=tf.nn.relu, name="hidden")
  logits = tf.compat.v1.layers.dense(net, 1, name="logit")
  probabilities = tf.sigmoid(logits)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "probability": probabilities, "logit": logits})
  float_labels = tf.cast(tf.reshape(labels, [-1, 1]), tf.float32)
  loss = tf.compat.v1.losses.sigmoid_cross_entropy(float_labels, logits)
  if mode == ModeKeys.EVAL:
    predicted = tf.cast(probabilities > 0.5, tf.float32)
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "auc": tf.compat.v1.metrics.auc(float_labels, probabilities),
        "accuracy": tf.compat.v1.metrics.accuracy(float_labels, predicted),
        "precision": tf.compat.v1.metrics.precision(float_labels, predicted)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdagradOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _embedding_data():
  rng = _rng(4)
  ids = rng.randint(1, 10, (ROWS, 3)).astype(np.int64)
  for row, kept in enumerate([2, 3, 0, 1, 3, 2, 1]):  # row 2 has no ids
    ids[row, kept:] = 0
  return ({"ids": ids, "x": rng.randn(ROWS, 2).astype(np.float32)},
          rng.randint(0, 2, ROWS).astype(np.int64))


# ---------------------------------------------------------------------------
# An RNN unrolled with tf.while_loop.


def rnn_model_fn(features, labels, mode):
  sequence = features["sequence"]  # [batch, time, 2]
  units = 5
  kernel = tf.compat.v1.get_variable("rnn/kernel", [2 + units, units])
  bias = tf.compat.v1.get_variable("rnn/bias", [units],
                                   initializer=tf.compat.v1.zeros_initializer())
  time_steps = tf.shape(sequence)[1]
  state = tf.zeros([tf.shape(sequence)[0], units])

  def step(time, state):
    inputs = tf.concat([sequence[:, time, :], state], axis=1)
    return time + 1, tf.tanh(tf.matmul(inputs, kernel) + bias)

  _, state = tf.while_loop(lambda time, _: time < time_steps, step,
                           [tf.constant(0), state])
  predictions = tf.compat.v1.layers.dense(state, 1, name="output")
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"value": predictions})
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "rmse": tf.compat.v1.metrics.root_mean_squared_error(labels,
                                                             predictions),
        "mae": tf.compat.v1.metrics.mean_absolute_error(labels, predictions)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.RMSPropOptimizer(0.05, momentum=0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _sequence_data():
  rng = _rng(5)
  sequence = rng.randn(ROWS, 4, 2).astype(np.float32)
  return ({"sequence": sequence},
          sequence.sum(axis=(1, 2))[:, None].astype(np.float32) * 0.5)


# ---------------------------------------------------------------------------
# A GAN: two optimizers, the generator's step after the discriminator's.


def _generator(noise):
  with tf.compat.v1.variable_scope("generator"):
    net = tf.compat.v1.layers.dense(noise, 4, activation=tf.nn.relu,
                                    name="hidden")
    return tf.compat.v1.layers.dense(net, 2, name="output")


def _discriminator(samples, reuse=False):
  with tf.compat.v1.variable_scope("discriminator", reuse=reuse):
    net = tf.compat.v1.layers.dense(samples, 4, activation=tf.nn.leaky_relu,
                                    name="hidden")
    return tf.compat.v1.layers.dense(net, 1, name="output")


def gan_model_fn(features, labels, mode):
  del labels  # unsupervised
  generated = _generator(features["noise"])
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "generated": generated,
        "realness": tf.sigmoid(_discriminator(generated))})
  real_logits = _discriminator(features["real"])
  fake_logits = _discriminator(generated, reuse=True)
  d_loss = (tf.compat.v1.losses.sigmoid_cross_entropy(
      tf.ones_like(real_logits), real_logits) +
            tf.compat.v1.losses.sigmoid_cross_entropy(
                tf.zeros_like(fake_logits), fake_logits))
  g_loss = tf.compat.v1.losses.sigmoid_cross_entropy(
      tf.ones_like(fake_logits), fake_logits)
  loss = d_loss + g_loss
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        # Per-example values: a metric fed one value per batch averages
        # the towers' values (docs/guarantees.md, "Not like one device").
        "discriminator_loss": tf.compat.v1.metrics.mean(
            tf.nn.sigmoid_cross_entropy_with_logits(
                tf.ones_like(real_logits), real_logits) +
            tf.nn.sigmoid_cross_entropy_with_logits(
                tf.zeros_like(fake_logits), fake_logits)),
        "generator_loss": tf.compat.v1.metrics.mean(
            tf.nn.sigmoid_cross_entropy_with_logits(
                tf.ones_like(fake_logits), fake_logits))})
  d_vars = tf.compat.v1.trainable_variables("discriminator")
  g_vars = tf.compat.v1.trainable_variables("generator")
  d_optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05, beta1=0.5))
  g_optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05, beta1=0.5))
  d_train = d_optimizer.minimize(d_loss, var_list=d_vars)
  with tf.control_dependencies([d_train]):
    g_train = g_optimizer.minimize(
        g_loss, var_list=g_vars,
        global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=g_train)


def _gan_data():
  rng = _rng(6)
  return ({"real": (rng.randn(ROWS, 2) * 0.5 + [1.0, -1.0]).astype(np.float32),
           "noise": rng.randn(ROWS, 2).astype(np.float32)}, None)


# ---------------------------------------------------------------------------
# Gradient accumulation over 2 steps.

ACCUMULATION_STEPS = 2


def accumulation_model_fn(features, labels, mode):
  logits = tf.compat.v1.layers.dense(
      tf.compat.v1.layers.dense(features["x"], 6, activation=tf.nn.relu,
                                name="hidden"), 3, name="logits")
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "class_ids": tf.argmax(logits, axis=1), "logits": logits})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(labels,
                                                  tf.argmax(logits, axis=1))})
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.MomentumOptimizer(0.2 / ACCUMULATION_STEPS, 0.9))
  tvars = tf.compat.v1.trainable_variables()
  accumulators = [
      tf.Variable(tf.zeros(tvar.shape), trainable=False)
      for tvar in tvars]
  global_step = tf.compat.v1.train.get_global_step()
  grads_and_vars = optimizer.compute_gradients(loss, tvars)
  accumulate = [accumulator.assign_add(grad) for accumulator, (grad, _)
                in zip(accumulators, grads_and_vars)]

  def apply_and_zero():
    apply = optimizer.apply_gradients(
        [(accumulator, var) for accumulator, (_, var)
         in zip(accumulators, grads_and_vars)])
    with tf.control_dependencies([apply]):
      return tf.group(*[accumulator.assign(tf.zeros_like(accumulator))
                        for accumulator in accumulators])

  with tf.control_dependencies(accumulate):
    step = tf.cond(
        tf.equal((global_step + 1) % ACCUMULATION_STEPS, 0), apply_and_zero,
        tf.no_op)
  with tf.control_dependencies([step]):
    train_op = global_step.assign_add(1)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _dense_data(seed, width=3, classes=3):
  rng = _rng(seed)
  return ({"x": rng.randn(ROWS, width).astype(np.float32)},
          rng.randint(0, classes, ROWS).astype(np.int64))


# ---------------------------------------------------------------------------
# EMA of the weights, restored into the model for EVAL and PREDICT.


def ema_model_fn(features, labels, mode):
  predictions = tf.compat.v1.layers.dense(
      tf.compat.v1.layers.dense(features["x"], 4, activation=tf.tanh,
                                name="hidden"), 1, name="output")
  ema = tf.train.ExponentialMovingAverage(0.5)
  if mode != ModeKeys.TRAIN:
    # Evaluate and serve the averaged weights, as Inception's eval does.
    scaffold = tf.compat.v1.train.Scaffold(
        saver=tf.compat.v1.train.Saver(ema.variables_to_restore()))
    if mode == ModeKeys.PREDICT:
      return tf.estimator.EstimatorSpec(
          mode, predictions={"value": predictions}, scaffold=scaffold)
    loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
    return tf.estimator.EstimatorSpec(mode, loss=loss, scaffold=scaffold,
                                      eval_metric_ops={
        "mse": tf.compat.v1.metrics.mean_squared_error(labels, predictions)})
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  minimize = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  with tf.control_dependencies([minimize]):
    train_op = ema.apply(tf.compat.v1.trainable_variables())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _regression_data(seed, width=3):
  rng = _rng(seed)
  x = rng.randn(ROWS, width).astype(np.float32)
  return ({"x": x}, (x @ np.linspace(-1, 1, width))[:, None].astype(
      np.float32))


# ---------------------------------------------------------------------------
# A NaN guard: a step whose loss is not finite only advances the step.


def nan_guard_model_fn(features, labels, mode):
  logits = tf.compat.v1.layers.dense(features["x"], 3, name="logits")
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "probabilities": tf.nn.softmax(logits)})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  # Estimator's NanTensorHook stops training on a NaN loss: report the
  # skipped step's loss as 0, the guard skips the update. (Wrapped on
  # several towers the guard is refused; see EXPECTED_REFUSALS.)
  reported_loss = tf.where(tf.math.is_finite(loss), loss, tf.zeros_like(loss))
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(labels,
                                                  tf.argmax(logits, axis=1))})
  opt = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(0.1))
  gs = tf.compat.v1.train.get_global_step()
  train_op = tf.cond(tf.math.is_finite(loss), lambda: opt.minimize(loss, gs),
                     lambda: tf.group(gs.assign_add(1)))
  return tf.estimator.EstimatorSpec(mode, loss=reported_loss,
                                    train_op=train_op)


def _nan_data():
  features, labels = _dense_data(8)
  features["x"][5, 1] = np.nan  # the batch holding row 5 skips its update
  return features, labels


# ---------------------------------------------------------------------------
# A masked token loss with padding, averaged over the real tokens.


def masked_model_fn(features, labels, mode):
  tokens = features["tokens"]  # [batch, 5], 0 is padding
  embedding = tf.compat.v1.get_variable(
      "embedding", [6, 4],
      initializer=tf.compat.v1.random_normal_initializer(stddev=0.5))
  embedded = tf.nn.embedding_lookup(embedding, tokens)
  logits = tf.compat.v1.layers.dense(embedded, 6, name="projection")
  predictions = {"next_tokens": tf.argmax(logits, axis=-1),
                 "log_probabilities": tf.nn.log_softmax(logits)}
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  mask = tf.cast(tf.not_equal(tokens, 0), tf.float32)
  per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                             logits=logits)
  loss = tf.reduce_sum(per_token * mask) / tf.reduce_sum(mask)
  replicate.loss_denominator(tf.reduce_sum(mask))
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "token_accuracy": tf.compat.v1.metrics.accuracy(
            labels, predictions["next_tokens"], weights=mask)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _masked_data():
  tokens = _token_data(9, 6)
  targets = np.roll(tokens, -1, axis=1) % 6
  return {"tokens": tokens}, targets.astype(np.int64)


# ---------------------------------------------------------------------------
# Seq2seq/RNN-style clipping: the gradients and variables of
# compute_gradients, clipped by their global norm, then applied (as
# tensorflow/nmt and the seq2seq tutorials write it). The clip is active on
# the zoo's data: from the oracle's start, one device's global norm is 2.6
# to 3.6 times CLIP_NORM on every batch of its cells (test_oracle.py checks
# it), so N towers each clipping their own gradient would be far from one
# device.

CLIP_NORM = 0.25


def clipped_model_fn(features, labels, mode):
  tokens = features["tokens"]  # [batch, 5]
  embedding = tf.compat.v1.get_variable(
      "embedding", [8, 4],
      initializer=tf.compat.v1.random_uniform_initializer(-1.0, 1.0))
  hidden = tf.compat.v1.layers.dense(
      tf.nn.embedding_lookup(embedding, tokens), 6, activation=tf.tanh,
      name="encoder")
  logits = tf.compat.v1.layers.dense(hidden, 8, name="projection")
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "next_tokens": tf.argmax(logits, axis=-1), "logits": logits})
  crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                            logits=logits)
  loss = tf.reduce_mean(crossent)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  opt = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(1.0))
  grads, tvars = zip(*opt.compute_gradients(loss))
  grads, _ = tf.clip_by_global_norm(grads, CLIP_NORM)
  train_op = opt.apply_gradients(
      zip(grads, tvars), global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _clipped_data():
  tokens = _token_data(13, 8)
  return {"tokens": tokens}, ((tokens * 3 + 1) % 8).astype(np.int64)


# ---------------------------------------------------------------------------
# DeepFM (lambdaji/tf_repos): contrib's batch_norm(updates_collections=None)
# after each hidden layer, built twice (train and infer, the second reusing
# the first's variables) and picked by tf.cond(train_phase, ...). TF 2.15 has
# no contrib; its users port it as this: the layer's UPDATE_OPS taken out of
# the collection and made control dependencies of its output, so the moving
# statistics update in place.


def _contrib_batch_norm(x, is_training, reuse, scope):
  with tf.compat.v1.variable_scope(scope, reuse=reuse):
    updates = tf.compat.v1.get_collection_ref(
        tf.compat.v1.GraphKeys.UPDATE_OPS)
    count = len(updates)
    y = tf.compat.v1.layers.batch_normalization(
        x, momentum=0.995, center=True, scale=True, training=is_training)
    in_place = updates[count:]
    del updates[count:]
    with tf.control_dependencies(in_place):
      return tf.identity(y)


def _batch_norm_layer(x, train_phase, scope_bn):
  bn_train = _contrib_batch_norm(x, True, None, scope_bn)
  bn_infer = _contrib_batch_norm(x, False, True, scope_bn)
  return tf.cond(tf.cast(train_phase, tf.bool), lambda: bn_train,
                 lambda: bn_infer)


def deepfm_model_fn(features, labels, mode, params):
  field_size, embedding_size = 4, 3
  feat_ids, feat_vals = features["feat_ids"], features["feat_vals"]
  with tf.compat.v1.variable_scope("Embedding-layer"):
    fm_w = tf.compat.v1.get_variable(
        "fm_w", [params["feature_size"]],
        initializer=tf.compat.v1.glorot_normal_initializer())
    fm_v = tf.compat.v1.get_variable(
        "fm_v", [params["feature_size"], embedding_size],
        initializer=tf.compat.v1.glorot_normal_initializer())
    fm_b = tf.compat.v1.get_variable(
        "fm_bias", [1], initializer=tf.compat.v1.constant_initializer(0.0))
  with tf.compat.v1.variable_scope("First-order"):
    y_w = tf.reduce_sum(tf.multiply(tf.nn.embedding_lookup(fm_w, feat_ids),
                                    feat_vals), 1)
  with tf.compat.v1.variable_scope("Second-order"):
    embeddings = tf.multiply(
        tf.nn.embedding_lookup(fm_v, feat_ids),
        tf.reshape(feat_vals, [-1, field_size, 1]))
    sum_square = tf.square(tf.reduce_sum(embeddings, 1))
    square_sum = tf.reduce_sum(tf.square(embeddings), 1)
    y_v = 0.5 * tf.reduce_sum(tf.subtract(sum_square, square_sum), 1)
  with tf.compat.v1.variable_scope("Deep-part"):
    train_phase = mode == ModeKeys.TRAIN
    deep = tf.reshape(embeddings, [-1, field_size * embedding_size])
    for i, units in enumerate(params["deep_layers"]):
      deep = tf.compat.v1.layers.dense(
          deep, units, activation=tf.nn.relu, name="mlp%d" % i,
          kernel_initializer=tf.compat.v1.glorot_normal_initializer(seed=i))
      deep = _batch_norm_layer(deep, train_phase, "bn_%d" % i)
    y_deep = tf.reshape(tf.compat.v1.layers.dense(
        deep, 1, name="deep_out",
        kernel_initializer=tf.compat.v1.glorot_normal_initializer(seed=9)),
        [-1])
  y = fm_b + y_w + y_v + y_deep
  pred = tf.sigmoid(y)
  predictions = {"prob": pred}
  export_outputs = {
      tf.compat.v1.saved_model.signature_constants
      .DEFAULT_SERVING_SIGNATURE_DEF_KEY:
      tf.estimator.export.PredictOutput(predictions)}
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions,
                                      export_outputs=export_outputs)
  labels = tf.cast(tf.reshape(labels, [-1]), tf.float32)
  loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
      logits=y, labels=labels)) + params["l2_reg"] * tf.nn.l2_loss(fm_w)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions,
                                      loss=loss, eval_metric_ops={
        "auc": tf.compat.v1.metrics.auc(labels, pred)})
  optimizer = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(
      learning_rate=params["learning_rate"], beta1=0.9, beta2=0.999,
      epsilon=1e-8))
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, predictions=predictions, loss=loss,
                                    train_op=train_op)


def _deepfm_data():
  rng = _rng(14)
  # Field f's ids are 3f..3f+2 (a one-hot field per column, as libsvm-style
  # CTR data comes); values 1 for categorical fields, real for the last.
  ids = (np.arange(4) * 3 + rng.randint(0, 3, (ROWS, 4))).astype(np.int64)
  vals = np.ones((ROWS, 4), np.float32)
  vals[:, 3] = rng.rand(ROWS) * 2
  return ({"feat_ids": ids, "feat_vals": vals},
          (rng.rand(ROWS) < 0.5).astype(np.float32))


# ---------------------------------------------------------------------------
# A model compared from its seeds, with no shared checkpoint: Keras and
# tf.compat.v1.layers layers with their default random initializers, seeded
# as docs/guarantees.md's "Seeding a comparison" says (the zoo's `seed`).


def seeded_model_fn(features, labels, mode):
  hidden = tf.keras.layers.Dense(5, activation="relu", name="keras_hidden")(
      features["x"])
  hidden = tf.compat.v1.layers.dense(hidden, 4, activation=tf.tanh,
                                     name="v1_hidden")
  logits = tf.compat.v1.layers.dense(hidden, 3, name="logits")
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "class_ids": tf.argmax(logits, axis=1), "logits": logits})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(labels,
                                                  tf.argmax(logits, axis=1))})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


# ---------------------------------------------------------------------------
# tensorflow/models' Transformer (TF 1 Estimator): the padded, label-smoothed
# token cross entropy, averaged over the target tokens that are not padding,
# with no loss_denominator (replicate reads the ratio from the graph).


def _transformer_xent(logits, labels, smoothing, vocab_size):
  with tf.name_scope("loss"):
    logit_length, label_length = tf.shape(logits)[1], tf.shape(labels)[1]
    longest = tf.maximum(logit_length, label_length)
    logits = tf.pad(logits, [[0, 0], [0, longest - logit_length], [0, 0]])
    labels = tf.pad(labels, [[0, 0], [0, longest - label_length]])
    with tf.name_scope("smoothing_cross_entropy"):
      confidence = 1.0 - smoothing
      low_confidence = (1.0 - confidence) / tf.cast(vocab_size - 1,
                                                    tf.float32)
      soft_targets = tf.one_hot(tf.cast(labels, tf.int32), depth=vocab_size,
                                on_value=confidence, off_value=low_confidence)
      xentropy = tf.nn.softmax_cross_entropy_with_logits(
          logits=logits, labels=soft_targets)
      # The best loss reachable with smoothed targets, subtracted.
      normalizing_constant = -(
          confidence * tf.math.log(confidence) +
          tf.cast(vocab_size - 1, tf.float32) * low_confidence *
          tf.math.log(low_confidence + 1e-20))
      xentropy -= normalizing_constant
    weights = tf.cast(tf.not_equal(labels, 0), tf.float32)
    return xentropy * weights, weights


def transformer_model_fn(features, labels, mode, params):
  embedding = tf.compat.v1.get_variable(
      "embedding", [6, 4],
      initializer=tf.compat.v1.random_normal_initializer(stddev=0.5))
  hidden = tf.nn.embedding_lookup(embedding, features["tokens"])
  logits = tf.compat.v1.layers.dense(hidden, 6, name="presoftmax")
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "outputs": tf.argmax(logits, axis=-1)})
  xentropy, weights = _transformer_xent(logits, labels,
                                        params["label_smoothing"], 6)
  loss = tf.reduce_sum(xentropy) / tf.reduce_sum(weights)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(
            labels, tf.argmax(logits, axis=-1), weights=weights)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.1, beta2=0.997)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _transformer_data():
  tokens = _token_data(13, 6)
  targets = np.roll(tokens, -1, axis=1) % 6
  targets[tokens == 0] = 0  # padding targets, as the inputs' padding
  return {"tokens": tokens}, targets.astype(np.int64)


# ---------------------------------------------------------------------------
# Canned estimators: compat.v1 and TF 2, DNN / Linear / DNNLinearCombined,
# binary / multi-class / regressor, with and without a weight column. Nine
# of the 36 combinations, chosen (an orthogonal array) so that every pair of
# their values appears among them; the full cross of the harness adds none.

_CANNED_FAMILIES = ("v1", "v2")
_CANNED_KINDS = ("dnn", "linear", "dnn_linear")
_CANNED_HEADS = ("binary", "multiclass", "regressor")


def _canned_combinations():
  """(family, kind, head, weighted): the OA(9, 3^4) rows folded to 2 levels."""
  for kind, head in itertools.product(range(3), range(3)):
    family, weighted = (kind + head) % 3 % 2, (kind + 2 * head) % 3 % 2
    yield (_CANNED_FAMILIES[family], _CANNED_KINDS[kind], _CANNED_HEADS[head],
           bool(weighted))


def _canned_data(head):
  rng = _rng(10)
  x = rng.randn(ROWS, 3).astype(np.float32)
  color = np.array([[c] for c in "abcdabc"[:ROWS]], dtype=object)
  weight = np.round(rng.rand(ROWS, 1) * 2 + 0.5, 1).astype(np.float32)
  features = {"x": x, "color": color.astype(bytes).astype(object),
              "weight": weight}
  if head == "regressor":
    labels = (x @ [0.5, -1.0, 2.0])[:, None].astype(np.float32)
  else:
    labels = (np.arange(ROWS) % (2 if head == "binary" else 3)).astype(np.int64)
  return features, labels


def _canned_build(family, kind, head, weighted):
  module = tf.estimator if family == "v2" else tf.compat.v1.estimator
  fc = tf.feature_column
  numeric = fc.numeric_column("x", shape=[3])
  color = fc.categorical_column_with_vocabulary_list("color", ["a", "b", "c",
                                                               "d"])
  embedded = fc.embedding_column(color, 2)
  if family == "v2":
    dnn_optimizer = lambda: tf.keras.optimizers.legacy.Adagrad(0.1)
    linear_optimizer = lambda: tf.keras.optimizers.legacy.Ftrl(0.1)
  else:
    dnn_optimizer = lambda: tf.compat.v1.train.AdagradOptimizer(0.1)
    linear_optimizer = lambda: tf.compat.v1.train.FtrlOptimizer(0.1)
  common = {"weight_column": "weight" if weighted else None}
  if head != "regressor":
    common["n_classes"] = 2 if head == "binary" else 3
  suffix = "Regressor" if head == "regressor" else "Classifier"
  # compat.v1 heads sum their loss over the batch; TF 2 heads average it.
  reduction = Reduction.SUM if family == "v1" else (
      Reduction.SUM_BY_NONZERO_WEIGHTS)

  def build(model_dir, config, wrap):
    if kind == "dnn":
      canned = getattr(module, "DNN" + suffix)(
          hidden_units=[4], feature_columns=[numeric, embedded],
          optimizer=replicate.TowerOptimizer(dnn_optimizer),
          model_dir=model_dir, config=config, **common)
    elif kind == "linear":
      canned = getattr(module, "Linear" + suffix)(
          feature_columns=[numeric, color],
          optimizer=replicate.TowerOptimizer(linear_optimizer),
          model_dir=model_dir, config=config, **common)
    else:
      canned = getattr(module, "DNNLinearCombined" + suffix)(
          linear_feature_columns=[color],
          linear_optimizer=replicate.TowerOptimizer(linear_optimizer),
          dnn_feature_columns=[numeric, embedded], dnn_hidden_units=[4],
          dnn_optimizer=replicate.TowerOptimizer(dnn_optimizer),
          model_dir=model_dir, config=config, **common)
    if wrap is None:
      return canned
    return tf.estimator.Estimator(
        replicate.replicate_model_fn(canned.model_fn, loss_reduction=reduction,
                                     **wrap),
        model_dir=model_dir, config=config)

  return build


def _canned_models():
  for family, kind, head, weighted in _canned_combinations():
    name = "canned_{}_{}_{}{}".format(family, kind, head,
                                      "_weighted" if weighted else "")
    label_spec = (_fixed([1]) if head == "regressor" else
                  _fixed([], tf.int64))
    yield ZooModel(
        name, _canned_build(family, kind, head, weighted), _canned_data(head),
        {"x": _fixed([3]), "color": _fixed([1], tf.string),
         "weight": _fixed([1]), "label": label_spec},
        ("x", "color"))


def _zoo():
  models = list(_canned_models()) + [
      _custom("keras_bn_dropout", keras_model_fn, _keras_data(),
              {"x": _fixed([4]), "label": _fixed([], tf.int64)}, ["x"],
              params={"dropout": 0.0}),
      _custom("layers_cnn_bn", cnn_model_fn, _image_data(1, 2),
              {"image": _fixed([6, 6, 1]), "label": _fixed([], tf.int64)},
              ["image"]),
      _custom("cifar10_loss_averages", cifar10_model_fn, _image_data(3, 3),
              {"image": _fixed([6, 6, 3]), "label": _fixed([], tf.int64)},
              ["image"]),
      _custom("bert_adamw", bert_model_fn,
              ({"input_ids": _token_data(11, 8)},
               np.array([0, 1, 1, 0, 1, 0, 0][:ROWS], np.int64)),
              {"input_ids": _fixed([5], tf.int64),
               "label": _fixed([], tf.int64)}, ["input_ids"],
              # BERT groups global_step.assign with the update, unordered,
              # and its learning rate reads global_step: a race in BERT's
              # own code (an unwrapped run now and then reads the new step).
              # No warmup and 10**6 decay steps make the race move the
              # learning rate by 1e-7, below the oracle's tolerance.
              params={"learning_rate": 0.1, "num_train_steps": 10**6,
                      "num_warmup_steps": 0}),
      # BERT's clip active (BERT_CLIP_NORM): a training matter; not
      # "replicated", refused for bert_adamw's tf.gradients as above.
      _custom("bert_clip_active", bert_model_fn,
              ({"input_ids": _token_data(11, 8)},
               np.array([0, 1, 1, 0, 1, 0, 0][:ROWS], np.int64)),
              {"input_ids": _fixed([5], tf.int64),
               "label": _fixed([], tf.int64)}, ["input_ids"],
              params={"learning_rate": 0.1, "num_train_steps": 10**6,
                      "num_warmup_steps": 0, "clip_norm": BERT_CLIP_NORM},
              only={"pipeline": ("batch",), "towers": ("2", "3", "3_small"),
                    "strategy": ("parameter_server", "round_robin"),
                    "mode": ("train",)}),
      _custom("embedding_partitioned", embedding_model_fn, _embedding_data(),
              {"ids": tf.io.VarLenFeature(tf.int64), "x": _fixed([2]),
               "label": _fixed([], tf.int64)}, ["ids", "x"],
              sparse_keys=["ids"]),
      _custom("while_loop_rnn", rnn_model_fn, _sequence_data(),
              {"sequence": _fixed([4, 2]), "label": _fixed([1])},
              ["sequence"]),
      _custom("gan_two_optimizers", gan_model_fn, _gan_data(),
              {"real": _fixed([2]), "noise": _fixed([2])}, ["real", "noise"]),
      _custom("gradient_accumulation", accumulation_model_fn, _dense_data(7),
              {"x": _fixed([3]), "label": _fixed([], tf.int64)}, ["x"]),
      _custom("ema_weights_in_predict", ema_model_fn, _regression_data(12),
              {"x": _fixed([3]), "label": _fixed([1])}, ["x"]),
      _custom("nan_guard", nan_guard_model_fn, _nan_data(),
              {"x": _fixed([3]), "label": _fixed([], tf.int64)}, ["x"]),
      _custom("masked_token_loss", masked_model_fn, _masked_data(),
              {"tokens": _fixed([5], tf.int64), "label": _fixed([5], tf.int64)},
              ["tokens"]),
      _custom("transformer_padded_xent", transformer_model_fn,
              _transformer_data(),
              {"tokens": _fixed([5], tf.int64),
               "label": _fixed([5], tf.int64)}, ["tokens"],
              params={"label_smoothing": 0.1}),
      # Clipping is a training matter; "batch" has uneven shards (4 + 3,
      # 2 + 2 + 2 ...) and towers without rows (the remainder batch of 1).
      _custom("clip_after_compute_gradients", clipped_model_fn,
              _clipped_data(),
              {"tokens": _fixed([5], tf.int64), "label": _fixed([5], tf.int64)},
              ["tokens"], only={"pipeline": ("batch",), "mode": ("train",)}),
      # Batch norm is every mode's matter (moving statistics in EVAL,
      # PREDICT and export); "batch" for uneven shards and empty towers.
      # Not "round_robin": there Adam's sparse update of `fm_v` sometimes
      # loses one decay of its first moment (1/beta1 off, in about half
      # the runs), and so does the unwrapped model_fn on 2 CPU devices
      # with its variables placed round-robin by a plain device function:
      # TensorFlow's, not the wrapper's (docs/guarantees.md).
      _custom("deepfm_contrib_batch_norm", deepfm_model_fn, _deepfm_data(),
              {"feat_ids": _fixed([4], tf.int64), "feat_vals": _fixed([4]),
               "label": _fixed([])}, ["feat_ids", "feat_vals"],
              params={"feature_size": 12, "deep_layers": [6, 4],
                      "l2_reg": 0.01, "learning_rate": 0.05},
              only={"pipeline": ("batch",),
                    "strategy": ("parameter_server", "replicated")}),
      # Initial values do not depend on the pipeline; no export (nothing
      # to export without a checkpoint: the start is the initializers).
      _custom("seeded_from_initial_values", seeded_model_fn, _dense_data(15),
              {"x": _fixed([3]), "label": _fixed([], tf.int64)}, ["x"],
              only={"pipeline": ("from_tensors",),
                    "mode": ("train", "eval", "predict")}, seed=42),
  ]
  # The batch-level patterns (issue 30), in modules of their own.
  models += [_custom(**entry) for entry in
             oracle_zoo_losses.ENTRIES + oracle_zoo_metrics.ENTRIES +
             oracle_zoo_rows.ENTRIES]
  models += [ZooModel(**entry) for entry in oracle_zoo_rows.CANNED]
  return {model.name: model for model in models}


ZOO: Dict[str, ZooModel] = _zoo()

"""The loss rule: each tower's loss is weighted as the graph says it is
reduced over its rows, so N towers train and evaluate like one device.

Every model starts from constant initial values; wrapped (2 and 3 towers)
and unwrapped runs see the same batches, fed through placeholders of a
known (static) or unknown (dynamic) batch size. After a few steps every
variable and every step's loss must agree, and so must the EVAL loss.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, TRAIN, cpus, session_config

Reduction = tf.compat.v1.losses.Reduction
STEPS = 3
VOCAB, HIDDEN, LENGTH = 6, 4, 8


def _close(actual, expected, name=""):
  np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=2e-6,
                             err_msg=name)


def _batches(rows, steps=STEPS, zero_weight_rows=3):
  """Sequences of 1..LENGTH tokens padded with 0, a row mask, targets."""
  rng = np.random.RandomState(rows)
  batches = []
  for _ in range(steps):
    lengths = rng.randint(1, LENGTH + 1, size=rows)
    tokens = rng.randint(1, VOCAB, size=(rows, LENGTH))
    tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    targets = rng.randint(1, VOCAB, size=(rows, LENGTH))
    targets[tokens == 0] = 0
    mask = np.ones(rows, np.float32)
    mask[rng.permutation(rows)[:min(zero_weight_rows, rows)]] = 0.0
    batches.append({
        "tokens": tokens.astype(np.int32),
        "x": rng.rand(rows, 3).astype(np.float32) * 2 - 1,
        "mask": mask,
        "targets": targets.astype(np.int32),
        "class": rng.randint(0, 3, size=rows).astype(np.int32),
        "y": rng.rand(rows, 1).astype(np.float32),
    })
  return batches


_SHAPES = {"tokens": [LENGTH], "x": [3], "mask": [], "targets": [LENGTH],
           "class": [], "y": [1]}
_DTYPES = {"tokens": tf.int32, "x": tf.float32, "mask": tf.float32,
           "targets": tf.int32, "class": tf.int32, "y": tf.float32}


def _logits(features):
  """Per-token logits [n, T, VOCAB] and per-row logits [n, 3]."""
  table = tf.compat.v1.get_variable(
      "embedding", [VOCAB, HIDDEN], initializer=tf.compat.v1.constant_initializer(
          np.linspace(-1.0, 1.0, VOCAB * HIDDEN).reshape(VOCAB, HIDDEN)))
  embedded = tf.nn.embedding_lookup(table, features["tokens"])
  token_logits = tf.compat.v1.layers.dense(
      embedded, VOCAB, name="to_vocab",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(0.5, -0.5, HIDDEN * VOCAB).reshape(HIDDEN, VOCAB)))
  row_logits = tf.compat.v1.layers.dense(
      features["x"], 3, name="row_logits",
      kernel_regularizer=tf.keras.regularizers.l2(0.01),
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.6, 0.6, 9).reshape(3, 3)))
  return token_logits, row_logits


def _padded_cross_entropy(logits, labels, smoothing, vocab_size):
  """The Transformer's loss (tensorflow/models, official/transformer) as its
  Estimator code computes it: label-smoothed cross entropy per token, less
  the smoothed targets' own entropy, kept where the label is not padding."""
  with tf.name_scope("loss"):
    logit_length = tf.shape(logits)[1]
    label_length = tf.shape(labels)[1]
    longest = tf.maximum(logit_length, label_length)
    logits = tf.pad(logits, [[0, 0], [0, longest - logit_length], [0, 0]])
    labels = tf.pad(labels, [[0, 0], [0, longest - label_length]])
    confidence = 1.0 - smoothing
    low = (1.0 - confidence) / tf.cast(vocab_size - 1, tf.float32)
    targets = tf.one_hot(tf.cast(labels, tf.int32), depth=vocab_size,
                         on_value=confidence, off_value=low)
    xentropy = tf.nn.softmax_cross_entropy_with_logits(logits=logits,
                                                       labels=targets)
    constant = -(confidence * tf.math.log(confidence) +
                 tf.cast(vocab_size - 1, tf.float32) * low *
                 tf.math.log(low + 1e-20))
    xentropy -= constant
    weights = tf.cast(tf.not_equal(labels, 0), tf.float32)
    return xentropy * weights, weights


def _transformer_loss(features, labels):
  token_logits, _ = _logits(features)
  xentropy, weights = _padded_cross_entropy(token_logits, labels["targets"],
                                            0.1, VOCAB)
  return tf.reduce_sum(xentropy) / tf.reduce_sum(weights)


def _v1_loss(reduction, weights="mask"):
  def loss_fn(features, labels):
    _, row_logits = _logits(features)
    weight = {"mask": features["mask"], "scalar": 2.0, "none": 1.0}[weights]
    return tf.compat.v1.losses.sparse_softmax_cross_entropy(
        labels["class"], row_logits, weights=weight, reduction=reduction)
  return loss_fn


def _keras_loss(kind):
  def loss_fn(features, labels):
    _, row_logits = _logits(features)
    if kind == "object":
      return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
          labels["class"], row_logits, sample_weight=features["mask"])
    if kind == "object_sum":
      return tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction=tf.keras.losses.Reduction.SUM)(
              labels["class"], row_logits, sample_weight=features["mask"])
    if kind == "mse":
      return tf.keras.losses.MeanSquaredError()(
          labels["y"], row_logits[:, :1], sample_weight=features["mask"])
    # A Keras loss function: one value per row, averaged by the user.
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
        labels["class"], row_logits, from_logits=True))
  return loss_fn


def _multi_term_loss(features, labels):
  """A token loss + a row-mean auxiliary loss + regularization, collected."""
  token_logits, row_logits = _logits(features)
  xentropy, weights = _padded_cross_entropy(token_logits, labels["targets"],
                                            0.1, VOCAB)
  tf.compat.v1.losses.add_loss(
      tf.reduce_sum(xentropy) / tf.reduce_sum(weights))
  tf.compat.v1.losses.mean_squared_error(labels["y"], row_logits[:, :1],
                                         weights=0.5)
  return tf.compat.v1.losses.get_total_loss()


def _model_fn(loss_fn, optimizer_name="sgd"):
  def model_fn(features, labels, mode):
    loss = loss_fn(features, labels)
    if mode == EVAL:
      return tf.estimator.EstimatorSpec(mode, loss=loss)
    optimizer = (tf.compat.v1.train.AdamOptimizer(0.05)
                 if optimizer_name == "adam" else
                 tf.compat.v1.train.GradientDescentOptimizer(0.5))
    train_op = replicate.TowerOptimizer(optimizer).minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def _run(model_fn, batches, towers=None, static=False, mode=TRAIN,
         **wrap_kwargs):
  """(losses per step, {variable: value}); `towers=None`: unwrapped."""
  rows = len(batches[0]["x"]) if static else None
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    inputs = {k: tf.compat.v1.placeholder(_DTYPES[k], [rows] + _SHAPES[k])
              for k in _SHAPES}
    features = {k: inputs[k] for k in ("tokens", "x", "mask")}
    labels = {k: inputs[k] for k in ("targets", "class", "y")}
    if towers is not None:
      model_fn = replicate.replicate_model_fn(model_fn, devices=cpus(towers),
                                              **wrap_kwargs)
    spec = model_fn(features, labels, mode)
    with tf.compat.v1.Session(config=session_config(towers or 1)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      fetch = [spec.loss] + ([spec.train_op] if mode == TRAIN else [])
      losses = [session.run(fetch, {inputs[k]: b[k] for k in inputs})[0]
                for b in batches]
      values = {v.op.name: session.run(v)
                for v in tf.compat.v1.global_variables()}
  return losses, values


def _assert_like_one_device(loss_fn, towers, rows=8, static=False,
                            optimizer_name="sgd", **wrap_kwargs):
  batches = _batches(rows)
  model_fn = _model_fn(loss_fn, optimizer_name)
  expected_losses, expected = _run(model_fn, batches)
  losses, values = _run(model_fn, batches, towers, static, **wrap_kwargs)
  assert np.all(np.isfinite(losses)), losses
  assert values["global_step"] == expected["global_step"] == STEPS
  for name, value in expected.items():
    assert np.all(np.isfinite(values[name])), name
    _close(values[name], value, name)
  _close(losses, expected_losses, "loss per step")
  eval_expected, _ = _run(model_fn, batches, mode=EVAL)
  eval_losses, _ = _run(model_fn, batches, towers, static, mode=EVAL,
                        **wrap_kwargs)
  _close(eval_losses, eval_expected, "eval loss")


# (towers, rows, static): even and uneven shards, known and unknown batch
# sizes, and 2 rows on 3 towers (a tower with none).
SHAPES = [(2, 8, False), (2, 7, True), (3, 8, True), (3, 7, False),
          (3, 2, False), (3, 2, True)]
SHAPE_IDS = ["2x8", "2x7-static", "3x8-static", "3x7", "3x2", "3x2-static"]


@pytest.mark.parametrize("towers, rows, static", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_transformer_padded_token_mean(towers, rows, static, optimizer_name):
  _assert_like_one_device(_transformer_loss, towers, rows, static,
                          optimizer_name)


@pytest.mark.parametrize("towers, rows, static", SHAPES[:4], ids=SHAPE_IDS[:4])
@pytest.mark.parametrize("reduction", [
    Reduction.SUM, Reduction.MEAN, Reduction.SUM_OVER_BATCH_SIZE,
    Reduction.SUM_BY_NONZERO_WEIGHTS, Reduction.SUM_OVER_NONZERO_WEIGHTS])
def test_v1_losses_with_a_row_mask(reduction, towers, rows, static):
  # 3 of the rows weigh 0; the default loss_reduction reads the graph.
  _assert_like_one_device(_v1_loss(reduction), towers, rows, static)


@pytest.mark.parametrize("weights", ["scalar", "none"])
@pytest.mark.parametrize("reduction", [
    Reduction.SUM, Reduction.MEAN, Reduction.SUM_OVER_BATCH_SIZE,
    Reduction.SUM_BY_NONZERO_WEIGHTS])
def test_v1_losses_without_row_weights(reduction, weights):
  _assert_like_one_device(_v1_loss(reduction, weights), 3, 7, True)
  _assert_like_one_device(_v1_loss(reduction, weights), 2, 7, False)


V1_LOSSES = {
    "absolute_difference": lambda l, p, w: tf.compat.v1.losses.absolute_difference(l, p, w),
    "cosine_distance": lambda l, p, w: tf.compat.v1.losses.cosine_distance(
        tf.nn.l2_normalize(l, 1), tf.nn.l2_normalize(p, 1), axis=1,
        weights=w[:, None]),
    "hinge_loss": lambda l, p, w: tf.compat.v1.losses.hinge_loss(
        tf.cast(l > 0.5, tf.float32), p, w),
    "huber_loss": lambda l, p, w: tf.compat.v1.losses.huber_loss(l, p, w),
    "log_loss": lambda l, p, w: tf.compat.v1.losses.log_loss(
        l, tf.sigmoid(p), w),
    "mean_pairwise_squared_error":
        lambda l, p, w: tf.compat.v1.losses.mean_pairwise_squared_error(
            tf.tile(l, [1, 3]), tf.tile(p, [1, 3]) * [[1.0, 2.0, 3.0]], w),
    "mean_squared_error": lambda l, p, w: tf.compat.v1.losses.mean_squared_error(l, p, w),
    "sigmoid_cross_entropy": lambda l, p, w: tf.compat.v1.losses.sigmoid_cross_entropy(
        tf.cast(l > 0.5, tf.float32), p, w, label_smoothing=0.1),
    "softmax_cross_entropy": lambda l, p, w: tf.compat.v1.losses.softmax_cross_entropy(
        tf.one_hot(tf.cast(l[:, 0] * 3, tf.int32), 3), tf.tile(p, [1, 3]),
        w, label_smoothing=0.1),
}


@pytest.mark.parametrize("name", sorted(V1_LOSSES))
def test_every_v1_loss_function(name):
  def loss_fn(features, labels):
    _, row_logits = _logits(features)
    weights = features["mask"][:, None] if name != "cosine_distance" and (
        name != "softmax_cross_entropy") else features["mask"]
    if name == "softmax_cross_entropy":
      weights = features["mask"]
    return V1_LOSSES[name](labels["y"], row_logits[:, :1], weights)
  _assert_like_one_device(loss_fn, 3, 7, False)
  _assert_like_one_device(loss_fn, 2, 8, True)


@pytest.mark.parametrize("kind", ["object", "object_sum", "mse", "function"])
@pytest.mark.parametrize("towers, rows, static", SHAPES[:4], ids=SHAPE_IDS[:4])
def test_keras_losses(kind, towers, rows, static):
  _assert_like_one_device(_keras_loss(kind), towers, rows, static)


@pytest.mark.parametrize("towers, rows, static", SHAPES, ids=SHAPE_IDS)
def test_terms_of_different_denominators(towers, rows, static):
  _assert_like_one_device(_multi_term_loss, towers, rows, static, "adam")


def _build(loss_fn, towers=2, **wrap_kwargs):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    inputs = {k: tf.compat.v1.placeholder(_DTYPES[k], [None] + _SHAPES[k])
              for k in _SHAPES}
    replicate.replicate_model_fn(
        _model_fn(loss_fn), devices=cpus(towers), **wrap_kwargs)(
            {k: inputs[k] for k in ("tokens", "x", "mask")},
            {k: inputs[k] for k in ("targets", "class", "y")}, TRAIN)


def test_an_unread_denominator_is_refused_naming_the_op_and_the_fix():
  def loss_fn(features, labels):
    token_logits, _ = _logits(features)
    xentropy, weights = _padded_cross_entropy(
        token_logits, labels["targets"], 0.1, VOCAB)
    return tf.reduce_sum(xentropy) / tf.maximum(tf.reduce_sum(weights), 1.0)
  with pytest.raises(ValueError, match=r"RealDiv op .*truediv.*divides by "
                     r"Maximum.*replicate.loss_denominator.*Reduction.SUM"):
    _build(loss_fn)


def test_an_unread_term_is_refused():
  def loss_fn(features, labels):
    _, row_logits = _logits(features)
    return tf.reduce_max(row_logits)
  with pytest.raises(ValueError, match=r"the Max op .*replicate.loss_"
                     r"denominator"):
    _build(loss_fn)


def test_the_stated_denominator_wins():
  def loss_fn(features, labels):
    token_logits, _ = _logits(features)
    xentropy, weights = _padded_cross_entropy(
        token_logits, labels["targets"], 0.1, VOCAB)
    replicate.loss_denominator(tf.reduce_sum(weights) + 1e-12)
    return tf.reduce_sum(xentropy) / (tf.reduce_sum(weights) + 1e-12)
  _assert_like_one_device(loss_fn, 3, 7, False)


def test_sum_with_a_ratio_term_is_refused():
  with pytest.raises(ValueError, match=r"loss_reduction=Reduction.SUM.*"
                     r"truediv.*RealDiv.*divided by"):
    _build(_transformer_loss, loss_reduction=Reduction.SUM)


@pytest.mark.parametrize("reduction", [
    Reduction.MEAN, Reduction.SUM_OVER_BATCH_SIZE])
def test_an_averaging_reduction_on_a_summed_loss_is_refused(reduction):
  with pytest.raises(ValueError, match=r"loss_reduction='{}'.*a sum over "
                     r"rows.*Reduction.SUM".format(reduction)):
    _build(_v1_loss(Reduction.SUM), loss_reduction=reduction)


def _mean_of_column_means(features, labels):
  _, row_logits = _logits(features)
  squares = tf.square(row_logits - labels["y"])  # [n, 3]
  return tf.reduce_mean(tf.reduce_mean(squares, axis=0))


def test_a_term_over_a_reduction_of_the_batch_axis_is_refused():
  with pytest.raises(ValueError, match=r"the Mean op .*reduction over the "
                     r"batch axis.*replicate.loss_denominator"):
    _build(_mean_of_column_means)


def test_an_explicit_reduction_weighs_what_the_graph_cannot_read():
  # Stated by the user (as tf.contrib code does), the mean of the columns'
  # means over rows is weighted by the rows' shares, as MEAN says.
  _assert_like_one_device(_mean_of_column_means, 3, 7, False,
                          loss_reduction=Reduction.MEAN)


def _own_gradients_model_fn(loss_fn):
  """BERT's way: tf.gradients, then the optimizer's apply_gradients."""
  def model_fn(features, labels, mode):
    loss = loss_fn(features, labels)
    if mode == EVAL:
      return tf.estimator.EstimatorSpec(mode, loss=loss)
    tvars = tf.compat.v1.trainable_variables()
    grads = tf.gradients(loss, tvars)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5))
    train_op = optimizer.apply_gradients(
        zip(grads, tvars),
        global_step=tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def test_own_gradients_of_a_row_mean_train_like_one_device():
  loss_fn = _keras_loss("function")
  batches = _batches(7)
  expected_losses, expected = _run(_own_gradients_model_fn(loss_fn), batches)
  losses, values = _run(_own_gradients_model_fn(loss_fn), batches, 3)
  for name, value in expected.items():
    _close(values[name], value, name)
  _close(losses, expected_losses)


def test_own_gradients_of_a_token_mean_are_refused():
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    inputs = {k: tf.compat.v1.placeholder(_DTYPES[k], [None] + _SHAPES[k])
              for k in _SHAPES}
    with pytest.raises(ValueError, match=r"Tower 0 applies gradients it "
                       r"computed itself.*truediv.*divided by.*compute_"
                       r"gradients.*loss_denominator"):
      replicate.replicate_model_fn(
          _own_gradients_model_fn(_transformer_loss), devices=cpus(2))(
              {k: inputs[k] for k in ("tokens", "x", "mask")},
              {k: inputs[k] for k in ("targets", "class", "y")}, TRAIN)


def _divided_by(divisor):
  """A row sum divided by a static count: the shard's own rows (`x.shape[0]`
  in its three spellings) or a hyperparameter of the whole batch's size."""
  def loss_fn(features, labels):
    _, row_logits = _logits(features)
    xentropy = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels["class"], logits=row_logits)
    rows = features["x"].shape[0]
    return tf.reduce_sum(xentropy) / {
        "shape": lambda: rows,
        "cast": lambda: tf.cast(rows, tf.float32),
        "int": lambda: int(rows),
    }.get(divisor, lambda: divisor)()
  return loss_fn


@pytest.mark.parametrize("divisor", ["shape", "cast", "int", "batch_size"])
@pytest.mark.parametrize("towers, rows", [(2, 8), (2, 7), (3, 8), (3, 2)])
def test_a_sum_divided_by_the_static_row_count(divisor, towers, rows):
  # reduce_sum(xent) / x.shape[0] with a batch of known size: TensorFlow
  # makes x.shape[0] a constant, the tower's row count n_i (4 of 8 rows on
  # 2 towers). Observed on main f27fa8c: read as a sum scaled by a constant,
  # summed over towers: the loss 2.19598 for one device's 1.09799 (8 rows
  # on 2 towers; 2.09240 for 1.05645 with 7), the kernel's change off by
  # 73 % (116 % with 7). A hyperparameter of the whole batch's size
  # (`/ params["batch_size"]`) is the same constant on one device: a sum.
  if divisor == "batch_size":
    divisor = float(rows)
  batches = _batches(rows)
  model_fn = _model_fn(_divided_by(divisor))
  for mode in (TRAIN, EVAL):
    expected_losses, expected = _run(model_fn, batches, static=True,
                                     mode=mode)
    losses, values = _run(model_fn, batches, towers, static=True, mode=mode)
    _close(losses, expected_losses, "loss per step")
    for name, value in expected.items():
      _close(values[name], value, name)

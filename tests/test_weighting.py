"""Tower weights: `replicate.loss_denominator`, and weighted canned heads."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import TRAIN, cpus, session_config

Reduction = tf.compat.v1.losses.Reduction
fc = tf.feature_column


def _build(model_fn, towers=2, rows=5, **wrap_kwargs):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    return replicate.replicate_model_fn(model_fn, devices=cpus(towers),
                                        **wrap_kwargs)(
        {"x": tf.ones([rows, 2])}, tf.zeros([rows]), TRAIN)


def _model_fn(denominators=1, before_optimizer=True, denominator_shape=()):

  def model_fn(features, labels, mode):
    del labels
    w = tf.compat.v1.get_variable("w", [2, 1])
    loss = tf.reduce_mean(tf.matmul(features["x"], w))
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))
    if not before_optimizer:
      grads = optimizer.compute_gradients(loss)
    for _ in range(denominators):
      replicate.loss_denominator(tf.ones(denominator_shape))
    if before_optimizer:
      grads = optimizer.compute_gradients(loss)
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=optimizer.apply_gradients(grads))

  return model_fn


def test_loss_denominator_with_a_summed_loss_is_refused():
  with pytest.raises(ValueError, match="loss_reduction=Reduction.SUM"):
    _build(_model_fn(), loss_reduction=Reduction.SUM)


def test_loss_denominator_twice_in_a_tower_is_refused():
  with pytest.raises(ValueError, match="called twice in tower 0"):
    _build(_model_fn(denominators=2))


def test_loss_denominator_after_the_optimizer_is_refused():
  with pytest.raises(ValueError, match="after the tower's loss was weighted"):
    _build(_model_fn(before_optimizer=False))


def test_loss_denominator_of_a_vector_is_refused():
  with pytest.raises(ValueError, match="takes a scalar.*shape \\(3,\\)"):
    _build(_model_fn(denominator_shape=(3,)))


def test_loss_denominator_in_some_towers_only_is_refused():
  calls = []

  def model_fn(features, labels, mode):
    calls.append(len(calls))
    if len(calls) == 1:  # tower 0 only
      replicate.loss_denominator(3.0)
    return _model_fn(denominators=0)(features, labels, mode)

  with pytest.raises(ValueError, match="not in tower\\(s\\) \\[1, 2\\]"):
    _build(model_fn, towers=3)


def test_loss_denominator_weights_towers_by_their_denominators():
  # Tower 0 states 1, tower 1 states 3: weights 1/4 and 3/4, so the
  # combined loss is 0.25 * 2.0 + 0.75 * 2.0 = 2.0 and the gradient of w is
  # that of one mean over the batch.
  calls = []

  def model_fn(features, labels, mode):
    del labels
    calls.append(len(calls))
    w = tf.compat.v1.get_variable("w", [2, 1],
                                  initializer=tf.ones_initializer())
    loss = tf.reduce_mean(tf.matmul(features["x"], w))
    replicate.loss_denominator(1.0 if len(calls) == 1 else 3.0)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0))
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=optimizer.minimize(loss))

  with tf.Graph().as_default():
    spec = replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        {"x": tf.ones([4, 2])}, None, TRAIN)
    w = tf.compat.v1.global_variables()[0]
    with tf.compat.v1.Session(config=session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      _, loss = session.run([spec.train_op, spec.loss])
      # d(mean(x w))/dw = mean of x = 1 per weight, in each tower; the
      # weighted sum is 1: w = 1 - 1.0 * 1 = 0.
      np.testing.assert_allclose(session.run(w), [[0.0], [0.0]], atol=1e-6)
  assert loss == pytest.approx(2.0)


def test_gradient_transformers_must_be_a_list_of_functions():
  with pytest.raises(ValueError, match="list of functions.*Received: 3"):
    replicate.TowerOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                             gradient_transformers=3)
  with pytest.raises(ValueError, match="list of functions"):
    replicate.TowerOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                             gradient_transformers=[None])


# Canned heads with a weight column.

ROWS = 7
_rng = np.random.RandomState(5)
X = _rng.rand(ROWS, 2).astype(np.float32)
WEIGHT = np.array([[1.0], [0.0], [2.0], [0.0], [1.0], [3.0], [0.0]],
                  np.float32)
LABEL = np.array([0, 1, 1, 0, 1, 0, 1])


def _linear(family, model_dir, **kwargs):
  module = tf.estimator if family == "v2" else tf.compat.v1.estimator
  optimizer = replicate.TowerOptimizer(
      (lambda: tf.keras.optimizers.legacy.SGD(0.5)) if family == "v2" else
      (lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5)))
  return module.LinearClassifier([fc.numeric_column("x", shape=[2])],
                                 weight_column="weight", optimizer=optimizer,
                                 model_dir=model_dir, **kwargs)


def _input_fn():
  return tf.data.Dataset.from_tensor_slices(
      ({"x": X, "weight": WEIGHT}, LABEL)).repeat(3).batch(ROWS)


@pytest.mark.parametrize("reduction", [Reduction.MEAN,
                                       Reduction.SUM_BY_NONZERO_WEIGHTS])
def test_v1_head_dividing_by_its_weights_is_refused(reduction, tmp_path):
  canned = _linear("v1", str(tmp_path), loss_reduction=reduction)
  with pytest.raises(ValueError, match="weight_column='weight'.*"
                     "Reduction.SUM_OVER_BATCH_SIZE"):
    replicate.replicate_model_fn(canned.model_fn, loss_reduction=reduction)


@pytest.mark.parametrize("family,head_reduction,reduction", [
    ("v1", Reduction.SUM, Reduction.SUM),
    ("v1", Reduction.SUM_OVER_BATCH_SIZE, Reduction.SUM_OVER_BATCH_SIZE),
    ("v2", None, Reduction.SUM_BY_NONZERO_WEIGHTS),
])
def test_weighted_canned_heads_train_like_one_device(family, head_reduction,
                                                     reduction, tmp_path):
  kwargs = {"loss_reduction": head_reduction} if head_reduction else {}
  unwrapped = _linear(family, str(tmp_path / "one"), **kwargs)
  unwrapped.train(_input_fn)
  canned = _linear(family, str(tmp_path / "towers"), **kwargs)
  wrapped = tf.estimator.Estimator(
      replicate.replicate_model_fn(canned.model_fn, loss_reduction=reduction),
      model_dir=str(tmp_path / "towers"),
      config=tf.estimator.RunConfig(session_config=session_config(3)))
  wrapped.train(_input_fn)
  for name, _ in tf.train.list_variables(unwrapped.model_dir):
    np.testing.assert_allclose(
        tf.train.load_variable(wrapped.model_dir, name),
        tf.train.load_variable(unwrapped.model_dir, name), rtol=1e-5,
        atol=1e-6, err_msg=name)

"""Tower weights: `replicate.loss_denominator`, and weighted canned heads."""

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from conftest import EVAL, TRAIN, cpus, session_config

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


# A masked mean whose last tower holds only padding: its denominator is 0.

MASKED_ROWS = 6  # 3 + 3 rows on 2 towers, 2 + 2 + 2 on 3
# Padding at the end of the batch, as a padded batch has it: tower 1 of 2
# and tower 2 of 3 hold only padding (d = 0); tower 1 of 3 keeps 1 row.
MASK = np.array([1, 1, 1, 0, 0, 0], np.float32)
MASKED_STEPS = 3


def _masked_batches(mask=MASK, steps=MASKED_STEPS):
  rng = np.random.RandomState(3)
  return [(rng.rand(MASKED_ROWS, 3).astype(np.float32) * 2 - 1,
           rng.randint(0, 3, size=MASKED_ROWS).astype(np.int32), mask)
          for _ in range(steps)]


def _masked_mean_model_fn(features, labels, mode):
  """docs/api.md's mean over a padding mask's tokens."""
  logits = tf.compat.v1.layers.dense(
      features["x"], 3, name="logits",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.6, 0.6, 9).reshape(3, 3)))
  mask = features["mask"]
  ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                      logits=logits)
  loss = tf.reduce_sum(ce * mask) / tf.reduce_sum(mask)
  replicate.loss_denominator(tf.reduce_sum(mask))
  if mode == EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "masked_ce": tf.compat.v1.metrics.mean(ce, weights=mask)})
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step()))


def _train_masked(batches, towers=None, static=False, **wrap_kwargs):
  """Trains the masked mean on `batches`: (losses, {variable: value}).

  `towers=None` is the oracle: the model_fn unwrapped on one device.
  `static` gives the batch a size known when building (so every tower is
  known to have rows), else it is known only at run time.
  """
  as_inputs = lambda x, y, mask: {"x": np.asarray(x, np.float32),
                                  "y": np.asarray(y, np.int32),
                                  "mask": np.asarray(mask, np.float32)}
  run = harness.train(
      _masked_mean_model_fn, [as_inputs(*batch) for batch in batches],
      towers, known_rows=static, session_towers=towers or 1,
      like=as_inputs(*_masked_batches(steps=1)[0]), **wrap_kwargs)
  return run.per_step("loss"), run.variables


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("strategy", ["parameter_server", "replicated"])
@pytest.mark.parametrize("towers", [2, 3])
def test_a_tower_of_padding_only_adds_nothing(towers, strategy, static):
  # The loss is the mean of ce over the 3 real rows, whatever the towers.
  # Tower 1 of 2 (tower 2 of 3) has d = 0: its loss is 0 / 0 = NaN and its
  # weight 0 / 3 = 0, and 0 x NaN is NaN, in the loss and in its gradients,
  # unless the tower is chosen away as a tower without rows is.
  expected_losses, expected = _train_masked(_masked_batches())
  losses, values = _train_masked(_masked_batches(), towers, static,
                                 variable_strategy=strategy)
  assert np.all(np.isfinite(losses)) and np.all(np.isfinite(expected_losses))
  assert expected["global_step"] == MASKED_STEPS
  assert sorted(values) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["parameter_server", "replicated"])
def test_a_tower_of_padding_first_adds_nothing(strategy):
  # Tower 0 builds the update and still holds only padding: rows 0-1 of 3
  # towers. The mean is over rows 2-5.
  mask = np.array([0, 0, 1, 1, 1, 1], np.float32)
  expected_losses, expected = _train_masked(_masked_batches(mask))
  losses, values = _train_masked(_masked_batches(mask), 3,
                                 variable_strategy=strategy)
  assert np.all(np.isfinite(losses))
  for name, value in expected.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("strategy", ["parameter_server", "replicated"])
@pytest.mark.parametrize("towers", [2, 3])
def test_a_batch_of_padding_only_trains_a_finite_no_op_step(
    towers, strategy, static):
  # Every row is padding, then two ordinary batches. Unwrapped, the loss is
  # 0 / 0 = NaN and so is every gradient (d loss / d ce = mask / sum(mask) =
  # 0 x inf): every variable is NaN from then on, and the Estimator stops
  # with NanLossDuringTrainingError. Wrapped, every tower's denominator is
  # 0, so no tower counts (API.md: such a tower "contributes no NaN"): the
  # step is a finite no-op, loss 0, variables unchanged, global step + 1, as
  # on a batch found empty at run time (tests/test_sharding.py). We keep
  # that rather than copy the NaN: nothing was there to learn from, and a
  # NaN would end the training run. The next steps then train as unwrapped
  # does on the ordinary batches alone.
  padding = _masked_batches(np.zeros(MASKED_ROWS, np.float32), steps=1)
  ordinary = _masked_batches(steps=2)
  nan_losses, nan_values = _train_masked(padding + ordinary)
  assert np.all(np.isnan(nan_losses))
  assert np.all(np.isnan(nan_values["logits/kernel"]))
  _, initial = _train_masked(padding[:0])
  expected_losses, expected = _train_masked(ordinary)
  losses, values = _train_masked(padding + ordinary, towers, static,
                                 variable_strategy=strategy)
  _, after_padding = _train_masked(padding, towers, static,
                                   variable_strategy=strategy)
  assert losses[0] == 0.0
  assert after_padding["global_step"] == 1
  assert values["global_step"] == expected["global_step"] + 1 == 3
  for name, value in initial.items():
    if name != "global_step":
      np.testing.assert_array_equal(after_padding[name], value, err_msg=name)
  for name, value in expected.items():
    if name != "global_step":
      np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6,
                                 err_msg=name)
  np.testing.assert_allclose(losses[1:], expected_losses, rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("towers", [2, 3])
def test_a_tower_of_padding_only_adds_nothing_to_the_eval_loss(towers):
  # The same batch evaluated: the loss is the mean of ce over rows 0-2, and
  # so is the metric (weighted by the mask, so padding weighs 0 anyway).
  x, y, mask = _masked_batches(steps=1)[0]
  results = []
  for model_fn in (_masked_mean_model_fn, replicate.replicate_model_fn(
      _masked_mean_model_fn, devices=cpus(towers))):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      inputs = (tf.compat.v1.placeholder(tf.float32, [None, 3]),
                tf.compat.v1.placeholder(tf.int32, [None]),
                tf.compat.v1.placeholder(tf.float32, [None]))
      spec = model_fn(features={"x": inputs[0], "mask": inputs[2]},
                      labels=inputs[1], mode=EVAL)
      value, update = spec.eval_metric_ops["masked_ce"]
      with tf.compat.v1.Session(config=session_config(towers)) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(tf.compat.v1.local_variables_initializer())
        loss, _ = session.run([spec.loss, update],
                              dict(zip(inputs, (x, y, mask))))
        results.append((loss, session.run(value)))
  (expected_loss, expected_metric), (loss, metric) = results
  assert np.isfinite(loss)
  assert loss == pytest.approx(expected_loss, rel=1e-5)
  assert metric == pytest.approx(expected_metric, rel=1e-5)
  assert metric == pytest.approx(expected_loss, rel=1e-5)

"""TowerOptimizer: forwarding, loss weighting, one update per step, errors."""

import threading

import pytest
import tensorflow as tf

import replicate
from conftest import TRAIN, cpus, run_initialized

Reduction = tf.compat.v1.losses.Reduction


def _linear_model_fn(reduction=Reduction.MEAN, learning_rate=0.5):
  """loss = reduce(w * x): its gradient in w is mean(x) (or sum(x))."""

  def model_fn(features, labels, mode):
    del labels
    w = tf.compat.v1.get_variable("w", [], initializer=tf.zeros_initializer())
    per_row = w * features
    loss = (tf.reduce_sum(per_row) if reduction == Reduction.SUM else
            tf.reduce_mean(per_row))
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(learning_rate))
    train_op = optimizer.minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.parametrize("towers", [1, 2, 3])
def test_mean_loss_gradient_is_the_whole_batch_mean(graph, towers):
  model_fn = _linear_model_fn(Reduction.MEAN, learning_rate=0.5)
  wrapped = replicate.replicate_model_fn(model_fn, devices=cpus(towers))
  spec = wrapped(tf.constant([1.0, 2.0, 3.0]), None, TRAIN)
  w = tf.compat.v1.trainable_variables()[0]
  step = tf.compat.v1.train.get_global_step()
  with tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(
      device_count={"CPU": 3})) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    session.run(spec.train_op)
    # d mean(w * x) / dw = mean(x) = 2; new w = 0 - 0.5 * 2 = -1.0,
    # whether the 3 rows are on 1 tower, 2 (2 + 1 rows) or 3.
    assert session.run(w) == pytest.approx(-1.0)
    # loss at w = -1: mean(-x) = -2.0, the whole batch's mean.
    assert session.run(spec.loss) == pytest.approx(-2.0)
    session.run(spec.train_op)
    assert session.run(step) == 2  # one increment per step, not per tower
    assert session.run(w) == pytest.approx(-2.0)


def test_sum_reduction_sums_tower_gradients(graph):
  wrapped = replicate.replicate_model_fn(
      _linear_model_fn(Reduction.SUM, learning_rate=0.5),
      loss_reduction=Reduction.SUM, devices=cpus(2))
  spec = wrapped(tf.constant([1.0, 2.0, 3.0]), None, TRAIN)
  w = tf.compat.v1.trainable_variables()[0]
  # d sum(w * x) / dw = 6; new w = 0 - 0.5 * 6 = -3.0; loss = sum(-3x) = -18.
  with tf.control_dependencies([spec.train_op]):
    w_after = tf.identity(w.read_value())
  assert run_initialized(w_after) == pytest.approx(-3.0)


def test_a_train_op_change_that_ignores_the_rows_happens_once_per_step(graph):
  # Unwrapped, the counter gains 1 per step; so it must wrapped, not 1 per
  # tower: only changes computed from a tower's own rows run in every tower.
  def model_fn(features, labels, mode):
    counter = tf.compat.v1.get_variable(
        "steps_run", [], trainable=False, initializer=tf.zeros_initializer())
    spec = _linear_model_fn()(features, labels, mode)
    side_effect = tf.compat.v1.assign_add(counter, 1.0)
    return spec._replace(train_op=tf.group(spec.train_op, side_effect))

  spec = replicate.replicate_model_fn(model_fn, devices=cpus(3))(
      tf.ones([6]), None, TRAIN)
  counter = [v for v in tf.compat.v1.global_variables()
             if v.op.name == "steps_run"][0]
  with tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(
      device_count={"CPU": 3})) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    session.run(spec.train_op)
    session.run(spec.train_op)
    assert session.run(counter) == 2.0  # 2 steps, whatever the towers


def test_several_optimizers_and_losses_each_apply_once(graph):
  def model_fn(features, labels, mode):
    del labels
    a = tf.compat.v1.get_variable("a", [], initializer=tf.zeros_initializer())
    b = tf.compat.v1.get_variable("b", [], initializer=tf.zeros_initializer())
    loss_a = tf.reduce_mean(a * features)
    loss_b = tf.reduce_mean(b * features * 2.0)
    step = tf.compat.v1.train.get_global_step()
    train_a = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0)).minimize(
            loss_a, var_list=[a], global_step=step)
    train_b = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
            loss_b, var_list=[b])
    return tf.estimator.EstimatorSpec(
        mode, loss=loss_a + loss_b, train_op=tf.group(train_a, train_b))

  spec = replicate.replicate_model_fn(model_fn, devices=cpus(2))(
      tf.constant([1.0, 2.0, 3.0, 6.0]), None, TRAIN)
  with tf.control_dependencies([spec.train_op]):
    values = [tf.identity(v.read_value())
              for v in tf.compat.v1.global_variables()]
  # mean(x) = 3: a = 0 - 1.0 * 3 = -3; b = 0 - 0.1 * 2 * 3 = -0.6.
  names = [v.op.name for v in tf.compat.v1.global_variables()]
  result = dict(zip(names, run_initialized(values)))
  assert result["a"] == pytest.approx(-3.0)
  assert result["b"] == pytest.approx(-0.6)
  assert result["global_step"] == 1


def test_variables_without_gradient_are_left_alone(graph):
  def model_fn(features, labels, mode):
    unused = tf.compat.v1.get_variable("unused", [],
                                       initializer=tf.ones_initializer())
    del unused
    return _linear_model_fn()(features, labels, mode)

  spec = replicate.replicate_model_fn(model_fn, devices=cpus(2))(
      tf.constant([1.0, 3.0]), None, TRAIN)
  with tf.control_dependencies([spec.train_op]):
    values = {v.op.name: tf.identity(v.read_value())
              for v in tf.compat.v1.global_variables()}
  result = run_initialized(values)
  assert result["unused"] == 1.0
  assert result["w"] == pytest.approx(-1.0)  # 0 - 0.5 * mean([1, 3])


def test_no_tower_optimizer_with_several_towers_is_refused(graph):
  def model_fn(features, labels, mode):
    w = tf.compat.v1.get_variable("w", [])
    loss = tf.reduce_mean(w * features)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(ValueError,
                     match="Please wrap optimizers with TowerOptimizer"):
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.ones([4]), None, TRAIN)


def _model_fn_calling_minimize(times_per_tower):
  """Tower i calls minimize times_per_tower[i] times."""

  towers_built = []

  def model_fn(features, labels, mode):
    del labels
    tower = len(towers_built)
    towers_built.append(tower)
    w = tf.compat.v1.get_variable("w", [])
    loss = tf.reduce_mean(w * features)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))
    ops = [optimizer.minimize(loss) for _ in range(times_per_tower[tower])]
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(*ops))

  return model_fn


@pytest.mark.parametrize("calls", [[1, 2], [2, 1]])
def test_towers_making_different_optimizer_calls_are_refused(graph, calls):
  with pytest.raises(ValueError,
                     match="was supposed to make the same optimizer calls"):
    replicate.replicate_model_fn(
        _model_fn_calling_minimize(calls), devices=cpus(2))(
            tf.ones([4]), None, TRAIN)


def test_outside_replicate_model_fn_every_call_is_forwarded(graph):
  wrapped_adam = tf.compat.v1.train.AdamOptimizer(0.1)
  optimizer = replicate.TowerOptimizer(wrapped_adam)
  assert isinstance(optimizer, tf.compat.v1.train.Optimizer)
  w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
  train_op = optimizer.minimize(w * 3.0)
  assert optimizer.get_slot_names() == ["m", "v"]
  assert optimizer.get_slot(w, "m") is wrapped_adam.get_slot(w, "m")
  assert optimizer.get_name() == "Adam"
  assert {v.op.name for v in optimizer.variables()} == {
      "beta1_power", "beta2_power", "w/Adam", "w/Adam_1"
  }
  with tf.control_dependencies([train_op]):
    w_after = tf.identity(w.read_value())
  # Adam's first step moves w by the learning rate: 1 - 0.1 = 0.9.
  assert run_initialized(w_after) == pytest.approx(0.9, rel=1e-5)


def test_an_optimizer_function_is_called_once_per_graph():
  calls = []

  def optimizer_fn():
    calls.append(1)
    return tf.compat.v1.train.GradientDescentOptimizer(0.1)

  optimizer = replicate.TowerOptimizer(optimizer_fn)
  assert len(calls) == 1  # once in a scratch graph, to learn the family
  for _ in range(2):
    with tf.Graph().as_default():
      first = optimizer.optimizer
      assert optimizer.optimizer is first
  assert len(calls) == 3  # and once in each of the 2 graphs


@pytest.mark.parametrize("bad, expected", [
    (0.1, "wraps a tf.compat.v1.train.Optimizer, a tf.keras.optimizers."
     "legacy.Optimizer, or a function of no arguments returning one. "
     "Received: 0.1."),
    # A Keras 2.11+ (non-legacy) optimizer is neither family.
    (tf.keras.optimizers.SGD, "must return a tf.compat.v1.train.Optimizer"),
])
def test_bad_optimizers_are_named(graph, bad, expected):
  with pytest.raises(ValueError, match=expected):
    replicate.TowerOptimizer(bad).optimizer


def test_wrapping_twice_is_refused():
  once = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1))
  with pytest.raises(ValueError, match="wrap the optimizer once"):
    replicate.TowerOptimizer(once)


def test_sync_replicas_optimizer_inside_tower_optimizer_trains(graph):
  sync_optimizers = []

  def model_fn(features, labels, mode):
    del labels
    w = tf.compat.v1.get_variable("w", [], initializer=tf.zeros_initializer())
    loss = tf.reduce_mean(w * features)
    sync = tf.compat.v1.train.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5),
        replicas_to_aggregate=1, total_num_replicas=1)
    sync_optimizers.append(sync)
    train_op = replicate.TowerOptimizer(sync).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  spec = replicate.replicate_model_fn(model_fn, devices=cpus(2))(
      tf.constant([1.0, 2.0, 3.0]), None, TRAIN)
  # Tower 0's SyncReplicasOptimizer is the one that applies, so the hook a
  # model_fn makes from it (tower 0's hooks are the spec's) works.
  sync = sync_optimizers[0]
  sync.make_session_run_hook(is_chief=True).begin()
  w = [v for v in tf.compat.v1.global_variables() if v.op.name == "w"][0]
  # What the hook's queue runner does, one step at a time so the test is
  # deterministic: the worker step sends its gradient and waits for a token;
  # the chief step applies the aggregated gradient and hands out the token.
  chief_step = sync.get_chief_queue_runner().enqueue_ops[0]
  with tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(
      device_count={"CPU": 2})) as session:
    session.run([tf.compat.v1.global_variables_initializer(),
                 tf.compat.v1.local_variables_initializer()])
    # Every variable the worker needs is initialised (tower 0's optimizer
    # built the accumulators and the local step this check lists).
    assert session.run(sync.ready_for_local_init_op).size == 0
    session.run(sync.chief_init_op)
    for _ in range(3):
      worker = threading.Thread(target=session.run, args=(spec.train_op,))
      worker.start()
      session.run(chief_step)
      worker.join()
    # Each step: w -= 0.5 * mean(x) = 0.5 * 2 = 1.0, applied once per step.
    step, value = session.run([tf.compat.v1.train.get_global_step(), w])
  assert step == 3
  assert value == pytest.approx(-3.0)


def test_keras_optimizer_minimize_applies_once_across_towers(graph):
  def model_fn(features, labels, mode):
    del labels
    w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
    optimizer = replicate.TowerOptimizer(tf.keras.optimizers.legacy.SGD(0.5))
    assert isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer)
    loss_fn = lambda: tf.reduce_mean(w * features)  # noqa: E731
    return tf.estimator.EstimatorSpec(
        mode, loss=loss_fn(), train_op=optimizer.minimize(loss_fn, [w]))

  spec = replicate.replicate_model_fn(model_fn, devices=cpus(2))(
      tf.constant([1.0, 2.0, 3.0]), None, TRAIN)
  variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
  with tf.control_dependencies([spec.train_op]):
    after = {name: tf.identity(v.read_value())
             for name, v in variables.items()}
  result = run_initialized(after)
  # w = 1 - 0.5 * mean([1, 2, 3]) = 0.0; Keras counts one iteration.
  assert result["w"] == pytest.approx(0.0)
  assert result["SGD/iter"] == 1

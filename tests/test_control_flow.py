"""Control flow in a tower runs on the tower's device.

`tf.cond`, `tf.while_loop` and RNNs build `If` / `While` ops (and the
functions they call) that take a captured variable's handle. Every op a
tower builds, those included, must be on the tower's device, except the
reads and writes of variables, which run where the variable lives, with
every `variable_strategy`. And the towers must still train like one device
with strict placement. The functional ops are TF 2's (this file runs in the
first, TF 2 run of `make test`); v1 control flow is built here by turning
control flow v2 off for one test.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import TRAIN, cpus, session_config

ROWS = 7  # uneven over 2 (4, 3) and 3 (3, 2, 2) towers
_rng = np.random.RandomState(10)
X = _rng.rand(ROWS, 3).astype(np.float32)
Y = _rng.rand(ROWS, 1).astype(np.float32)

# Ops on a variable's handle: they run where the variable lives.
_VARIABLE_ACCESS = frozenset([
    "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp",
    "AssignSubVariableOp", "ResourceGather", "VariableShape",
    "VarIsInitializedOp", "ResourceApplyGradientDescent"])


def _constant(shape, start):
  return tf.compat.v1.constant_initializer(
      np.linspace(start, -start, int(np.prod(shape))).reshape(shape))


def _control_flow_model_fn(keras_lstm=True):
  """tf.cond, tf.while_loop, dynamic_rnn and (optionally) a Keras LSTM.

  Without the LSTM for v1 control flow in a TF 2 process: the Keras LSTM
  fails there unwrapped ("TensorArray ... has already been written to").
  """

  def model_fn(features, labels, mode):
    weights = tf.compat.v1.get_variable("weights", [3, 3],
                                        initializer=_constant([3, 3], 0.4))
    hidden = tf.cond(tf.reduce_sum(features) > 0.0,
                     lambda: tf.matmul(features, weights),
                     lambda: tf.matmul(features, -weights))
    _, hidden = tf.while_loop(
        lambda step, value: step < 2,
        lambda step, value: (step + 1, tf.tanh(tf.matmul(value, weights))),
        [0, hidden])
    sequence = tf.stack([hidden, 2.0 * hidden], axis=1)  # [batch, 2, 3]
    cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(
        3, name="rnn_cell")
    with tf.compat.v1.variable_scope(
        "rnn", initializer=tf.compat.v1.constant_initializer(0.1)):
      outputs, _ = tf.compat.v1.nn.dynamic_rnn(cell, sequence,
                                               dtype=tf.float32)
    if keras_lstm:
      last = tf.keras.layers.LSTM(
          2, kernel_initializer=tf.keras.initializers.Constant(0.2),
          recurrent_initializer=tf.keras.initializers.Constant(-0.1))(outputs)
    else:
      last = outputs[:, -1]
    prediction = tf.compat.v1.layers.dense(
        last, 1, name="out",
        kernel_initializer=tf.compat.v1.constant_initializer(0.5))
    loss = tf.compat.v1.losses.mean_squared_error(labels, prediction)
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(
            0.5 if keras_lstm else 0.1)).minimize(
                loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


_model_fn = _control_flow_model_fn()


def _build(model_fn, towers):
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = model_fn(tf.constant(X), tf.constant(Y), TRAIN)
  return graph, spec


def _placed_by_the_model():
  """Ops the model_fn pins itself (Keras's LSTM puts `runtime` on the CPU)."""
  graph, _ = _build(_model_fn, 1)
  return {op.name for op in graph.get_operations() if op.device}


def _misplaced(graph, tower, device):
  """Tower `tower`'s ops not on `device` that are no variable access.

  Ops the model_fn pins itself keep their device, as unwrapped.
  """
  pinned = _placed_by_the_model()
  def is_variable_access(node_type, input_types):
    # A handle passed through (the While's output of a captured variable)
    # is the variable's too.
    return node_type in _VARIABLE_ACCESS or (
        node_type == "Identity" and input_types == [tf.resource])

  prefix = "tower_{}/".format(tower)
  found = [(op.name, op.type, op.device) for op in graph.get_operations()
           if op.name.startswith(prefix) and op.device != device and
           op.name[len(prefix):] not in pinned and
           not is_variable_access(op.type, [t.dtype for t in op.inputs])]
  # The functions the tower's If / While ops call, and their gradients.
  function_prefix = "tower_{}_".format(tower)
  for function in graph.as_graph_def().library.function:
    if not function.signature.name.startswith(function_prefix):
      continue
    found += [(function.signature.name + "/" + node.name, node.op,
               node.device) for node in function.node_def
              if node.device != device and node.op not in _VARIABLE_ACCESS]
  return found


STRATEGIES = ["parameter_server", "round_robin", "replicated"]
_FUNCTIONAL = ("If", "StatelessIf", "While", "StatelessWhile")


def _function_nodes(graph, tower):
  """(function name, node) for the functions tower `tower`'s ops call."""
  prefix = "tower_{}_".format(tower)
  return [(function.signature.name, node)
          for function in graph.as_graph_def().library.function
          if function.signature.name.startswith(prefix)
          for node in function.node_def]


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_op_of_a_tower_is_on_its_device(strategy, towers):
  # Every strategy: the If / While ops of tf.cond, tf.while_loop,
  # dynamic_rnn and the LSTM (and their gradients), and every op inside
  # their functions, run on the tower. Variables stay where the strategy
  # puts them, and a read inside a function runs with its variable: on
  # CPU:0 with "parameter_server" (before: the If / While ops of towers
  # 1.. had no device with "parameter_server" and "round_robin").
  graph, _ = _build(replicate.replicate_model_fn(
      _model_fn, devices=cpus(towers), variable_strategy=strategy), towers)
  variables = {v.op.name: v.op.device for v in graph.get_collection(
      tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)}
  if strategy == "parameter_server":
    assert set(variables.values()) == {"/device:CPU:0"}
  elif strategy == "round_robin":
    assert set(variables.values()) == {
        "/device:CPU:{}".format(i) for i in range(towers)}
  for tower in range(1, towers):
    device = "/device:CPU:{}".format(tower)
    control_flow = [op for op in graph.get_operations()
                    if op.name.startswith("tower_{}/".format(tower)) and
                    op.type in _FUNCTIONAL]
    assert len(control_flow) >= 8  # cond, while_loop, rnn, LSTM, gradients
    assert {op.device for op in control_flow} == {device}
    assert _misplaced(graph, tower, device) == []
    reads = {node.device for _, node in _function_nodes(graph, tower)
             if node.op == "ReadVariableOp"}
    expected = {"parameter_server": {"/device:CPU:0"},
                "replicated": {device},
                "round_robin": set(variables.values())}[strategy]
    assert reads and reads <= expected


def _train_strictly(model_fn, towers, steps=3):
  """Losses and trainable variables after `steps`, with strict placement."""
  graph, spec = _build(model_fn, towers)
  with graph.as_default():
    variables = {v.op.name: v for v in tf.compat.v1.trainable_variables()}
    strict = session_config(towers)
    strict.allow_soft_placement = False
    with tf.compat.v1.Session(config=strict) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      # Replicated copies: local variables starting from tower 0's.
      session.run(tf.compat.v1.local_variables_initializer())
      losses = [session.run([spec.loss, spec.train_op])[0]
                for _ in range(steps)]
      return losses, session.run(variables)


def _assert_trains_like_one_device(model_fn, towers, strategy):
  losses, values = _train_strictly(model_fn, 1)
  got_losses, got_values = _train_strictly(replicate.replicate_model_fn(
      model_fn, devices=cpus(towers), variable_strategy=strategy), towers)
  assert losses[-1] < losses[0]
  np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
  assert sorted(got_values) == sorted(values)
  for name, value in values.items():
    np.testing.assert_allclose(got_values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_towers_with_control_flow_train_like_one_device(towers, strategy):
  _assert_trains_like_one_device(_model_fn, towers, strategy)


def _zero_fraction_model_fn(features, labels, mode):
  """A cond whose branch reads a variable and conds on the read's value.

  The canned Linear estimators' `fraction_of_zero_weights`:
  `tf.math.zero_fraction` (a cond on its input's size) of a variable, under
  a cond on the variable's size.
  """
  weights = tf.compat.v1.get_variable("weights", [3, 1],
                                      initializer=_constant([3, 1], 0.4))
  size = tf.size(weights, out_type=tf.int64)
  zeros = tf.cond(tf.equal(size, 0), lambda: tf.constant(0.0),
                  lambda: tf.math.zero_fraction(weights) * tf.cast(
                      size, tf.float32), name="zero_count")
  loss = tf.compat.v1.losses.mean_squared_error(
      labels, tf.matmul(features, weights)) + zeros
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_cond_on_a_read_inside_a_cond_runs_on_the_tower(strategy):
  # Lowered on tower 1 while the variable is on CPU:0, a read inside the
  # outer cond would take the tower's device and the inner cond's Switch,
  # colocated with the read, would keep it: "Cannot colocate nodes" when
  # the session starts. The read is pinned to its variable instead.
  graph, _ = _build(replicate.replicate_model_fn(
      _zero_fraction_model_fn, devices=cpus(2), variable_strategy=strategy),
                    2)
  outer = graph.get_operation_by_name("tower_1/zero_count")
  assert outer.type == "If" and outer.device == "/device:CPU:1"
  reads = [node.device for _, node in _function_nodes(graph, 1)
           if node.op == "ReadVariableOp"]
  variable = {"replicated": "/device:CPU:1"}.get(strategy, "/device:CPU:0")
  assert reads == [variable]
  _assert_trains_like_one_device(_zero_fraction_model_fn, 2, strategy)


_V1_CONTROL_FLOW = frozenset([
    "Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond"])


@pytest.fixture
def v1_control_flow():
  """tf.cond and tf.while_loop build Switch / Merge / Enter ... (TF 1)."""
  was_v2 = tf.compat.v1.control_flow_v2_enabled()
  tf.compat.v1.disable_control_flow_v2()
  try:
    yield
  finally:
    if was_v2:
      tf.compat.v1.enable_control_flow_v2()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_v1_control_flow_runs_on_the_tower(strategy, v1_control_flow):
  # v1 control flow goes through the tower's device function like any op,
  # except what TensorFlow builds under colocate_with, which has a `_class`
  # attribute and the device of what it is colocated with, or none. What
  # passes a handle on (the Enter of a gradient accumulator's stack, of a
  # variable) runs with the resource: on its device; the Enter a variable's
  # read makes (under colocate_with(None), no device) is left to the
  # placer, which puts it with the variable.
  del v1_control_flow
  model_fn = _control_flow_model_fn(keras_lstm=False)
  graph, _ = _build(replicate.replicate_model_fn(
      model_fn, devices=cpus(2), variable_strategy=strategy), 2)
  assert not any(op.type in _FUNCTIONAL for op in graph.get_operations())
  control_flow = [op for op in graph.get_operations()
                  if op.name.startswith("tower_1/") and
                  op.type in _V1_CONTROL_FLOW and
                  not op.node_def.attr["_class"].list.s]
  assert {op.type for op in control_flow} == _V1_CONTROL_FLOW
  on_values = [op for op in control_flow
               if all(t.dtype != tf.resource for t in op.inputs)]
  assert len(on_values) > 50
  assert {op.device for op in on_values} == {"/device:CPU:1"}
  on_handles = [op for op in control_flow
                if op.inputs[0].dtype == tf.resource]
  for op in on_handles:
    source = op.inputs[0].op
    while source.type in ("Enter", "Switch", "Identity"):
      source = source.inputs[0].op
    allowed = {source.device}
    if source.type == "VarHandleOp":
      allowed.add("")
    assert op.device in allowed, (op.name, source.name)
  assert any(op.device == "/device:CPU:1" for op in on_handles)
  _assert_trains_like_one_device(model_fn, 2, strategy)

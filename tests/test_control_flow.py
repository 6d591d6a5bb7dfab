"""Control flow in a tower runs on the tower's device.

`tf.cond`, `tf.while_loop` and RNNs build `If` / `While` ops (and the
functions they call) that take a captured variable's handle. Every op a
tower builds, those included, must be on the tower's device, except the
reads and writes of variables, which run where the variable lives. And the
towers must still train like one device with strict placement.
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


def _model_fn(features, labels, mode):
  weights = tf.compat.v1.get_variable("weights", [3, 3],
                                      initializer=_constant([3, 3], 0.4))
  hidden = tf.cond(tf.reduce_sum(features) > 0.0,
                   lambda: tf.matmul(features, weights),
                   lambda: tf.matmul(features, -weights))
  _, hidden = tf.while_loop(
      lambda step, value: step < 2,
      lambda step, value: (step + 1, tf.tanh(tf.matmul(value, weights))),
      [0, hidden])
  sequence = tf.stack([hidden, 2.0 * hidden], axis=1)  # [batch, 2 steps, 3]
  cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(
      3, name="rnn_cell")
  with tf.compat.v1.variable_scope(
      "rnn", initializer=tf.compat.v1.constant_initializer(0.1)):
    outputs, _ = tf.compat.v1.nn.dynamic_rnn(cell, sequence,
                                             dtype=tf.float32)
  lstm = tf.keras.layers.LSTM(
      2, kernel_initializer=tf.keras.initializers.Constant(0.2),
      recurrent_initializer=tf.keras.initializers.Constant(-0.1))
  prediction = tf.compat.v1.layers.dense(
      lstm(outputs), 1, name="out",
      kernel_initializer=tf.compat.v1.constant_initializer(0.5))
  loss = tf.compat.v1.losses.mean_squared_error(labels, prediction)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


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


@pytest.mark.parametrize("towers", [2, 3])
def test_every_op_of_a_replicated_tower_is_on_its_device(towers):
  # Replicated: each tower's variables are on its device, so its control
  # flow can run there too. (A parameter-server variable captured by an If
  # or While keeps that op with the variable: TensorFlow colocates the
  # lowered control flow with the handle it takes.)
  graph, _ = _build(replicate.replicate_model_fn(
      _model_fn, devices=cpus(towers), variable_strategy="replicated"),
                    towers)
  control_flow = [op for op in graph.get_operations()
                  if op.name.startswith("tower_1/") and
                  op.type in ("If", "StatelessIf", "While", "StatelessWhile")]
  assert len(control_flow) >= 4  # cond, while_loop, dynamic_rnn, LSTM
  for tower in range(1, towers):
    assert _misplaced(graph, tower, "/device:CPU:{}".format(tower)) == []


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("strategy", ["parameter_server", "replicated"])
def test_towers_with_control_flow_train_like_one_device(towers, strategy):
  results = []
  for model_fn, count in ((_model_fn, 1), (replicate.replicate_model_fn(
      _model_fn, devices=cpus(towers), variable_strategy=strategy), towers)):
    graph, spec = _build(model_fn, count)
    with graph.as_default():
      variables = {v.op.name: v for v in tf.compat.v1.trainable_variables()}
      strict = session_config(count)
      strict.allow_soft_placement = False
      with tf.compat.v1.Session(config=strict) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        # Replicated copies: local variables starting from tower 0's.
        session.run(tf.compat.v1.local_variables_initializer())
        losses = [session.run([spec.loss, spec.train_op])[0]
                  for _ in range(3)]
        results.append((losses, session.run(variables)))
  (losses, values), (got_losses, got_values) = results
  assert losses[-1] < losses[0]
  np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
  assert sorted(got_values) == sorted(values)
  for name, value in values.items():
    np.testing.assert_allclose(got_values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)

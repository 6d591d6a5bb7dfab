"""TensorFlow internals `replicate._tf` reads, pinned to TensorFlow 2.15."""

import functools
import os
import pathlib
import subprocess
import sys

import pytest
import tensorflow as tf

import replicate
from replicate import _tf
from conftest import PREDICT, TRAIN


def test_statefulness_is_read_from_the_op_registry(graph):
  v = tf.Variable(1.0)
  assert _tf.is_stateful(v.assign_add(1.0).op)
  assert not _tf.is_stateful(tf.matmul(tf.ones([1, 1]), tf.ones([1, 1])).op)


def test_a_tf_function_call_lists_the_stateful_ops_of_its_body(graph):
  v = tf.Variable(1.0, use_resource=True)

  @tf.function
  def add(x):
    v.assign_add(x)
    return tf.random.uniform([]) + x

  call = add(tf.constant(2.0)).op
  while not call.node_def.attr.get("f") and call.inputs:
    call = call.inputs[0].op
  assert _tf.called_functions(call) >= {"AssignAddVariableOp",
                                        "RandomUniform"}
  assert _tf.called_functions(tf.constant(1.0).op) is None


def test_a_while_loops_body_is_its_function_graph(graph):
  # i, then x: the body's arguments and results are the loop's variables.
  x = tf.compat.v1.placeholder(tf.float32, [None, 2])
  tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0),
                [tf.constant(0), x])
  loop = next(op for op in tf.compat.v1.get_default_graph().get_operations()
              if op.type in ("While", "StatelessWhile"))
  body = _tf.function_graph(loop, "body")
  assert len(body.inputs) == len(body.outputs) == len(loop.inputs)
  assert "Mul" in {op.type for op in body.get_operations()}
  assert _tf.function_graph(loop, "no_such_attr") is None


def test_a_v2_cond_lists_the_stateful_ops_of_both_branches(graph):
  v = tf.Variable(1.0, use_resource=True)
  flag = tf.compat.v1.placeholder_with_default(True, [])
  out = tf.cond(flag, lambda: v.assign(2.0).op and tf.constant(1),
                lambda: tf.constant(0))
  found = {op.type for op in tf.compat.v1.get_default_graph().get_operations()
           if _tf.called_functions(op)}
  assert found & {"If", "StatelessIf"}
  cond = next(op for op in tf.compat.v1.get_default_graph().get_operations()
              if op.type in ("If", "StatelessIf"))
  assert "AssignVariableOp" in _tf.called_functions(cond)
  del out


def _recording_swaps():
  calls = []

  def moments(original, layer, inputs, reduction_axes, keep_dims, mask):
    calls.append(("moments", layer.name))
    return original(layer, inputs, reduction_axes, keep_dims, mask=mask)

  def fused(original, *args, **kwargs):
    calls.append(("fused", kwargs.get("is_training")))
    return original(*args, **kwargs)

  return calls, _tf.batch_norm_swapped(moments, fused)


def test_every_training_batch_norm_reaches_the_swapped_functions(graph):
  images = tf.ones([2, 3, 3, 4])
  calls, swapped = _recording_swaps()
  with swapped:
    tf.compat.v1.layers.batch_normalization(images, training=True,
                                            fused=False, name="v1_plain")
    tf.compat.v1.layers.batch_normalization(images, training=True,
                                            fused=True, name="v1_fused")
    tf.keras.layers.BatchNormalization(name="keras_fused")(images,
                                                           training=True)
    tf.keras.layers.BatchNormalization(name="keras_2d")(tf.ones([2, 4]),
                                                        training=True)
    tf.keras.layers.BatchNormalization(synchronized=True, name="declared")(
        images, training=True)
  assert calls == [("moments", "v1_plain"), ("fused", True), ("fused", True),
                   ("moments", "keras_2d"), ("moments", "declared")]
  # Restored on the way out.
  calls.clear()
  tf.keras.layers.BatchNormalization()(images, training=True)
  assert not calls


def test_the_fused_function_is_held_by_the_swapped_modules_only():
  import sys  # pylint: disable=import-outside-toplevel
  function = tf.compat.v1.nn.fused_batch_norm
  holders = {name for name, module in list(sys.modules.items())
             if getattr(module, "fused_batch_norm", None) is function}
  assert holders == {module.__name__
                     for module in _tf._FUSED_BATCH_NORM_HOLDERS}


def test_fused_layers_move_towards_the_kernels_unbiased_variance(graph):
  # Keras keeps the fused kernel's batch variance, n / (n - 1) times the
  # biased one, for the moving variance: sync's fused path returns it too.
  assert tf.keras.layers.BatchNormalization()._bessels_correction_test_only
  assert tf.compat.v1.layers.BatchNormalization()._bessels_correction_test_only
  x = tf.constant([[[[1.0]], [[3.0]]]])  # 2 elements: biased 1, unbiased 2
  _, mean, variance = tf.compat.v1.nn.fused_batch_norm(
      x, tf.ones([1]), tf.zeros([1]), is_training=True)
  with tf.compat.v1.Session() as session:
    assert session.run([mean, variance]) == [[2.0], [2.0]]


def test_a_function_graph_reads_outer_tensors_through_its_captures(graph):
  # What a tf.cond branch (TF 2 control flow) or a tf.function reads from
  # the graph around it is a capture; its arguments are not.
  outer = tf.compat.v1.placeholder(tf.float32, [2])
  found = {}

  @tf.function
  def function(argument):
    found["graph"] = tf.compat.v1.get_default_graph()
    found["captured"] = tf.identity(outer) * 2.0
    found["argument"] = argument * 2.0
    return found["captured"] + found["argument"]

  function(tf.ones([2]))
  assert found["graph"].outer_graph is graph
  assert list(_tf.enclosing_graphs(found["graph"])) == [found["graph"], graph]
  assert _tf.outer_tensors(found["captured"], graph) == [outer]
  assert _tf.outer_tensors(found["argument"], graph) is None
  assert _tf.outer_tensors(outer, graph) == [outer]


def test_a_cond_is_a_function_graph_or_control_flow_of_the_graph():
  # Either way sync batch norm sees it is nested: TF 2 control flow builds
  # a branch as a function graph, TF 1's in the graph itself, in a context.
  with tf.Graph().as_default() as graph:
    assert not _tf.in_control_flow(graph)
    seen = []

    def branch():
      seen.append((tf.compat.v1.get_default_graph() is graph,
                   _tf.in_control_flow(graph)))
      return tf.constant(1)

    tf.compat.v1.cond(tf.compat.v1.placeholder_with_default(True, []),
                      branch, lambda: tf.constant(0))
  if tf.compat.v1.control_flow_v2_enabled():
    assert seen == [(False, False)]
  else:
    assert seen == [(True, True)]


# The supported TensorFlow ----------------------------------------------------


@pytest.mark.parametrize("version", ["2.16.1", "2.14.0", "3.15.0", "2.1.5"])
def test_a_tensorflow_other_than_2_15_is_refused_with_the_fix(version):
  with pytest.raises(ImportError) as raised:
    _tf.check_tensorflow_version(version)
  message = str(raised.value)
  assert "TensorFlow {} is installed".format(version) in message
  assert "2.15.x" in message and "tf.estimator" in message
  assert 'pip install "tensorflow-cpu==2.15.*"' in message
  assert '"tensorflow-estimator==2.15.*"' in message
  assert '"tensorflow[and-cuda]==2.15.*"' in message
  assert "Python 3.11" in message


@pytest.mark.parametrize("version", ["2.15.0", "2.15.1", tf.__version__])
def test_tensorflow_2_15_is_accepted(version):
  _tf.check_tensorflow_version(version)


def test_importing_replicate_checks_the_tensorflow_version():
  # In a fresh process, with TensorFlow claiming another version.
  code = ("import tensorflow as tf\n"
          "tf.__version__ = '2.16.1'\n"
          "try:\n"
          "  import replicate\n"
          "except ImportError as error:\n"
          "  print('refused:', error)\n"
          "else:\n"
          "  print('imported')\n")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONPATH=os.pathsep.join(
                 [str(pathlib.Path(replicate.__file__).parents[1])] +
                 [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                  if p]))
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout
  assert out.startswith("refused: replicate needs TensorFlow 2.15.x"), out
  assert "TensorFlow 2.16.1 is installed" in out


# The Estimator ----------------------------------------------------------------


def _model_fn(features, labels, mode, params):
  del labels, mode, params
  return features


class _CallableModelFn:

  def __call__(self, features, labels, mode, config):
    del features, labels, mode, config


def test_fn_args_reads_partials_callables_and_methods_as_the_estimator():
  assert _tf.fn_args(_model_fn) == ("features", "labels", "mode", "params")
  assert _tf.fn_args(functools.partial(_model_fn, params={})) == (
      "features", "labels", "mode")
  assert _tf.fn_args(functools.partial(_model_fn, {"x": 1})) == (
      "labels", "mode", "params")
  assert _tf.fn_args(_CallableModelFn()) == ("features", "labels", "mode",
                                             "config")
  assert _tf.fn_args(_CallableModelFn().__call__) == (
      "features", "labels", "mode", "config")

  def keyword_only(features, *, mode):
    del features, mode

  assert _tf.fn_args(keyword_only) == ("features",)


def test_the_estimators_saved_model_export_is_seen_from_the_model_fn(
    tmp_path):
  seen = []

  def model_fn(features, labels, mode):
    seen.append((mode, _tf.in_saved_model_export()))
    prediction = tf.compat.v1.layers.dense(features["x"], 1)
    loss = tf.reduce_sum(prediction)
    if labels is not None:
      loss += tf.reduce_sum(labels)
    return tf.estimator.EstimatorSpec(
        mode, predictions=prediction, loss=loss,
        train_op=tf.compat.v1.assign_add(
            tf.compat.v1.train.get_global_step(), 1),
        export_outputs={"out": tf.estimator.export.PredictOutput(prediction)})

  estimator = tf.estimator.Estimator(model_fn, model_dir=str(tmp_path))
  estimator.train(lambda: ({"x": tf.ones([2, 3])}, tf.ones([2, 1])), steps=1)

  def serving_input_fn():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    return tf.estimator.export.ServingInputReceiver({"x": x}, {"x": x})

  estimator.export_saved_model(str(tmp_path / "export"), serving_input_fn)
  assert seen == [(TRAIN, False), (PREDICT, True)]
  assert not _tf.in_saved_model_export()


@pytest.mark.parametrize("family", ["v1", "v2"])
def test_a_canned_estimators_head_is_in_its_model_fns_closure(family,
                                                              tmp_path):
  column = tf.feature_column.numeric_column("x")
  if family == "v1":
    estimator = tf.compat.v1.estimator.LinearRegressor(
        [column], model_dir=str(tmp_path), weight_column="w",
        loss_reduction=tf.compat.v1.losses.Reduction.SUM)
    reduction = tf.compat.v1.losses.Reduction.SUM
  else:
    estimator = tf.estimator.LinearRegressor(
        [column], model_dir=str(tmp_path), weight_column="w",
        loss_reduction=tf.keras.losses.Reduction.SUM)
    reduction = tf.keras.losses.Reduction.SUM
  model_fn = _tf.estimator_model_fn(estimator)
  heads = [cell.cell_contents for cell in model_fn.__closure__
           if _tf.is_head(cell.cell_contents)]
  assert len(heads) == 1
  assert _tf.head_loss_reduction(heads[0]) == reduction
  assert _tf.head_weight_column(heads[0]) == "w"
  assert not _tf.is_head(column)
  assert _tf.estimator_model_fn(object()) is None


# Devices ----------------------------------------------------------------------


def test_local_devices_are_counted_with_the_session_config():
  devices = _tf.list_local_devices(
      tf.compat.v1.ConfigProto(device_count={"CPU": 3}))
  cpus = [d.name for d in devices if d.device_type == "CPU"]
  assert cpus == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]


def test_set_device_places_a_built_op(graph):
  with tf.device(None):
    op = tf.constant(1.0).op
  assert op.device == ""
  _tf.set_device(op, "/device:CPU:1")
  assert op.device == "/device:CPU:1"
  assert op.node_def.device == "/device:CPU:1"


# Editing built ops ------------------------------------------------------------


def test_update_input_makes_existing_readers_read_the_new_tensor(graph):
  stand_in = tf.compat.v1.placeholder_with_default(tf.constant(1.0), [])
  reader = stand_in * 10.0
  _tf.update_input(stand_in.op, 0, tf.constant(2.0) + 1.0)
  with tf.compat.v1.Session() as session:
    assert session.run(reader) == 30.0


def test_add_control_input_makes_a_built_op_run_after_another(graph):
  v = tf.compat.v1.Variable(0.0, use_resource=True)
  read = tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32)
  add = v.assign_add(5.0)
  _tf.add_control_input(read.op, add.op)
  assert add.op in read.op.control_inputs
  with tf.compat.v1.Session() as session:
    session.run(v.initializer)
    assert session.run(read) == 5.0
    assert session.run(read) == 10.0


def test_tf1_control_flow_is_seen_on_the_graph_and_its_ops():
  was_v2 = tf.compat.v1.control_flow_v2_enabled()
  tf.compat.v1.disable_control_flow_v2()
  try:
    with tf.Graph().as_default() as graph:
      outside = tf.constant(0.0)
      seen = []

      def branch():
        seen.append(_tf.in_control_flow(graph))
        inside = tf.constant(1.0) + outside
        seen.append(_tf.built_in_control_flow(inside.op))
        return inside

      tf.compat.v1.cond(tf.compat.v1.placeholder_with_default(True, []),
                        branch, lambda: outside)
      assert seen == [True, True]
      assert not _tf.in_control_flow(graph)
      assert not _tf.built_in_control_flow(outside.op)
  finally:
    if was_v2:
      tf.compat.v1.enable_control_flow_v2()
  assert tf.compat.v1.control_flow_v2_enabled() == was_v2


# Graph collections and name counters ------------------------------------------


class _IgnoresAdditions(list):

  def append(self, value):
    del value


def test_replace_collection_puts_this_very_list_in_the_graph(graph):
  tf.compat.v1.add_to_collection("things", 1)
  closed = _IgnoresAdditions([2, 3])
  _tf.replace_collection(graph, "things", closed)
  assert graph.get_collection_ref("things") is closed
  tf.compat.v1.add_to_collection("things", 4)  # ignored by the list
  assert graph.get_collection("things") == [2, 3]
  _tf.replace_collection(graph, "things", [5])
  tf.compat.v1.add_to_collection("things", 6)
  assert graph.get_collection("things") == [5, 6]


def test_restored_name_counts_give_default_names_again(graph):

  def default_names():
    layer = tf.keras.layers.Dense(1)
    with tf.compat.v1.variable_scope(None, default_name="block") as scope:
      pass
    return layer.name, scope.name

  counts = _tf.name_counts(graph)
  assert default_names() == ("dense", "block")
  assert default_names() == ("dense_1", "block_1")
  _tf.restore_name_counts(graph, counts)
  assert default_names() == ("dense", "block")
  after = _tf.name_counts(graph)
  with tf.Graph().as_default():  # the counts are the given graph's
    _tf.restore_name_counts(graph, counts)
  assert default_names() == ("dense", "block")
  _tf.restore_name_counts(graph, after)
  assert default_names() == ("dense_1", "block_1")


def test_restored_name_counts_make_a_v1_layer_pick_the_same_name(graph):
  # What tower i relies on: an unnamed layer picks tower 0's name, so that
  # under reuse its variables are tower 0's.
  x = tf.ones([1, 2])
  counts = _tf.name_counts(graph)
  tf.compat.v1.layers.dense(x, 1)
  after = _tf.name_counts(graph)
  _tf.restore_name_counts(graph, counts)
  with pytest.raises(ValueError, match="dense/kernel already exists"):
    tf.compat.v1.layers.dense(x, 1)
  _tf.restore_name_counts(graph, counts)
  with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(),
                                   reuse=True):
    tf.compat.v1.layers.dense(x, 1)
  _tf.restore_name_counts(graph, after)
  tf.compat.v1.layers.dense(x, 1)
  assert [v.op.name for v in tf.compat.v1.trainable_variables()] == [
      "dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"]


def test_a_released_name_is_handed_out_again_until_taken(graph):
  tf.constant(1.0, name="kept")
  assert graph.unique_name("kept", mark_as_used=False) == "kept_1"
  _tf.release_name(graph, "Kept")  # names are counted case-insensitively
  assert graph.unique_name("kept", mark_as_used=False) == "kept"
  _tf.take_name(graph, "kept")
  assert graph.unique_name("kept", mark_as_used=False) == "kept_1"


# Keras legacy optimizers ------------------------------------------------------


def test_keras_gradients_are_computed_without_applying(graph):
  optimizer = tf.keras.optimizers.legacy.SGD(1.0, name="mine")
  v = tf.compat.v1.Variable(2.0, use_resource=True)
  grads_and_vars = _tf.keras_compute_gradients(
      optimizer, lambda: v * 3.0, [v], grad_loss=tf.constant(2.0))
  assert [var for _, var in grads_and_vars] == [v]
  assert _tf.keras_iterations(optimizer) is None  # nothing applied or made
  with tf.compat.v1.Session() as session:
    session.run(v.initializer)
    assert session.run(grads_and_vars[0][0]) == 6.0
    assert session.run(v) == 2.0


def test_keras_iterations_is_none_until_made_or_set(graph):
  optimizer = tf.keras.optimizers.legacy.SGD(1.0)
  assert _tf.keras_iterations(optimizer) is None
  step = tf.compat.v1.train.get_global_step()
  optimizer.iterations = step
  assert _tf.keras_iterations(optimizer) is step
  other = tf.keras.optimizers.legacy.SGD(1.0)
  made = other.iterations  # the public property makes one
  assert _tf.keras_iterations(other) is made


def test_a_keras_optimizers_name():
  assert _tf.keras_optimizer_name(
      tf.keras.optimizers.legacy.Adam(name="mine")) == "mine"
  assert _tf.keras_optimizer_name(tf.keras.optimizers.legacy.SGD()) == "SGD"
  assert _tf.keras_optimizer_name(lambda: None) is None


# Dropped for a public check ----------------------------------------------


def test_the_public_resource_check_agrees_with_tensorflows(graph):
  # replicate.variables.tower_variables.is_resource_variable stands for
  # resource_variable_ops.is_resource_variable, which it replaced.
  from keras.src.mixed_precision import autocast_variable  # pylint: disable=import-outside-toplevel
  from tensorflow.python.ops import resource_variable_ops  # pylint: disable=import-outside-toplevel
  from replicate.variables import tower_variables  # pylint: disable=import-outside-toplevel
  variables = [
      tf.compat.v1.Variable(1.0, use_resource=False),
      tf.compat.v1.Variable(1.0, use_resource=True),
      tf.compat.v1.get_variable("got_ref", [], use_resource=False),
      tf.compat.v1.get_variable("got_resource", [], use_resource=True),
      autocast_variable.create_autocast_variable(
          tf.compat.v1.Variable(1.0, use_resource=True)),
  ]
  found = [tower_variables.is_resource_variable(v) for v in variables]
  assert found == [resource_variable_ops.is_resource_variable(v)
                   for v in variables]
  assert found == [False, True, False, True, True]

"""TensorFlow internals `replicate._tf` reads, pinned to TensorFlow 2.15."""

import tensorflow as tf

from replicate import _tf


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

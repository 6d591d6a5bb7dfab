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

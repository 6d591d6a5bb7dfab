"""The one rule for "computed from the tower's rows"."""

import tensorflow as tf

from replicate.shard import rows


def test_values_from_the_rows_or_their_folded_shape_depend_on_them(graph):
  shard = tf.constant([[1.0], [2.0], [3.0]])
  tower_rows = rows.TowerRows({"x": shard})
  # The value itself, or a shape TensorFlow folded to a constant.
  assert tower_rows.depend([shard])
  assert tower_rows.depend([tf.zeros_like(shard)])
  assert tower_rows.depend([tf.size(shard)])
  # Reached through data inputs.
  assert tower_rows.depend([shard * 2.0])
  assert tower_rows.depend([tf.fill(tf.shape(shard)[:1], 3.0)])


def test_constants_and_variables_do_not_depend_on_the_rows(graph):
  shard = tf.constant([[1.0], [2.0], [3.0]])
  tower_rows = rows.TowerRows({"x": shard})
  variable = tf.compat.v1.get_variable("w", [1], use_resource=True)
  assert not tower_rows.depend([tf.constant([1.0, 2.0])])
  assert not tower_rows.depend([tf.fill([shard.shape[0]], 3.0)])  # a number
  assert not tower_rows.depend([variable, variable * 2.0])

"""Summing the towers' gradients: dense, sparse, None, empty towers."""

import numpy as np
import tensorflow as tf

from conftest import run_initialized
from replicate.gradients import aggregation


def test_dense_gradients_are_added(graph):
  v = tf.compat.v1.get_variable("v", [2])
  summed = aggregation.sum_grads_and_vars(
      [[(tf.constant([1.0, 2.0]), v)], [(tf.constant([10.0, 20.0]), v)]],
      [True, True])
  assert summed[0][1] is v
  np.testing.assert_array_equal(run_initialized(summed[0][0]), [11.0, 22.0])


def test_indexed_slices_are_concatenated_with_duplicates_and_shape(graph):
  table = tf.compat.v1.get_variable("table", [5, 2])
  tower_0 = tf.IndexedSlices(tf.constant([[1.0, 1.0]]), tf.constant([3]),
                             tf.constant([5, 2]))
  tower_1 = tf.IndexedSlices(tf.constant([[2.0, 2.0], [4.0, 4.0]]),
                             tf.constant([3, 0], tf.int64),
                             tf.constant([5, 2]))
  (grad, _), = aggregation.sum_grads_and_vars(
      [[(tower_0, table)], [(tower_1, table)]], [True, True])
  assert isinstance(grad, tf.IndexedSlices)  # not densified
  values, indices, shape = run_initialized(
      (grad.values, grad.indices, grad.dense_shape))
  assert indices.tolist() == [3, 3, 0]  # row 3 twice: the update adds both
  assert values.tolist() == [[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]]
  assert shape.tolist() == [5, 2]


def test_dense_and_sparse_for_one_variable_sum_to_the_dense_total(graph):
  table = tf.compat.v1.get_variable("table", [3, 1])
  dense = tf.constant([[1.0], [1.0], [1.0]])
  sparse = tf.IndexedSlices(tf.constant([[5.0]]), tf.constant([2]))
  (grad, _), = aggregation.sum_grads_and_vars(
      [[(dense, table)], [(sparse, table)]], [True, True])
  total = tf.math.unsorted_segment_sum(grad.values, grad.indices, 3)
  assert run_initialized(total).tolist() == [[1.0], [1.0], [6.0]]


def test_none_is_skipped_and_all_none_stays_none(graph):
  a = tf.compat.v1.get_variable("a", [])
  b = tf.compat.v1.get_variable("b", [])
  summed = aggregation.sum_grads_and_vars(
      [[(None, a), (None, b)], [(tf.constant(3.0), a), (None, b)]],
      [True, True])
  assert summed[1] == (None, b)
  assert run_initialized(summed[0][0]) == 3.0


def test_a_tower_without_rows_adds_nothing_even_if_its_gradient_is_nan(graph):
  v = tf.compat.v1.get_variable("v", [])
  has_rows = tf.compat.v1.placeholder(tf.bool, [])
  (grad, _), = aggregation.sum_grads_and_vars(
      [[(tf.constant(2.0), v)], [(tf.constant(np.nan), v)]],
      [True, has_rows])
  assert run_initialized(grad, {has_rows: False}) == 2.0
  # Known statically: the empty tower's gradient is not even read.
  (static, _), = aggregation.sum_grads_and_vars(
      [[(tf.constant(2.0), v)], [(tf.constant(np.nan), v)]], [True, False])
  assert run_initialized(static) == 2.0


def test_the_sum_is_placed_with_the_variable(graph):
  with tf.device("/cpu:1"):
    v = tf.compat.v1.get_variable("v", [])
  (grad, _), = aggregation.sum_grads_and_vars(
      [[(tf.constant(1.0), v)], [(tf.constant(2.0), v)]], [True, True])
  assert grad.device == "/device:CPU:1"

"""The rules of the stand-ins (`replicate/gradients/stand_ins.py`), one a test.

A stand-in takes the place of a value that exists only once every tower is
built (a sum over towers): tower 0 builds on it, and `connect` later makes
it compute the real value, for every reader, whenever it was built.
"""

import numpy as np
import tensorflow as tf

from conftest import run_initialized
from replicate.gradients import stand_ins
from replicate.shard import rows


def test_unconnected_a_stand_in_passes_its_value_through(graph):
  del graph
  value = tf.constant([1.0, 2.0])
  stand_in = stand_ins.stand_in(value)
  assert not stand_ins.is_connected(stand_in)
  np.testing.assert_array_equal(run_initialized(stand_in), [1.0, 2.0])


def test_connected_every_reader_reads_the_later_value(graph):
  del graph
  stand_in = stand_ins.stand_in(tf.constant([1.0, 2.0]))
  read_before = stand_in * 10.0  # built on it before the value exists
  later = tf.constant([3.0, 4.0]) + tf.constant([5.0, 6.0])  # "the sum"
  stand_ins.connect(stand_in, later)
  read_after = stand_in + 1.0  # built after connecting
  assert stand_ins.is_connected(stand_in)
  before, after = run_initialized([read_before, read_after])
  np.testing.assert_array_equal(before, [80.0, 100.0])
  np.testing.assert_array_equal(after, [9.0, 11.0])


def test_the_later_value_takes_the_stand_in_type(graph):
  del graph
  stand_in = stand_ins.stand_in(tf.constant([1.0], tf.float32))
  stand_ins.connect(stand_in, tf.constant([2.5], tf.float64))
  assert stand_in.dtype == tf.float32
  np.testing.assert_array_equal(run_initialized(stand_in), [2.5])


def test_no_value_has_no_stand_in(graph):
  del graph
  assert stand_ins.stand_in(None) is None
  assert stand_ins.whole_batch(None) is None


def test_slices_keep_dimension_0_open_for_every_towers_slices(graph):
  del graph
  slices = tf.IndexedSlices(tf.constant([[1.0, 1.0]]), tf.constant([0]),
                            tf.constant([3, 2]))
  stand_in = stand_ins.stand_in(slices)
  assert stand_in.values.shape.as_list() == [None, 2]
  assert stand_in.indices.shape.as_list() == [None]
  # Two towers' slices, concatenated: more rows than tower 0 had.
  summed = tf.IndexedSlices(tf.constant([[1.0, 1.0], [2.0, 3.0]]),
                            tf.constant([0, 2], tf.int64), tf.constant([3, 2]))
  stand_ins.connect(stand_in, summed)
  assert stand_ins.is_connected(stand_in)
  values, indices = run_initialized([stand_in.values, stand_in.indices])
  np.testing.assert_array_equal(values, [[1.0, 1.0], [2.0, 3.0]])
  np.testing.assert_array_equal(indices, [0, 2])
  assert indices.dtype == np.int32  # the stand-in's, not the sum's


def test_a_dense_stand_in_takes_slices_as_their_dense_value(graph):
  del graph
  stand_in = stand_ins.stand_in(tf.zeros([3, 2]))
  stand_ins.connect(stand_in, tf.IndexedSlices(
      tf.constant([[1.0, 2.0]]), tf.constant([1]), tf.constant([3, 2])))
  np.testing.assert_array_equal(run_initialized(stand_in),
                                [[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]])


def test_a_slices_stand_in_takes_a_dense_value_as_slices(graph):
  del graph
  stand_in = stand_ins.stand_in(tf.IndexedSlices(
      tf.constant([[1.0]]), tf.constant([0]), tf.constant([2, 1])))
  stand_ins.connect(stand_in, tf.constant([[4.0], [5.0]]))
  dense = tf.convert_to_tensor(stand_in)
  np.testing.assert_array_equal(run_initialized(dense), [[4.0], [5.0]])


def test_a_whole_batch_stand_in_is_not_the_towers_rows(graph):
  del graph
  shard = tf.constant([[1.0], [2.0]])
  tower_value = tf.reduce_sum(shard)
  whole = stand_ins.whole_batch(tower_value)
  rule = rows.TowerRows(shard, None)
  assert rule.depend([tower_value])
  # What is computed from the sum over towers is not the tower's rows.
  assert not rule.depend([whole * 2.0])
  np.testing.assert_array_equal(run_initialized(whole), 3.0)

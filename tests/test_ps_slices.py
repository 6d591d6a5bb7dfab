"""`replicate.variables.ps_slices` in one process: the accumulator the
slices of a ps-held variable go to, emptied as the chief's session starts.

The cluster's exactness with both forms (straight to the ps, gathered) is
`tests/test_hybrid_cluster.py`'s.
"""

import numpy as np
import tensorflow as tf

from replicate.variables import ps_slices


def test_slices_left_by_a_step_that_never_ended_are_emptied_at_start():
  graph = tf.Graph()
  with graph.as_default():
    accumulator = tf.compat.v1.SparseConditionalAccumulator(
        tf.float32, shape=[5, 2], shared_name="left", reduction_type="SUM")
    values = tf.compat.v1.placeholder(tf.float32, [None, 2])
    indices = tf.compat.v1.placeholder(tf.int64, [None])
    added = accumulator.apply_indexed_slices_grad(
        tf.IndexedSlices(values, indices, tf.constant([5, 2], tf.int64)),
        local_step=tf.constant(2 ** 62, tf.int64))
    taken = accumulator.take_indexed_slices_grad(num_required=1)
    hook = ps_slices.EmptiedAtStart([accumulator])
    count = accumulator.num_accumulated()
    with tf.compat.v1.Session() as session:
      hook.after_create_session(session, None)  # empty: nothing to take
      # A task's slices of a step whose other tasks never came.
      session.run(added, {values: [[7.0, 7.0]], indices: [3]})
      session.run(added, {values: [[5.0, 5.0]], indices: [1]})
      assert session.run(count) == 2
      hook.after_create_session(session, None)
      assert session.run(count) == 0
      session.run(added, {values: [[1.0, 2.0]], indices: [3]})
      got_indices, got_values = session.run([taken.indices, taken.values])
  np.testing.assert_array_equal(got_indices, [3])
  np.testing.assert_array_equal(got_values, [[1.0, 2.0]])

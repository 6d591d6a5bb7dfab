"""`replicate.communication.allreduce`: every algorithm sums like one device.

`ring` is TensorFlow's collective all-reduce (`CollectiveReduceV2`); it must
train exactly like one device and like `gather`, with packing, float16
transfer and sparse gradients, and build one collective op per tower on the
tower's device. Keys are tested in tests/test_collectives.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import TRAIN, cpus, session_config
from replicate.communication import allreduce
from test_equivalence import (_assert_close, _assert_same_training, _batches,
                              _make_model_fn, _train, _unwrapped)
from test_replicated import _train_embedding, _embedding_model_fn

Reduction = tf.compat.v1.losses.Reduction


def _replicated(towers, algorithm, model_fn=None, **kwargs):
  return replicate.replicate_model_fn(
      model_fn or _make_model_fn(Reduction.MEAN, "adam"),
      devices=cpus(towers), variable_strategy="replicated",
      all_reduce=algorithm, **kwargs)


@pytest.mark.parametrize("is_packed", [True, False], ids=["packed", "single"])
@pytest.mark.parametrize("towers", [2, 3])
def test_ring_trains_like_one_device_and_like_gather(towers, is_packed,
                                                     monkeypatch):
  # 7 rows: shards 4, 3 (2 towers) and 3, 2, 2 (3 towers).
  if not is_packed:  # every gradient reduced on its own
    monkeypatch.setattr(allreduce, "PACK_MAX_ELEMENTS", 0)
  expected = _unwrapped(Reduction.MEAN, "adam", 7)
  ring = _train(_replicated(towers, allreduce.RING), _batches(7))
  gather = _train(_replicated(towers, allreduce.GATHER), _batches(7))
  _assert_same_training(ring, expected)
  for name, value in gather.values.items():
    _assert_close(ring.values[name], value, name)
  _assert_close(ring.losses, gather.losses, "loss per step")
  for name, value in ring.local_values.items():  # every copy alike
    np.testing.assert_allclose(value, ring.values[name.split("/", 1)[1]],
                               rtol=1e-6, err_msg=name)


def test_compact_ring_sums_in_float16_like_compact_gather():
  # Both round each summed gradient to float16 (about 3 digits): they agree
  # with each other to float16's rounding, and with float32 to ~2e-3.
  expected = _unwrapped(Reduction.MEAN, "sgd", 7)
  model_fn = _make_model_fn(Reduction.MEAN, "sgd")
  ring = _train(_replicated(3, allreduce.RING, model_fn,
                            compact_gradients=True), _batches(7))
  gather = _train(_replicated(3, allreduce.GATHER, model_fn,
                              compact_gradients=True), _batches(7))
  for name, value in expected.values.items():
    np.testing.assert_allclose(ring.values[name], value, rtol=2e-3, atol=2e-3,
                               err_msg=name)
    np.testing.assert_allclose(ring.values[name], gather.values[name],
                               rtol=1e-3, atol=1e-4, err_msg=name)
  assert not np.allclose(ring.values["hidden/kernel"],
                         expected.values["hidden/kernel"], rtol=1e-7, atol=0)


def _train_graph(model_fn, towers=3, rows=7):
  """The TRAIN graph of `model_fn` on constants, built but not run."""
  batch = _batches(rows)[0]
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    model_fn({"x": tf.constant(batch["x"]), "ids": tf.constant(batch["ids"])},
             {"y": tf.constant(batch["y"]),
              "class": tf.constant(batch["class"])}, TRAIN)
  return graph


def _collective_ops(graph, op_type="CollectiveReduceV2"):
  return [op for op in graph.get_operations() if op.type == op_type]


@pytest.mark.parametrize("compact", [False, True])
def test_ring_builds_one_collective_reduce_per_tower_device(compact):
  graph = _train_graph(_replicated(3, allreduce.RING,
                                   compact_gradients=compact))
  reduces = _collective_ops(graph)
  # The 6 dense variables' 37 floats (see test_replicated.py) travel as one
  # packed buffer: one instance, one op on each tower's device.
  assert sorted(op.device for op in reduces) == [
      "/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
  assert {op.get_attr("communication_hint") for op in reduces} == {b"ring"}
  assert {op.get_attr("merge_op") for op in reduces} == {b"Add"}
  assert {op.get_attr("final_op") for op in reduces} == {b"Id"}
  assert {op.inputs[0].dtype for op in reduces} == {
      tf.float16 if compact else tf.float32}
  assert {op.inputs[0].shape.as_list()[0] for op in reduces} == {37}
  keys = {tuple(int(tf.get_static_value(op.inputs[i])) for i in (1, 2, 3))
          for op in reduces}
  # Group size 3, group key 1; instance keys 1 to 3 went to the embedding's
  # all-gather (slice counts, values, indices), built before the packed sum.
  assert keys == {(3, 1, 4)}
  # Nothing of the hand-written ring or of gather is left.
  assert not [op for op in graph.get_operations()
              if op.type in ("AddN", "AddV2") and "all_reduce" in op.name]


def test_all_reduce_accepts_the_four_algorithms_only():
  assert allreduce.ALGORITHMS == ("auto", "gather", "ring", "nccl")
  for algorithm in allreduce.ALGORITHMS:
    allreduce.check_algorithm(algorithm)
  for other in ("_hand_ring", "hand_ring", "handring"):
    with pytest.raises(ValueError, match=(
        r"all_reduce must be one of 'auto', 'gather', 'ring', 'nccl'\. "
        r"Received: '{}'\.".format(other))):
      allreduce.check_algorithm(other)
  with pytest.raises(ValueError, match="all_reduce must be one of"):
    replicate.replicate_model_fn(lambda features: None,
                                 variable_strategy="replicated",
                                 all_reduce="_hand_ring")


def test_gathers_dense_sum_is_replaced_only_inside_the_seam(graph):
  # The benchmarks' seam (benchmarks/hand_ring.py builds its ring there).
  calls = []

  def doubled_sum(tensors, devices):
    calls.append(list(devices))
    return [tf.math.add_n(tensors) * 2.0 for _ in devices]

  def summed(algorithm):
    per_tower = [[tf.constant([1.0, 2.0]), tf.constant(3.0)],
                 [tf.constant([10.0, 20.0]), tf.constant(30.0)]]
    return allreduce.all_reduce_grads(per_tower, cpus(2), algorithm)

  with allreduce.gather_reduce_replaced(doubled_sum):
    replaced = summed(allreduce.GATHER)
    summed(allreduce.RING)  # collective: not gather's sum
  assert calls == [cpus(2)]  # one packed buffer, gather only
  plain = summed(allreduce.GATHER)
  assert calls == [cpus(2)]
  with tf.compat.v1.Session(config=session_config(2)) as session:
    assert [[v.tolist() for v in tower] for tower in session.run(replaced)] \
        == [[[22.0, 44.0], 66.0]] * 2
    assert [[v.tolist() for v in tower] for tower in session.run(plain)] \
        == [[[11.0, 22.0], 33.0]] * 2


@pytest.mark.parametrize("towers", [2, 3])
def test_sparse_embedding_gradient_gathers_collectively_like_gather(towers):
  # 7 rows of 2 ids: 2 towers get 4, 3 rows (8 and 6 slices, padded to 8);
  # _train_embedding feeds constants, so the lengths are known.
  got, graph, _ = _train_embedding(_replicated(towers, allreduce.RING,
                                               _embedding_model_fn))
  gathered, _, _ = _train_embedding(_replicated(towers, allreduce.GATHER,
                                                _embedding_model_fn))
  expected, _, _ = _train_embedding(_embedding_model_fn)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(got[name], gathered[name], rtol=1e-5,
                               err_msg=name)
  gathers = _collective_ops(graph, "CollectiveGatherV2")
  assert len(gathers) == 3 * towers  # counts, values, indices per tower
  assert {op.device for op in gathers} == set(
      "/device:CPU:{}".format(i) for i in range(towers))


def test_equal_slices_are_gathered_without_counts(graph):
  # 6 rows of 2 ids over 3 towers: 4 slices each, known when built, so
  # values and indices are gathered as they are: two instances.
  wrapped = _replicated(3, allreduce.RING, _embedding_model_fn)
  wrapped({"ids": tf.zeros([6, 2], tf.int64)}, tf.zeros([6, 1]), TRAIN)
  gathers = _collective_ops(graph, "CollectiveGatherV2")
  assert sorted(str(op.inputs[0].shape) for op in gathers) == sorted(
      ["(4,)"] * 3 + ["(4, 1)"] * 3)
  assert {op.inputs[0].dtype for op in gathers} == {tf.int64, tf.float32}


def _train_embedding_on_batches(model_fn, towers, batches):
  """Trains on `batches` of ids fed one a step (dimension 0 unknown)."""
  rng = np.random.RandomState(1)
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    ids = tf.compat.v1.placeholder(tf.int64, [None, 2])
    labels = tf.compat.v1.placeholder(tf.float32, [None, 1])
    spec = model_fn({"ids": ids}, labels, TRAIN)
    losses = []
    with tf.compat.v1.Session(config=session_config(towers)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())  # the copies
      for rows in batches:
        feed = {ids: rng.randint(0, 50, size=(rows, 2)),
                labels: rng.rand(rows, 1)}
        losses.append(session.run([spec.loss, spec.train_op], feed)[0])
      table = session.run(next(v for v in tf.compat.v1.global_variables()
                               if v.op.name == "table"))
  return losses, table, graph


@pytest.mark.parametrize("towers", [2, 3])
def test_slices_whose_length_changes_every_step_train_on_the_ring(towers):
  # A .batch() pipeline: the embedding gradient's length is known only at
  # run time and differs from step to step (and tower to tower). A
  # collective instance keeps its first step's shapes and would abort the
  # next ("Shape mismatch in the collective instance"), so these slices
  # are concatenated by every tower, as with gather.
  batches = [7, 7, 5, 8, 2, 6]
  expected_losses, expected_table, _ = _train_embedding_on_batches(
      _embedding_model_fn, towers, batches)
  losses, table, graph = _train_embedding_on_batches(
      _replicated(towers, allreduce.RING, _embedding_model_fn), towers,
      batches)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  np.testing.assert_allclose(table, expected_table, rtol=1e-5)
  assert not _collective_ops(graph, "CollectiveGatherV2")
  # The dense `scale` gradient's shape is known: still reduced collectively.
  assert len(_collective_ops(graph, "CollectiveReduceV2")) == towers


def _all_reduce_run(per_tower, algorithm, towers):
  with tf.Graph().as_default():
    placed = []
    for index, values in enumerate(per_tower):
      with tf.device(cpus(towers)[index]):
        placed.append([tf.constant(v) if not isinstance(v, tuple) else
                       tf.IndexedSlices(tf.constant(v[0]), tf.constant(v[1]),
                                        tf.constant(v[2])) for v in values])
    summed = allreduce.all_reduce_grads(placed, cpus(towers), algorithm)
    with tf.compat.v1.Session(config=session_config(towers)) as session:
      return session.run(summed)


def test_bfloat16_gradients_fall_back_to_gather_on_the_ring():
  # CollectiveReduceV2 refuses bfloat16; the sum must still be right:
  # [1, 2] + [10, 20] + [100, 200] = [111, 222], on every tower.
  values = [[np.array([1, 2], tf.bfloat16.as_numpy_dtype) * scale]
            for scale in (1, 10, 100)]
  results = _all_reduce_run(values, allreduce.RING, 3)
  for (summed,) in results:
    np.testing.assert_array_equal(summed.astype(np.float32), [111, 222])


def test_sparse_slices_of_three_lengths_and_an_empty_one_gather_in_order():
  # Towers with 2, 0, 1 and 3 slices of a 40000 x 2 table (too big to
  # densify): every tower gets all 6, in tower order, padding dropped.
  def slices(rows, first):
    values = np.arange(2 * rows, dtype=np.float32).reshape(rows, 2) + first
    return (values, np.arange(first, first + rows, dtype=np.int64),
            np.array([40000, 2], np.int64))

  per_tower = [[slices(2, 0)], [slices(0, 2)], [slices(1, 2)], [slices(3, 3)]]
  results = _all_reduce_run(per_tower, allreduce.RING, 4)
  expected_values = np.concatenate([t[0][0] for t in per_tower])
  expected_indices = np.concatenate([t[0][1] for t in per_tower])
  assert expected_indices.tolist() == [0, 1, 2, 3, 4, 5]
  for (gathered,) in results:
    np.testing.assert_array_equal(gathered.values, expected_values)
    np.testing.assert_array_equal(gathered.indices, expected_indices)
    np.testing.assert_array_equal(gathered.dense_shape, [40000, 2])

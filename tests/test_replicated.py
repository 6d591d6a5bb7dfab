"""`variable_strategy="replicated"`: per-tower copies, all-reduced gradients.

The promise is the core one: replicated towers train exactly like one
device (and like `parameter_server`) on the same batches, for every
all-reduce algorithm, while every copy stays equal to tower 0's variable and
only tower 0's variables exist under the original names.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, TRAIN, checkpoint_values, cpus, session_config
from replicate.communication import allreduce
from test_equivalence import (_assert_same_training, _batches, _make_model_fn,
                              _train, _unwrapped)

Reduction = tf.compat.v1.losses.Reduction
REPLICATED = "replicated"


def _replicated(model_fn, towers, algorithm, **kwargs):
  return replicate.replicate_model_fn(
      model_fn, devices=cpus(towers), variable_strategy=REPLICATED,
      all_reduce=algorithm, **kwargs)


def _assert_copies_equal_tower0(training, towers):
  """Every `tower_i/<name>` local variable equals tower 0's `<name>`."""
  copies = {name for name in training.local_values
            if name.startswith("tower_")}
  expected = {"tower_{}/{}".format(i, name)
              for i in range(1, towers) for name in training.global_names
              if name not in ("global_step", "beta1_power", "beta2_power")}
  assert copies == expected
  for name in copies:
    np.testing.assert_allclose(training.local_values[name],
                               training.values[name.split("/", 1)[1]],
                               rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("algorithm", [allreduce.GATHER, allreduce.RING])
@pytest.mark.parametrize("rows", [7, 2], ids=["uneven", "small"])
@pytest.mark.parametrize("optimizer_name", ["adam", "sgd"])
def test_replicated_trains_like_one_device(algorithm, rows, optimizer_name):
  # 3 towers: rows=7 splits 3, 2, 2; rows=2 leaves tower 2 on a stand-in
  # row, whose gradient must be zeroed before the all-reduce, not summed.
  expected = _unwrapped(Reduction.MEAN, optimizer_name, rows)
  wrapped = _replicated(_make_model_fn(Reduction.MEAN, optimizer_name), 3,
                        algorithm)
  got = _train(wrapped, _batches(rows))
  _assert_same_training(got, expected)  # also: only the unwrapped names
  _assert_copies_equal_tower0(got, 3)
  assert got.variable_devices == {"/device:CPU:0"}  # tower 0's


def test_replicated_with_sum_reduction_and_a_static_batch():
  expected = _unwrapped(Reduction.SUM, "adam", 12)
  wrapped = _replicated(_make_model_fn(Reduction.SUM, "adam"), 2,
                        allreduce.RING, loss_reduction=Reduction.SUM)
  got = _train(wrapped, _batches(12), is_static_shape=True)
  _assert_same_training(got, expected)
  _assert_copies_equal_tower0(got, 2)


def test_compact_gradients_train_close_to_float32():
  # float16 keeps ~3 significant digits of each summed gradient.
  expected = _unwrapped(Reduction.MEAN, "sgd", 7)
  wrapped = _replicated(_make_model_fn(Reduction.MEAN, "sgd"), 3,
                        allreduce.RING, compact_gradients=True)
  got = _train(wrapped, _batches(7))
  for name, value in expected.values.items():
    np.testing.assert_allclose(got.values[name], value, rtol=2e-3, atol=2e-3,
                               err_msg=name)
  assert not np.allclose(got.values["hidden/kernel"],
                         expected.values["hidden/kernel"], rtol=1e-7,
                         atol=0)  # the float16 sum really was used
  _assert_copies_equal_tower0(got, 3)


def _build_replicated_train(model_fn, towers, algorithm, **kwargs):
  """The TRAIN graph of `model_fn` on replicated towers, fed constants."""
  batch = _batches(7)[0]
  spec = _replicated(model_fn, towers, algorithm, **kwargs)(
      {"x": tf.constant(batch["x"]), "ids": tf.constant(batch["ids"])},
      {"y": tf.constant(batch["y"]), "class": tf.constant(batch["class"])},
      TRAIN)
  return spec


def test_copies_are_local_on_their_towers_and_small_gradients_are_packed(
    graph):
  _build_replicated_train(_make_model_fn(Reduction.MEAN, "sgd"), 3,
                          allreduce.GATHER)
  copies = [v for v in tf.compat.v1.local_variables()]
  assert {v.device for v in copies if v.op.name.startswith("tower_1/")} == {
      "/device:CPU:1"}
  assert {v.device for v in copies if v.op.name.startswith("tower_2/")} == {
      "/device:CPU:2"}
  assert not any(v.op.name.startswith("tower_")
                 for v in tf.compat.v1.global_variables() +
                 tf.compat.v1.trainable_variables())
  # The 6 dense variables (hidden 6x3 + 3, value 3x1 + 1, logits 3x3 + 3:
  # 21 + 4 + 12 = 37 floats) travel as one buffer: a single sum for all of
  # them. The embedding's slices are all-gathered, never densified.
  sums = [op for op in graph.get_operations()
          if op.type == "AddN" and "all_reduce" in op.name]
  assert len(sums) == 1
  assert sums[0].outputs[0].shape.as_list() == [37]
  assert sums[0].device == "/device:CPU:0"


def test_compact_gradients_reduce_in_float16(graph):
  _build_replicated_train(_make_model_fn(Reduction.MEAN, "sgd"), 2,
                          allreduce.GATHER, compact_gradients=True)
  sums = [op for op in graph.get_operations()
          if op.type == "AddN" and "all_reduce" in op.name]
  assert [op.outputs[0].dtype for op in sums] == [tf.float16]


# A large embedding: its IndexedSlices are all-gathered, not densified.

VOCABULARY = 40000


def _embedding_model_fn(features, labels, mode):
  table = tf.compat.v1.get_variable(
      "table", [VOCABULARY, 1],
      initializer=tf.compat.v1.constant_initializer(0.5))
  scale = tf.compat.v1.get_variable(
      "scale", [], initializer=tf.compat.v1.ones_initializer())
  predicted = scale * tf.reduce_sum(
      tf.nn.embedding_lookup(table, features["ids"]), axis=1)
  loss = tf.compat.v1.losses.mean_squared_error(labels, predicted)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdagradOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _train_embedding(model_fn, steps=3):
  rng = np.random.RandomState(0)
  ids = rng.randint(0, VOCABULARY, size=(7, 2)).astype(np.int64)
  ids[1] = ids[0]  # repeated ids across towers' rows
  labels = rng.rand(7, 1).astype(np.float32)
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    spec = model_fn({"ids": tf.constant(ids)}, tf.constant(labels),
                    TRAIN)
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      for _ in range(steps):
        session.run(spec.train_op)
      values = session.run({v.op.name: v for v in
                            tf.compat.v1.global_variables() +
                            tf.compat.v1.local_variables()})
  return values, graph, ids


@pytest.mark.parametrize("algorithm", [allreduce.GATHER, allreduce.RING])
def test_large_embedding_gradients_are_gathered_and_train_alike(algorithm):
  expected, _, ids = _train_embedding(_embedding_model_fn)
  got, graph, _ = _train_embedding(_replicated(_embedding_model_fn, 3,
                                               algorithm))
  assert sorted(name for name in got if not name.startswith("tower_")) == \
      sorted(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)
  for tower in (1, 2):
    for name in ("table", "table/Adagrad", "scale", "scale/Adagrad"):
      np.testing.assert_allclose(got["tower_{}/{}".format(tower, name)],
                                 got[name], rtol=1e-6)
  assert not np.allclose(got["table"][ids.ravel()], 0.5)  # it did train
  # Each tower's copy gets every tower's 7 x 2 = 14 looked-up rows; nothing
  # of the table's size is built.
  gathered = [op for op in graph.get_operations()
              if "all_gather" in op.name and op.type == "ConcatV2" and
              op.outputs[0].dtype == tf.float32]
  collective = [op for op in graph.get_operations()
                if op.type == "CollectiveGatherV2"]
  if algorithm == allreduce.RING:
    # Rows 3, 2, 2 give 6, 4, 4 slices: per device one gather of the
    # counts, then the values and the indices padded to 6 each.
    assert not gathered
    assert sorted(op.device for op in collective) == sorted(
        ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"] * 3)
    lengths = [op.inputs[0].shape.as_list()[0] for op in collective]
    # the counts; values and indices padded to a length known at run time
    assert (lengths.count(1), lengths.count(None)) == (3, 6)
  else:
    assert not collective
    assert sorted(op.device for op in gathered) == [
        "/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    assert {op.outputs[0].shape.as_list()[0] for op in gathered} == {14}
  assert not [op for op in graph.get_operations()
              if "all_reduce" in op.name and op.outputs and
              op.outputs[0].shape.num_elements() == VOCABULARY]


def test_eval_reads_tower0s_variables_with_no_copies(graph):
  batch = _batches(7)[0]
  spec = _replicated(_make_model_fn(Reduction.MEAN, "sgd"), 3,
                     allreduce.GATHER)(
                         {"x": tf.constant(batch["x"]),
                          "ids": tf.constant(batch["ids"])},
                         {"y": tf.constant(batch["y"]),
                          "class": tf.constant(batch["class"])}, EVAL)
  assert spec.loss is not None
  assert tf.compat.v1.local_variables() == []
  assert {v.device for v in tf.compat.v1.global_variables()
          if v.op.name != "global_step"} == {"/device:CPU:0"}


def test_nccl_is_refused_on_cpu_towers_with_the_alternatives(graph):
  with pytest.raises(ValueError, match=(
      r"all_reduce='nccl' needs GPU towers and a TensorFlow built with CUDA "
      r"\(NCCL\), but the towers are not all GPUs: /device:CPU:0, "
      r"/device:CPU:1\. Use all_reduce='ring' or 'gather'")):
    _build_replicated_train(_make_model_fn(Reduction.MEAN, "sgd"), 2,
                            allreduce.NCCL)


def test_auto_picks_gather_on_cpus_and_checks_nccl_on_gpus():
  assert allreduce.resolve_algorithm("auto", cpus(2)) == allreduce.GATHER
  # tensorflow-cpu has no CUDA: NCCL cannot be chosen for GPUs either.
  assert not tf.test.is_built_with_cuda()
  assert allreduce.resolve_algorithm("auto",
                                     ["/gpu:0", "/gpu:1"]) == allreduce.GATHER
  with pytest.raises(ValueError, match="this TensorFlow is built without CUDA"):
    allreduce.resolve_algorithm("nccl", ["/gpu:0", "/gpu:1"])


# Estimator: checkpoints hold tower 0's names; copies follow a restore.


class _CopiesAtStart(tf.compat.v1.train.SessionRunHook):
  """Reads every copy and its tower 0 variable right after initialisation."""

  def __init__(self):
    self.pairs = None

  def after_create_session(self, session, coord):
    copies = [v for v in tf.compat.v1.local_variables()
              if v.op.name.startswith("tower_")]
    by_name = {v.op.name: v for v in tf.compat.v1.global_variables()}
    self.pairs = session.run([(c, by_name[c.op.name.split("/", 1)[1]])
                              for c in copies])


def _input_fn():
  batch = _batches(7)[0]
  return tf.compat.v1.data.Dataset.from_tensors((
      {"x": batch["x"], "ids": batch["ids"]},
      {"y": batch["y"], "class": batch["class"]})).repeat()


def _estimator(model_fn, model_dir, towers=3):
  return tf.estimator.Estimator(
      model_fn, model_dir=str(model_dir),
      config=tf.estimator.RunConfig(session_config=session_config(towers),
                                    save_summary_steps=None,
                                    log_step_count_steps=None))


def test_estimator_saves_tower0_names_and_restores_into_every_copy(tmp_path):
  model_fn = _make_model_fn(Reduction.MEAN, "adam")
  single = _estimator(model_fn, tmp_path / "single", towers=1)
  single.train(_input_fn, steps=5)
  expected = checkpoint_values(single.model_dir)

  replicated = _estimator(_replicated(model_fn, 3, allreduce.RING),
                          tmp_path / "replicated")
  replicated.train(_input_fn, steps=3)
  # Only the unwrapped names; nothing of tower 1 or 2.
  assert sorted(checkpoint_values(replicated.model_dir)) == sorted(expected)
  hook = _CopiesAtStart()
  replicated.train(_input_fn, steps=2, hooks=[hook])  # restores step 3
  # Towers 1 and 2 x (7 variables + their 14 Adam slots).
  assert len(hook.pairs) == 2 * 21
  for copy, tower0 in hook.pairs:
    np.testing.assert_array_equal(copy, tower0)
  assert not all(np.array_equal(c, np.zeros_like(c)) for c, _ in hook.pairs)
  got = checkpoint_values(replicated.model_dir)
  assert got["global_step"] == 5
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # Evaluation reads tower 0's variables: the same loss as on one device.
  assert replicated.evaluate(_input_fn, steps=1)["loss"] == pytest.approx(
      single.evaluate(_input_fn, steps=1)["loss"], rel=1e-5)


# Non-trainable variables are shared, as with parameter_server.


def test_batch_norm_statistics_are_tower0s_in_every_tower(graph):
  x = np.arange(12, dtype=np.float32).reshape(6, 2)

  def model_fn(features, labels, mode):
    normalized = tf.compat.v1.layers.batch_normalization(
        features, momentum=0.5, training=True, name="bn")
    loss = tf.reduce_mean(tf.square(normalized - labels))
    with tf.control_dependencies(
        tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
      train_op = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  spec = _replicated(model_fn, 2, allreduce.GATHER)(
      tf.constant(x), tf.zeros([6, 2]), TRAIN)
  # gamma and beta are copied; the moving statistics are not.
  assert sorted(v.op.name for v in tf.compat.v1.local_variables()) == [
      "tower_1/bn/beta", "tower_1/bn/gamma"]
  # Both towers' moving-average updates are of tower 0's variables.
  updated = [(op.name.split("/")[0], op.inputs[0].op.name)
             for op in graph.get_operations()
             if op.type == "AssignSubVariableOp" and
             "moving_mean" in op.inputs[0].op.name]
  assert updated == [("bn", "bn/moving_mean"), ("tower_1", "bn/moving_mean")]
  with tf.compat.v1.Session(config=session_config(2)) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    session.run(tf.compat.v1.local_variables_initializer())
    session.run(spec.train_op)
    moving_mean, = session.run([v for v in tf.compat.v1.global_variables()
                                if v.op.name == "bn/moving_mean"])
  # Written once, with the batch's mean [5, 6] (the shards' [2, 3] and
  # [8, 9], weighted 1/2 each): 0 - (0 - [5, 6]) * 0.5 = [2.5, 3.0].
  np.testing.assert_allclose(moving_mean, [2.5, 3.0], rtol=1e-6)


# Optimizer patterns beyond minimize, on a linear model.

LINEAR_X = np.arange(24, dtype=np.float32).reshape(6, 4) / 10
LINEAR_Y = np.arange(6, dtype=np.float32).reshape(6, 1) / 5


def _train_linear(model_fn, steps=3, **wrap_kwargs):
  """Losses and global variables after `steps` steps; unwrapped if no kwargs."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    x = tf.constant(LINEAR_X, name="x")
    y = tf.constant(LINEAR_Y, name="y")
    if wrap_kwargs:
      model_fn = replicate.replicate_model_fn(model_fn, **wrap_kwargs)
    spec = model_fn(x, y, TRAIN)
    with tf.compat.v1.Session(config=session_config(2)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      losses = [session.run([spec.loss, spec.train_op])[0]
                for _ in range(steps)]
      return losses, session.run({v.op.name: v for v in
                                  tf.compat.v1.global_variables()})


def _linear_loss(features, labels):
  w = tf.compat.v1.get_variable(
      "w", [4, 1], initializer=tf.compat.v1.constant_initializer(0.1))
  return tf.compat.v1.losses.mean_squared_error(labels,
                                                tf.matmul(features, w))


def _two_adams_model_fn(features, labels, mode):
  loss = _linear_loss(features, labels)
  first = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(0.05))
  second = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(0.01))
  train_op = tf.group(
      first.minimize(loss, tf.compat.v1.train.get_global_step()),
      second.minimize(loss))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("strategy", ["parameter_server", REPLICATED])
def test_two_optimizers_of_one_kind_on_one_variable(strategy):
  # Each makes its own slots, w/Adam, w/Adam_1 and w/Adam_2, w/Adam_3, as
  # unwrapped; re-entering tower 0's scope must not reuse the first names.
  expected_losses, expected = _train_linear(_two_adams_model_fn)
  losses, got = _train_linear(_two_adams_model_fn, devices=cpus(2),
                              variable_strategy=strategy)
  assert sorted(got) == sorted(expected)
  assert {"w/Adam_2", "w/Adam_3", "beta1_power_1"} <= set(got)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)


def _keras_get_updates_model_fn(features, labels, mode):
  loss = _linear_loss(features, labels)
  optimizer = replicate.TowerOptimizer(tf.keras.optimizers.legacy.SGD(0.5))
  # tower 0's variables, from the collection, in every tower
  update, = optimizer.get_updates(loss, tf.compat.v1.trainable_variables())
  with tf.control_dependencies([update]):
    train_op = tf.compat.v1.assign_add(tf.compat.v1.train.get_global_step(),
                                       1)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_keras_get_updates_with_tower0s_variables_updates_the_copies():
  expected_losses, expected = _train_linear(_keras_get_updates_model_fn)
  losses, got = _train_linear(_keras_get_updates_model_fn, devices=cpus(2),
                              variable_strategy=REPLICATED)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  np.testing.assert_allclose(got["w"], expected["w"], rtol=1e-5)


def _gradients_of_collection_model_fn(features, labels, mode):
  loss = _linear_loss(features, labels)
  variables = tf.compat.v1.trainable_variables()  # tower 0's, in any tower
  grads, _ = tf.clip_by_global_norm(tf.gradients(loss, variables), 100.0)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.05)).apply_gradients(
          zip(grads, variables), tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_gradients_for_tower0s_variables_are_refused_when_replicated():
  # Tower 1 computes with its copy, so these gradients are None: training
  # on them would leave the copies behind silently.
  with pytest.raises(ValueError, match=(
      r"tower 1 applies a gradient for tower 0's variable 'w', but it "
      r"computes with its own copy 'tower_1/w'\. Take gradients with "
      r"TowerOptimizer\.compute_gradients")):
    _train_linear(_gradients_of_collection_model_fn, devices=cpus(2),
                  variable_strategy=REPLICATED)


def test_ref_variables_are_refused_when_replicated():
  def model_fn(features, labels, mode):
    w = tf.compat.v1.get_variable(
        "w", [4, 1], initializer=tf.compat.v1.constant_initializer(0.1),
        use_resource=False)
    loss = tf.reduce_sum(tf.matmul(features, w))
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(ValueError, match=(
      r"Tower 1 needs its own copy of 'w', which is a ref variable "
      r"\(use_resource=False\)\..*use_resource=True, or use "
      r"variable_strategy='parameter_server'")):
    _train_linear(model_fn, devices=cpus(2), variable_strategy=REPLICATED)

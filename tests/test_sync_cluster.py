"""A synchronous cluster's pieces, in this process: the server, the build.

`replicate.start_server` starts the chief's server of a 2-task cluster here
(servers cannot be stopped; it goes with the test process), so TRAIN
graphs build as the chief's would: its towers, the cross-task collectives,
the refusals. Training on real clusters is `test_sync_multiworker.py`.
"""

import json
import os
import socket

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate import graph_walk
from replicate.cluster import server as server_lib
from replicate.cluster import sync_cluster
from replicate.cluster import sync_input
from replicate.communication import allreduce
from conftest import TRAIN


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


CLUSTER = {job: ["127.0.0.1:{}".format(_free_port()) for _ in range(count)]
           for job, count in (("chief", 1), ("worker", 1))}


def _set_tf_config(monkeypatch, task_type="chief", index=0, cluster=CLUSTER):
  monkeypatch.setenv("TF_CONFIG", json.dumps(
      {"cluster": cluster, "task": {"type": task_type, "index": index}}))


def _run_config(**kwargs):
  kwargs.setdefault("experimental_max_worker_delay_secs", 0)
  kwargs.setdefault("session_config",
                    tf.compat.v1.ConfigProto(device_count={"CPU": 2}))
  return tf.estimator.RunConfig(**kwargs)


@pytest.fixture(scope="module")
def chief_config():
  """The chief's RunConfig, its server started by start_server."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    _set_tf_config(monkeypatch)
    config = _run_config()
    server = replicate.start_server(config)
    assert isinstance(server, tf.distribute.Server)
    # The Estimator is told the server runs already.
    assert json.loads(os.environ["TF_CONFIG"])["environment"] == "google"
    yield config, server


def test_start_server_gives_the_server_the_sessions_devices_and_a_filter(
    chief_config):
  config, server = chief_config
  # The session config's virtual CPUs reach the server: two towers.
  with tf.Graph().as_default(), tf.compat.v1.Session(
      server.target, config=config.session_config) as session:
    names = [d.name for d in session.list_devices()]
  assert sum("/job:chief/replica:0/task:0/device:CPU:" in n
             for n in names) == 2
  # The Estimator's sessions are limited to this task.
  assert list(config.session_config.device_filters) == ["/job:chief/task:0"]
  # Once per process: a second call gives the same server.
  assert replicate.start_server(config) is server


def test_start_server_is_none_without_a_cluster_or_for_an_evaluator(
    monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  assert replicate.start_server(_run_config()) is None
  _set_tf_config(monkeypatch, "evaluator", 0)
  assert replicate.start_server(_run_config()) is None


def test_start_server_serves_on_a_ps_task_and_refuses_other_arguments(
    monkeypatch):
  with pytest.raises(ValueError, match=r"tf.estimator.RunConfig. Received: "
                     r"\{'cluster'"):
    replicate.start_server({"cluster": {}})
  # A ps task serves and never returns to the program's training (a real
  # one: tests/test_hybrid_cluster.py runs the docs' program on ps tasks).
  served = []

  def serve(config):
    served.append((config.task_type, config.task_id))
    raise SystemExit(0)

  monkeypatch.setattr(server_lib, "serve", serve)
  _set_tf_config(monkeypatch, "ps", 1, cluster=dict(
      CLUSTER, ps=["127.0.0.1:1", "127.0.0.1:2"]))
  with pytest.raises(SystemExit):
    replicate.start_server(_run_config())
  assert served == [("ps", 1)]


@pytest.mark.parametrize("value", ["0", "-3", "soon", "nan"])
def test_a_bad_timeout_is_refused_naming_the_variable(monkeypatch, value):
  monkeypatch.setenv(sync_cluster.TIMEOUT_ENV, value)
  with pytest.raises(ValueError, match=r"REPLICATE_SYNC_TIMEOUT_SECS must be "
                     r"a number of seconds greater than 0. Received: '{}'"
                     .format(value)):
    sync_cluster.timeout_seconds()


def test_the_timeout_defaults_to_120_seconds(monkeypatch):
  monkeypatch.delenv(sync_cluster.TIMEOUT_ENV, raising=False)
  assert sync_cluster.timeout_seconds() == 120.0
  monkeypatch.setenv(sync_cluster.TIMEOUT_ENV, "7.5")
  assert sync_cluster.timeout_seconds() == 7.5


def _model_fn(features, labels, mode, params):
  logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  extra = params.get("extra")
  ops = [extra(features, labels)] if extra else []
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1))
  train_op = optimizer.minimize(loss,
                                tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(train_op, *ops))


def _dataset_batch(rows=6):
  dataset = tf.data.Dataset.from_tensor_slices(
      ({"x": np.ones((rows, 3), np.float32)},
       np.zeros(rows, np.int64))).batch(rows)
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def _build(config, params=None, features_labels=None, **wrap_kwargs):
  wrap_kwargs.setdefault("variable_strategy", "replicated")
  with tf.Graph().as_default() as graph:
    features, labels = features_labels() if features_labels else (
        _dataset_batch())
    spec = replicate.replicate_model_fn(_model_fn, **wrap_kwargs)(
        features, labels, TRAIN, params=params or {}, config=config)
  return graph, spec


def test_the_chiefs_step_sums_over_its_towers_then_across_tasks(
    chief_config):
  config, _ = chief_config
  graph, spec = _build(config)
  collectives = [op for op in graph.get_operations()
                 if op.type.startswith("Collective")]
  on = {op.device for op in collectives}
  # One device per task takes part: the chief's first tower.
  assert on == {"/job:chief/task:0/device:CPU:0"}
  sizes = {int(tf.get_static_value(op.inputs[1])) for op in collectives
           if op.type != "CollectiveBcastRecvV2"}
  assert sizes == {2}  # two tasks
  kinds = sorted(op.type for op in collectives)
  # The start's all-gather of fingerprints and broadcast; the step's
  # all-gather of (ended, rows) and all-reduces (gradients, loss).
  assert kinds.count("CollectiveGatherV2") == 2
  assert kinds.count("CollectiveBcastSendV2") == 2  # float32, int64
  assert kinds.count("CollectiveReduceV2") >= 2
  # The start's collectives time out; the step's have the watchdog (a
  # timeout would start a thread per run).
  start = {op.get_attr("timeout_seconds") for op in collectives
           if op.name.startswith("start_of_cluster/")}
  step = {op.get_attr("timeout_seconds") for op in collectives
          if not op.name.startswith("start_of_cluster/")}
  assert start == {sync_cluster.timeout_seconds()} and step == {0.0}
  # The towers train copies; tower 1's are local, never saved.
  with graph.as_default():
    saved = {v.op.name for v in tf.compat.v1.global_variables()}
    local = {v.op.name for v in tf.compat.v1.local_variables()}
  assert saved == {"logits/kernel", "logits/bias", "global_step"}
  assert {"tower_1/logits/kernel", "tower_1/logits/bias"} <= local
  assert spec.scaffold.ready_for_local_init_op is not None
  assert any(type(h).__name__ == "WatchdogHook" for h in spec.training_hooks)


def _negatives_model_fn(features, labels, mode):
  del labels  # in-batch negatives: row r's item is its label
  query = tf.compat.v1.layers.dense(features["x"], 2, name="query")
  item = tf.compat.v1.layers.dense(features["x"], 2, name="item")
  similarity = tf.matmul(query, replicate.all_rows(item), transpose_b=True)
  targets = tf.range(tf.shape(query)[0]) + replicate.row_offset()
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=targets, logits=similarity))
  train_op = None
  if mode == TRAIN:
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
            loss, tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_all_rows_across_tasks_gathers_rows_and_sums_their_gradient(
    chief_config):
  # API.md: all_rows is the whole batch's rows across every task too.
  # Forward: the task's rows all-gathered (their count first, then the
  # rows padded to a power of two, on a key per power); backward: the
  # gradient w.r.t. every task's rows summed over tasks (padded alike).
  config, _ = chief_config
  with tf.Graph().as_default() as graph:
    features, labels = _dataset_batch()
    replicate.replicate_model_fn(
        _negatives_model_fn, variable_strategy="replicated")(
            features, labels, TRAIN, config=config)
  step = _step_collectives(graph)
  forward = [op for op in step if "rows_over_tasks" in op.name]
  assert sorted((op.type, op.inputs[0].dtype.name, str(op.inputs[0].shape))
                for op in forward) == [
                    ("CollectiveGatherV2", "float32", "(None, 2)"),
                    ("CollectiveGatherV2", "int32", "(1,)")]
  backward = [op for op in step if "all_rows_gradient_over_tasks" in op.name]
  assert [(op.type, str(op.inputs[0].shape)) for op in backward] == [
      ("CollectiveReduceV2", "(None, 2)")]
  for op in forward + backward:  # the rows: a key per padded length
    if op.inputs[0].shape.rank == 2:
      assert tf.get_static_value(op.inputs[-1]) is None
  # Every tower reads the one gather; tower 1's first row counts the rows
  # of the tasks before this one (the step's first all-gather).
  offset = graph.get_operation_by_name("tower_1/row_offset")
  behind = graph_walk.ops_behind([offset])
  assert any(op.type == "CollectiveGatherV2" and "take_batch" in op.name
             for op in behind)


@pytest.mark.parametrize("mode", [tf.estimator.ModeKeys.EVAL,
                                  tf.estimator.ModeKeys.PREDICT])
def test_all_rows_outside_train_is_the_tasks_own_batch(chief_config, mode):
  # Only TRAIN crosses tasks: EVAL and PREDICT build one machine's towers
  # (an evaluator's own batches), and all_rows joins those towers' rows.
  config, _ = chief_config

  def model_fn(features, labels, mode):
    if mode == tf.estimator.ModeKeys.PREDICT:
      query = tf.compat.v1.layers.dense(features["x"], 2, name="query")
      best = tf.argmax(tf.matmul(query, replicate.all_rows(query),
                                 transpose_b=True), axis=1)
      return tf.estimator.EstimatorSpec(mode, predictions={"best": best})
    return _negatives_model_fn(features, labels, mode)

  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    features, labels = _dataset_batch()
    replicate.replicate_model_fn(model_fn, variable_strategy="replicated")(
        features, labels, mode, config=config)
  assert not [op for op in graph.get_operations()
              if op.type.startswith("Collective")]
  joined = [op for op in graph.get_operations()
            if op.name.startswith("all_rows_over_towers/")]
  assert {op.type for op in joined} >= {"ConcatV2"}


def test_all_rows_of_a_dtype_collectives_cannot_carry_is_refused(
    chief_config):
  config, _ = chief_config
  # bool travels as int32.
  graph, _ = _build(config, params={"extra": lambda features, _: (
      replicate.all_rows(features["x"] > 0))})
  carried = [(op.inputs[0].dtype.name, str(op.inputs[0].shape))
             for op in _step_collectives(graph)
             if "rows_over_tasks" in op.name]
  assert ("int32", "(None, 3)") in carried
  with pytest.raises(ValueError, match=r"replicate\.all_rows\(.* in a "
                     r"synchronous cluster: its rows are string.*Fix: cast"):
    _build(config, params={"extra": lambda features, _: replicate.all_rows(
        tf.strings.as_string(features["x"]))})


def test_other_variable_strategies_are_refused_with_the_fix(chief_config):
  config, _ = chief_config
  with pytest.raises(ValueError, match=r"2 training tasks \(chief:0, "
                     r"worker:0\) and no ps tasks.*Received "
                     r"variable_strategy='parameter_server'. Pass "
                     r"variable_strategy='replicated'"):
    _build(config, variable_strategy="parameter_server")


def test_the_workers_start_delay_is_refused_with_the_fix(monkeypatch,
                                                         chief_config):
  del chief_config  # the server runs
  _set_tf_config(monkeypatch)
  config = _run_config(experimental_max_worker_delay_secs=None)
  with pytest.raises(ValueError, match=r"experimental_max_worker_delay_secs"
                     r"=0\). Received experimental_max_worker_delay_secs="
                     r"None"):
    _build(config)


def test_training_without_start_server_is_refused(monkeypatch, chief_config):
  del chief_config
  _set_tf_config(monkeypatch, "worker", 0)  # this process is not the worker
  with pytest.raises(ValueError, match=r"replicate.start_server\(run_config"
                     r"\).*before tf.estimator.train_and_evaluate"):
    _build(_run_config())


def test_a_queue_input_is_refused_with_the_fix(chief_config):
  config, _ = chief_config

  def from_queue():
    queue = tf.queue.FIFOQueue(10, [tf.float32, tf.int64],
                               shapes=[[3], []])
    x, y = queue.dequeue_many(4)
    return {"x": x}, y

  with pytest.raises(ValueError, match=r"must return a tf.data.Dataset.*"
                     r"\(QueueDequeueManyV2\).*from_tensor_slices"):
    _build(config, features_labels=from_queue)


def test_a_count_of_rows_into_shared_state_is_refused(chief_config):
  config, _ = chief_config

  def count(features, labels):
    seen = tf.compat.v1.get_variable(
        "seen", [], tf.int32, trainable=False,
        initializer=tf.compat.v1.zeros_initializer())
    return seen.assign_add(tf.shape(labels)[0])

  with pytest.raises(ValueError, match=r"adds to 'seen' from the tower's "
                     r"rows.*replicate.tower_local_scope\('sum'\)"):
    _build(config, params={"extra": count})


def _embedding_step(config, rows=100000, width=16, ids=64,
                    optimizer=tf.compat.v1.train.GradientDescentOptimizer,
                    more_widths=()):
  """The chief's TRAIN graph of an embedding [rows, width], `ids` a batch
  (and one more table of each of `more_widths`)."""

  def embedding_model_fn(features, labels, mode):
    looked_up = []
    for number, columns in enumerate((width,) + tuple(more_widths)):
      table = tf.compat.v1.get_variable(
          "table_{}".format(number) if number else "table", [rows, columns])
      looked_up.append(tf.nn.embedding_lookup(table, features["ids"]))
    logits = tf.compat.v1.layers.dense(tf.concat(looked_up, axis=1), 2,
                                       name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = replicate.TowerOptimizer(optimizer(0.1)).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with tf.Graph().as_default() as graph:
    dataset = tf.data.Dataset.from_tensor_slices(
        ({"ids": np.arange(ids, dtype=np.int64)},
         np.zeros(ids, np.int64))).batch(ids)
    features, labels = tf.compat.v1.data.make_one_shot_iterator(
        dataset).get_next()
    replicate.replicate_model_fn(
        embedding_model_fn, variable_strategy="replicated")(
            features, labels, TRAIN, config=config)
  return graph


def _step_collectives(graph):
  return [op for op in graph.get_operations()
          if op.type.startswith("Collective") and
          not op.name.startswith("start_of_cluster/")]


def test_sparse_gradients_cross_tasks_as_slices_never_densely(chief_config):
  # An embedding of 100k x 16, a batch looking up 64 rows (32 a tower).
  config, _ = chief_config
  rows, width, ids = 100000, 16, 64
  graph = _embedding_step(config, rows, width, ids)
  step = _step_collectives(graph)
  # No collective carries anything of the table's size.
  for op in step:
    known = op.inputs[0].shape.num_elements()
    assert known is None or known < rows, (op.name, op.inputs[0].shape)
  # The slices: every task's length, then values and indices padded to
  # the longest, on a key per padded length (a tensor, not a constant).
  sliced = [op for op in step if "slices_over_tasks" in op.name]
  assert sorted(op.type for op in sliced) == ["CollectiveGatherV2"] * 3
  shapes = sorted((op.inputs[0].dtype.name, str(op.inputs[0].shape))
                  for op in sliced)
  assert shapes == [("float32", "(None, 16)"), ("int32", "(1, 1)"),
                    ("int64", "(None,)")]
  assert sum(tf.get_static_value(op.inputs[-1]) is None
             for op in sliced) == 2  # values' and indices' keys
  assert not [op for op in step if op.type == "CollectiveReduceV2" and
              "slices_over_tasks" in op.name]
  # Bytes a task sends a step (graph count; the padded length is the
  # smallest power of two >= the longest task's rows, 64 here): the
  # length, 64 rows of values and 64 indices, against the dense sum of
  # the table and its touched count (rows x (width + 1) floats).
  sent = 4 + ids * (width * 4 + 8)
  dense = rows * (width + 1) * 4
  print("bytes a step: slices {} B, dense {} B".format(sent, dense))
  assert sent < dense / 1000
  # The update stays sparse: a scatter of the rows looked up, on every
  # tower's copy.
  updates = [op for op in graph.get_operations()
             if op.type == "ResourceScatterAdd"]
  assert len(updates) == 2


def test_every_tables_slices_share_the_steps_few_collectives(chief_config):
  # A CTR model has a sparse gradient per table: 3 collectives each would
  # be 3 x 26 a step. Tables of the same width share their gathers: one
  # all-gather of every length, then values and indices per width.
  config, _ = chief_config
  graph = _embedding_step(config, rows=1000, width=16, ids=8,
                          more_widths=(16, 16, 8))
  sliced = [op for op in _step_collectives(graph)
            if "slices_over_tasks" in op.name]
  shapes = sorted((op.inputs[0].dtype.name, str(op.inputs[0].shape))
                  for op in sliced)
  # Lengths: the 2 widths' totals, then the 3 tables' own that share one.
  assert shapes == sorted([("float32", "(None, 16)"), ("float32", "(None, 8)"),
                           ("int32", "(1, 5)"), ("int64", "(None,)"),
                           ("int64", "(None,)")])


def test_the_batch_is_taken_as_an_optional_that_ends_every_task(
    chief_config):
  config, _ = chief_config
  graph, _ = _build(config)
  types = {op.type for op in graph.get_operations()}
  assert {"IteratorGetNextAsOptional", "OptionalHasValue",
          "OptionalGetValue"} <= types
  # The Estimator's IteratorGetNext is left with nothing to feed.
  get_next = [op for op in graph.get_operations()
              if op.type == "IteratorGetNext"]
  assert get_next and all(not t.consumers() for op in get_next
                          for t in op.outputs)


def _ops_behind_taken_side(op):
  """The ops `op` waits for (data and control) on a step whose `Merge`s
  take their first input: what it waits for when the task has a batch."""
  pending, seen = [op], set()
  while pending:
    node = pending.pop()
    if node in seen:
      continue
    seen.add(node)
    inputs = node.inputs[:1] if node.type == "Merge" else node.inputs
    pending.extend(t.op for t in inputs)
    pending.extend(node.control_inputs)
  return seen


def test_the_forward_pass_does_not_wait_for_the_check_but_updates_do(
    chief_config):
  # The towers compute while every task's (ended, rows) are all-gathered
  # and checked; only a task whose own input ended takes its batch after
  # the check (which then stops it). Every update waits for the check.
  config, _ = chief_config
  graph, spec = _build(config)
  check = graph.get_operation_by_name("take_batch/stop_if_any_input_ended")
  batch = [op for op in graph.get_operations()
           if op.type == "OptionalGetValue" and
           any(c.type != "Shape" for t in op.outputs for c in t.consumers())
           and "cond" not in op.name]
  assert len(batch) == 1
  waits = _ops_behind_taken_side(batch[0])
  assert not [op for op in waits if op.type in ("CollectiveGatherV2",
                                                "PyFunc")]
  assert check in set(graph_walk.ops_behind(batch, follow_control=True))
  updates = [op for op in graph_walk.ops_behind([spec.train_op],
                                                follow_control=True)
             if op.type.startswith(("ResourceApply", "AssignAdd", "Assign"))]
  assert updates
  for update in updates:
    assert check in set(graph_walk.ops_behind([update], follow_control=True))


def test_a_task_whose_input_ended_stops_with_out_of_range():
  tasks = [("chief", 0), ("worker", 0), ("worker", 1)]
  stop = sync_input._StopIfAnyEnded(tasks)  # pylint: disable=protected-access
  assert stop(np.array([0, 0, 0])) == 0
  with pytest.raises(StopIteration, match="the input of worker:0, worker:1 "
                     "ended; every task of the synchronous cluster stops"):
    stop(np.array([0, 1, 1]))


def test_slices_of_a_variable_of_unknown_shape_cross_tasks_as_slices():
  # The all-gather needs no variable shape: each task's length is
  # gathered at run time.
  group = sync_cluster.TaskGroup([("chief", 0), ("worker", 0)], 0)
  with tf.Graph().as_default() as graph:
    cross = sync_cluster.CrossTask(group, "/job:chief/task:0/device:CPU:0")
    shape = tf.compat.v1.placeholder(tf.int64, [2])
    slices = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]), shape)
    (summed,), = allreduce.all_reduce_grads([[slices]], ["/cpu:0"],
                                            allreduce.GATHER, cross=cross)
  assert isinstance(summed, tf.IndexedSlices)
  assert summed.dense_shape is shape
  assert summed.values.shape.as_list() == [None, 3]
  assert len(cross.step_ops) == 3
  assert all(op.type == "CollectiveGatherV2" for op in cross.step_ops)
  assert graph is summed.values.graph


def test_slices_of_a_dtype_collectives_cannot_carry_are_refused():
  group = sync_cluster.TaskGroup([("chief", 0), ("worker", 0)], 0)
  with tf.Graph().as_default():
    cross = sync_cluster.CrossTask(group, "/job:chief/task:0/device:CPU:0")
    slices = tf.IndexedSlices(tf.ones([2, 3], tf.bfloat16),
                              tf.constant([0, 1]), tf.constant([5, 3]))
    with pytest.raises(ValueError, match=r"IndexedSlices\) of bfloat16 "
                       r"cannot cross the tasks.*Fix: .*float32"):
      allreduce.all_reduce_grads([[slices]], ["/cpu:0"], allreduce.GATHER,
                                 cross=cross)


def test_an_unwrapped_optimizer_on_a_task_of_one_tower_is_refused(
    chief_config):
  # With 2 towers tower 1's copy of the op is refused; with one tower,
  # tower 0's is (but for TowerOptimizer's own update).
  config, _ = chief_config

  def extra(features, labels):
    bias = tf.compat.v1.get_variable("extra_bias", [2])
    loss = tf.reduce_sum(bias * tf.reduce_mean(features["x"]))
    return tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, var_list=[bias])

  for devices in (["/cpu:0"], ["/cpu:0", "/cpu:1"]):
    with pytest.raises(ValueError, match=r"ResourceApplyGradientDescent.*is "
                       r"an optimizer update made by the tower itself"):
      _build(config, params={"extra": extra}, devices=devices)
  graph, _ = _build(config, devices=["/cpu:0"])  # wrapped: one tower trains
  assert any(op.type == "CollectiveReduceV2" and "all_reduce_over_tasks" in
             op.name for op in graph.get_operations())


@pytest.mark.parametrize("devices", [["/cpu:0"], ["/cpu:0", "/cpu:1"]])
def test_sync_replicas_optimizer_is_refused_with_the_fix(chief_config,
                                                         devices):
  config, _ = chief_config

  def sync_model_fn(features, labels, mode):
    logits = tf.compat.v1.layers.dense(features["x"], 2)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.SyncReplicasOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), 2, 2))
    train_op = optimizer.minimize(
        loss, tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with tf.Graph().as_default():
    features, labels = _dataset_batch()
    with pytest.raises(ValueError, match="wraps a SyncReplicasOptimizer.*"
                       "trains synchronously already.*Wrap the "
                       "SyncReplicasOptimizer's own optimizer"):
      replicate.replicate_model_fn(
          sync_model_fn, devices=devices, variable_strategy="replicated")(
              features, labels, TRAIN, config=config)


def test_summed_losses_with_regularization_are_refused(chief_config):
  config, _ = chief_config

  def regularized_model_fn(features, labels, mode):
    logits = tf.compat.v1.layers.dense(
        features["x"], 2, kernel_regularizer=tf.keras.regularizers.l2(0.1))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
        labels, logits, reduction=tf.compat.v1.losses.Reduction.SUM)
    loss += tf.compat.v1.losses.get_regularization_loss()
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with tf.Graph().as_default():
    features, labels = _dataset_batch()
    with pytest.raises(ValueError, match=r"Reduction.SUM with regularization "
                       r"losses \('dense/kernel/Regularizer.*would count once "
                       r"per task"):
      replicate.replicate_model_fn(
          regularized_model_fn, variable_strategy="replicated",
          loss_reduction=tf.compat.v1.losses.Reduction.SUM)(
              features, labels, TRAIN, config=config)


def test_an_op_waiting_on_the_iterators_get_next_is_refused(chief_config):
  config, _ = chief_config

  def waiting_on_get_next():
    features, labels = _dataset_batch()
    with tf.control_dependencies([features["x"].op]):
      zero = tf.zeros([], tf.int64, name="labels_after_get_next")
    return features, labels + zero

  with pytest.raises(ValueError, match=r"'labels_after_get_next' wait for "
                     r"that op itself"):
    _build(config, features_labels=waiting_on_get_next)


def test_a_scaffold_with_its_own_readiness_or_a_string_variable_is_refused(
    chief_config):
  config, _ = chief_config

  def own_scaffold_model_fn(features, labels, mode, params):
    spec = _model_fn(features, labels, mode, params)
    return spec._replace(scaffold=tf.compat.v1.train.Scaffold(
        ready_for_local_init_op=tf.constant([], tf.string)))

  with tf.Graph().as_default():
    features, labels = _dataset_batch()
    with pytest.raises(ValueError, match="has its own "
                       "ready_for_local_init_op"):
      replicate.replicate_model_fn(
          own_scaffold_model_fn, variable_strategy="replicated")(
              features, labels, TRAIN, params={}, config=config)

  def name_variable(features, labels):
    del features, labels
    tf.compat.v1.get_variable("run_name", [], tf.string,
                              initializer=tf.compat.v1.constant_initializer(
                                  "a"), trainable=False)
    return tf.no_op()

  with pytest.raises(ValueError, match=r"float16/32/64 and int32/64 only.*"
                     r"'run_name' \(string\)"):
    _build(config, params={"extra": name_variable})


def test_every_collective_of_the_step_runs_with_the_train_op(chief_config):
  # A synchronized batch norm feeding only a summary: its all-gather would
  # run on the chief alone (summaries are the chief's), and hang.
  config, _ = chief_config

  def summary_only(features, labels):
    del labels
    side = tf.compat.v1.layers.batch_normalization(
        features["x"], training=True, name="side_norm")
    tf.compat.v1.summary.histogram("side", side)
    return tf.no_op()

  graph, spec = _build(config, params={"extra": summary_only},
                       sync_batch_norm=True)
  step = [op for op in graph.get_operations()
          if op.type.startswith("Collective") and
          not op.name.startswith("start_of_cluster/")]
  behind_train_op = set(graph_walk.ops_behind([spec.train_op],
                                              follow_control=True))
  assert any("side_norm" in op.name for op in step)
  assert set(step) <= behind_train_op


def test_input_from_two_iterators_is_refused(chief_config):
  config, _ = chief_config

  def two_iterators():
    features, _ = _dataset_batch()
    _, labels = _dataset_batch()
    return features, labels

  with pytest.raises(ValueError, match=r"straight from one iterator.*"
                     r"IteratorGetNext.*IteratorGetNext"):
    _build(config, features_labels=two_iterators)


def test_a_task_outside_the_training_tasks_is_refused(monkeypatch):
  cluster = dict(CLUSTER, reader=["127.0.0.1:{}".format(_free_port())])
  _set_tf_config(monkeypatch, "reader", 0, cluster=cluster)
  with pytest.raises(ValueError, match=r"task reader:0 is not a training "
                     r"task of its cluster \(chief:0, worker:0\)"):
    replicate.start_server(_run_config())


def test_a_worker_whose_chief_never_starts_gives_up_after_the_timeout(
    monkeypatch):
  # This worker's chief (a port nobody listens on) never starts.
  cluster = {"chief": ["127.0.0.1:{}".format(_free_port())],
             "worker": ["127.0.0.1:{}".format(_free_port())]}
  _set_tf_config(monkeypatch, "worker", 0, cluster=cluster)
  monkeypatch.setenv(sync_cluster.TIMEOUT_ENV, "0.5")
  with pytest.raises(RuntimeError, match=r"the group leader chief:0 .* did "
                     r"not start its server within 0.5 s"):
    replicate.start_server(_run_config())


@pytest.mark.parametrize("way", ["compute_gradients", "tf.gradients"])
def test_a_clip_reads_the_gradients_summed_across_tasks_once(chief_config,
                                                             way):
  # API.md: gradients the model_fn touches are the whole batch's, every
  # task's rows included; what apply_gradients then gets is not summed
  # across tasks again (the same collectives as a plain minimize).
  config, _ = chief_config

  def clipping_model_fn(features, labels, mode):
    # get_variable gives a replicated tower its copies.
    variables = [tf.compat.v1.get_variable("w", [3, 2]),
                 tf.compat.v1.get_variable("b", [2])]
    logits = tf.matmul(features["x"], variables[0]) + variables[1]
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))
    if way == "compute_gradients":
      grads, variables = zip(*optimizer.compute_gradients(loss, variables))
    else:
      grads = tf.gradients(loss, variables)
    grads, _ = tf.clip_by_global_norm(grads, 1.0)
    train_op = optimizer.apply_gradients(
        zip(grads, variables), tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  def reduces(model_fn):
    with tf.Graph().as_default() as graph:
      features, labels = _dataset_batch()
      replicate.replicate_model_fn(model_fn, variable_strategy="replicated")(
          features, labels, TRAIN, params={}, config=config)
    return graph, sorted(op.type for op in graph.get_operations()
                         if op.type.startswith("Collective"))

  graph, clipped = reduces(lambda features, labels, mode, params:
                           clipping_model_fn(features, labels, mode))
  _, plain = reduces(_model_fn)
  assert clipped == plain
  norms = [op for op in graph.get_operations()
           if op.name.endswith("global_norm/global_norm")]
  assert len(norms) == 2  # one per tower of the chief
  for norm in norms:
    assert "CollectiveReduceV2" in {op.type for op in graph_walk.ops_behind(
        [norm])}

"""Placement in a ps cluster: variables on the ps tasks, towers on the worker.

Graph-level checks with the RunConfig a TF_CONFIG gives. The chief's and
the worker's servers run in this process, each with 2 virtual CPUs, since
the towers are the devices a task's server has; the ps tasks need not run
to build a graph (`test_multiworker.py` trains on a real cluster).
"""

import json
import socket

import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, TRAIN, session_config



def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


CLUSTER = {job: ["127.0.0.1:{}".format(_free_port()) for _ in range(count)]
           for job, count in (("chief", 1), ("worker", 1), ("ps", 2))}


@pytest.fixture(scope="module", autouse=True)
def servers():
  """The chief's and the worker's servers (they cannot be stopped; they go
  with the test process)."""
  return [tf.distribute.Server(
      tf.train.ClusterSpec(CLUSTER), job_name=job, task_index=0,
      config=session_config(2)) for job in ("chief", "worker")]


def _config(monkeypatch, task_type="worker", index=0, cluster=CLUSTER):
  monkeypatch.setenv("TF_CONFIG", json.dumps(
      {"cluster": cluster, "task": {"type": task_type, "index": index}}))
  return tf.estimator.RunConfig(session_config=session_config(2))


def _model_fn(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features, 3, name="hidden")
  predictions = tf.compat.v1.layers.dense(hidden, 1, name="out")
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _build(config, is_under_estimator_setter=False, mode=TRAIN,
           model_fn=None, **kwargs):
  """The TRAIN graph, optionally inside the replica_device_setter the
  Estimator puts around the model_fn in a ps cluster."""
  graph = tf.Graph()
  with graph.as_default():
    setter = tf.compat.v1.train.replica_device_setter(
        ps_tasks=config.num_ps_replicas,
        worker_device="/job:{}/task:{}".format(config.task_type,
                                               config.task_id),
        merge_devices=True, cluster=config.cluster_spec)
    with graph.device(setter if is_under_estimator_setter else None):
      tf.compat.v1.train.get_or_create_global_step()
      wrapped = replicate.replicate_model_fn(model_fn or _model_fn, **kwargs)
      wrapped(tf.ones([6, 2]), tf.ones([6, 1]), mode, config=config)
  return graph


@pytest.mark.parametrize("is_under_estimator_setter", [False, True])
@pytest.mark.parametrize("task_type, index", [("worker", 0), ("chief", 0)])
def test_variables_go_to_the_ps_tasks_and_towers_stay_on_the_worker(
    monkeypatch, task_type, index, is_under_estimator_setter):
  config = _config(monkeypatch, task_type, index)
  graph = _build(config, is_under_estimator_setter)
  worker = "/job:{}/task:{}".format(task_type, index)
  variables = {v.op.name: v.device
               for v in graph.get_collection("variables")}
  # In creation order, in turn over the 2 ps tasks (the global step was
  # made first, outside the wrapper).
  assert variables["hidden/kernel"] == "/job:ps/task:0/device:CPU:0"
  assert variables["hidden/bias"] == "/job:ps/task:1/device:CPU:0"
  assert variables["out/kernel"] == "/job:ps/task:0/device:CPU:0"
  assert variables["out/bias"] == "/job:ps/task:1/device:CPU:0"
  matmuls = {op.name: op.device for op in graph.get_operations()
             if op.type == "MatMul" and "gradients" not in op.name}
  assert matmuls == {
      "hidden/MatMul": worker + "/device:CPU:0",
      "out/MatMul": worker + "/device:CPU:0",
      "tower_1/hidden/MatMul": worker + "/device:CPU:1",
      "tower_1/out/MatMul": worker + "/device:CPU:1",
  }
  # Each sum of the two towers' gradients runs on the worker, so one
  # gradient per variable goes to the ps tasks.
  sums = [op for op in graph.get_operations() if op.type == "AddN" and
          "_sum_over_towers" in op.name]
  assert len(sums) == 4
  assert {op.device for op in sums} == {worker + "/device:CPU:0"}


def test_without_ps_tasks_training_is_synchronous_and_needs_replicated(
    monkeypatch):
  # Chief and worker, no ps: every task keeps its own copy of the
  # variables (test_sync_cluster.py builds that case), which the default
  # variable_strategy does not; it is refused, not left to wait forever
  # for variables nobody initialises.
  config = _config(monkeypatch, cluster={"chief": CLUSTER["chief"],
                                         "worker": CLUSTER["worker"]})
  assert config.num_ps_replicas == 0
  with pytest.raises(ValueError, match="no ps tasks, which trains "
                     "synchronously.*Pass variable_strategy='replicated'"):
    _build(config)


def test_an_optimizers_own_variables_stay_on_the_ps_tasks(monkeypatch):
  # Adam's beta powers, beside the first variable by name, as unwrapped
  # (only "replicated" with ps tasks keeps them on each task).
  def adam_model_fn(features, labels, mode):
    hidden = tf.compat.v1.layers.dense(features, 3, name="hidden")
    loss = tf.compat.v1.losses.mean_squared_error(
        labels, tf.compat.v1.layers.dense(hidden, 1, name="out"))
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
            loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  graph = _build(_config(monkeypatch), model_fn=adam_model_fn)
  variables = {v.op.name: v.device
               for v in graph.get_collection("variables")}
  assert variables["beta1_power"] == variables["hidden/bias"] == (
      "/job:ps/task:1/device:CPU:0")
  assert variables["hidden/kernel/Adam"] == "/job:ps/task:0/device:CPU:0"


def test_evaluation_on_the_chief_stays_on_local_devices(monkeypatch):
  # Estimator.evaluate runs a local session, even on the chief: a device
  # of /job:chief there would not exist.
  graph = _build(_config(monkeypatch, "chief"), mode=EVAL)
  assert {v.device for v in graph.get_collection("trainable_variables")} == {
      "/device:CPU:0"}
  assert "tower_1/hidden/MatMul" in {op.name for op in graph.get_operations()}
  assert not any(op.device.startswith("/job:")
                 for op in graph.get_operations())


def test_replicated_variables_with_ps_tasks_need_the_server_started(
    monkeypatch):
  # "replicated" with ps tasks trains in lockstep (what the model_fn
  # partitions on the ps tasks: tests/test_hybrid_cluster.py), which needs
  # the collectives' server of replicate.start_server.
  config = _config(monkeypatch)
  with pytest.raises(ValueError, match=(
      r"Pass tf.estimator.RunConfig\(experimental_max_worker_delay_secs=0\)"
      r". Received experimental_max_worker_delay_secs=None")):
    _build(config, variable_strategy="replicated")
  config = config.replace(experimental_max_worker_delay_secs=0)
  with pytest.raises(ValueError, match=(
      r"needs this task's server started by replicate.start_server\("
      r"run_config\)")):
    _build(config, variable_strategy="replicated")


def test_a_device_the_worker_does_not_have_is_refused(monkeypatch):
  config = _config(monkeypatch)
  with pytest.raises(ValueError, match=(
      r"devices contains '/job:worker/task:0/device:CPU:2', which this "
      r"task's server does not have \(it has "
      r"/job:worker/task:0/device:CPU:0, /job:worker/task:0/device:CPU:1")):
    _build(config, devices=["/cpu:0", "/cpu:2"])


@pytest.mark.parametrize("listed, entry", [
    (["/job:worker/task:1/cpu:0"], "/job:worker/task:1/device:CPU:0"),
    (["/cpu:0", "/job:foo/cpu:1"], "/job:foo/device:CPU:1"),
])
def test_a_device_of_another_task_is_refused(monkeypatch, listed, entry):
  with pytest.raises(ValueError, match=(
      r"devices contains '{}', which is not on this task "
      r"\(/job:worker/task:0\): in a cluster with ps tasks each training task "
      r"builds its towers on its own devices\. Name devices without a job or "
      r"task, e.g\. '/gpu:0'".format(entry))):
    _build(_config(monkeypatch), devices=listed)


def test_evaluation_in_a_cluster_refuses_a_task_qualified_device(
    monkeypatch):
  with pytest.raises(ValueError, match=(
      r"contains '/job:chief/task:0/device:CPU:0', which names job 'chief'; "
      r"but evaluation, prediction and training without ps tasks run in a "
      r"local session")):
    _build(_config(monkeypatch, "chief"), mode=EVAL,
           devices=["/job:chief/task:0/cpu:0", "/job:chief/task:0/cpu:1"])


def test_one_tower_per_worker_still_puts_variables_on_the_ps(monkeypatch):
  # A worker whose server has one device: no towers to build, but its
  # variables must be the ps tasks' shared ones, not its own.
  graph = _build(_config(monkeypatch), devices=["/cpu:0"])
  assert {v.device for v in graph.get_collection("trainable_variables")} == {
      "/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0"}
  matmuls = {op.device for op in graph.get_operations()
             if op.type == "MatMul"}
  assert matmuls == {"/job:worker/task:0/device:CPU:0"}

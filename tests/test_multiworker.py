"""A real cluster on 127.0.0.1: 1 ps + chief + 1 worker, 2 towers each.

Each test launches `cluster_job.py` in every task with `LocalCluster` and
waits for the chief, bounded in time. What the tasks did is read back from
the files each writes when it stops, from the checkpoints, and from the
graph the chief saved.
"""

import json
import os
import re
import signal
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.cluster import session_hooks
from replicate.launch import LocalCluster
from conftest import RecordingLog

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                   "cluster_job.py")
ROOT = os.path.dirname(os.path.dirname(JOB))
TIMEOUT = 120  # seconds for any one cluster run; a run takes about 10


def _cluster(model_dir, max_steps, mode, log):
  command = [sys.executable, JOB, str(model_dir), str(max_steps), mode]
  env = {"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
  return LocalCluster(command, num_ps=1, num_workers=2, env=env, log=log)


def _records(model_dir):
  folder = os.path.join(model_dir, "tasks")
  records = {}
  for name in os.listdir(folder):
    with open(os.path.join(folder, name)) as f:
      records[name[:-len(".json")]] = json.load(f)
  return records


def _wait_all(cluster, started):
  """Waits for the chief and the worker, then stops the ps; their codes."""
  deadline = started + TIMEOUT
  codes = [cluster.wait(task, 0, timeout=max(1.0, deadline - time.monotonic()))
           for task in ("chief", "worker")]
  cluster.stop()
  return codes


def _restored_loss(model_dir):
  """Evaluates the chief's last checkpoint locally, with one tower."""
  estimator = tf.estimator.Estimator(
      replicate.replicate_model_fn(_local_model_fn()), model_dir=model_dir)
  return estimator.evaluate(_local_input_fn(), steps=1)


def _local_model_fn():
  sys.path.insert(0, os.path.dirname(JOB))
  import cluster_job  # pylint: disable=import-outside-toplevel
  return lambda features, labels, mode: cluster_job.model_fn(
      features, labels, mode, {"sync": False, "is_chief": True})


def _local_input_fn():
  import cluster_job  # pylint: disable=import-outside-toplevel
  return cluster_job.input_fn


@pytest.fixture
def log():
  """Every task's lines, which a test can wait for; printed on failure."""
  recording = RecordingLog()
  yield recording
  print("\n".join(recording.lines())[-20000:])


def test_asynchronous_training_uses_both_workers(tmp_path, log, monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  model_dir = tmp_path / "model"
  started = time.monotonic()
  with _cluster(model_dir, 3000, "async", log) as cluster:
    assert _wait_all(cluster, started) == [0, 0]
  records = _records(str(model_dir))
  assert sorted(records) == ["chief:0", "worker:0"]
  chief, worker = records["chief:0"], records["worker:0"]
  # Asynchronous: every step of either worker is one update of the global
  # step, so their steps add up to it (as the task that stopped last read
  # it: the other had stopped before); both took a fair share.
  final = max(chief["last_global_step"], worker["last_global_step"])
  assert chief["steps"] + worker["steps"] == final
  assert final >= 3000
  assert chief["steps"] >= 300 and worker["steps"] >= 300
  # The worker joined as soon as the chief had initialised the variables
  # (here within the first steps), not after TensorFlow's 30 s retry, by
  # which time the chief's 3000 steps (about 5 s) would have been done.
  assert worker["first_global_step"] < 1000
  # Two towers per worker, variables on the ps task.
  graph = tf.compat.v1.GraphDef()
  with open(os.path.join(model_dir, "graph.pbtxt")) as f:
    from google.protobuf import text_format  # pylint: disable=import-outside-toplevel
    text_format.Merge(f.read(), graph)
  devices = {node.name: node.device for node in graph.node}
  assert devices["w"] == "/job:ps/task:0/device:CPU:0"
  assert devices["MatMul"] == "/job:chief/task:0/device:CPU:0"
  assert devices["tower_1/MatMul"] == "/job:chief/task:0/device:CPU:1"
  # The chief's checkpoint restores, and the model learnt w = [2, -1]. It
  # is saved as the chief stops: the worker may still take a step after.
  metrics = _restored_loss(str(model_dir))
  assert 3000 <= metrics["global_step"] <= final
  assert metrics["loss"] < 0.1


def test_synchronous_training_aggregates_both_and_stops_promptly(
    tmp_path, log, monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  model_dir = tmp_path / "model"
  started = time.monotonic()
  with _cluster(model_dir, 100, "sync", log) as cluster:
    assert _wait_all(cluster, started) == [0, 0]
    elapsed = time.monotonic() - started
  records = _records(str(model_dir))
  # Each global step is one update aggregating 2 gradients, so the two
  # workers ran at least about 2 steps per update together (stale ones
  # are dropped); asynchronously, 100 updates take about 100 steps
  # together. How the steps split between them is the machine's timing: a
  # worker that joins late leaves the first updates to the other (a loaded
  # CI run: 192 + 10, the worker from global step 90), so only its joining
  # is asserted.
  steps = [record["steps"] for record in records.values()]
  assert [r["last_global_step"] for r in records.values()] == [100, 100]
  assert sum(steps) >= 196 and min(steps) >= 1, records
  # Unfixed, the chief waits 120 s at its close for gradients that never
  # come (SyncReplicasOptimizer's queue runner); a run takes about 12 s.
  assert elapsed < 60, elapsed
  assert _restored_loss(str(model_dir))["global_step"] == 100


def _latest_step(model_dir):
  path = tf.train.latest_checkpoint(str(model_dir))
  return int(path.rsplit("-", 1)[1]) if path else -1


def _saved_checkpoint(at_least):
  """Whether a log line is the chief saving a checkpoint >= `at_least`."""
  def is_saved(line):
    match = re.match(r"\[chief:0\] .*Saving checkpoints for (\d+) ", line)
    return match is not None and int(match.group(1)) >= at_least
  return is_saved


def test_a_restarted_chief_keeps_the_workers_updates(tmp_path, log,
                                                     monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  model_dir = tmp_path / "model"
  started = time.monotonic()
  with _cluster(model_dir, 6000, "async", log) as cluster:
    log.wait_for(_saved_checkpoint(500), TIMEOUT, "saving checkpoint 500+")
    cluster.kill("chief", 0, signal.SIGKILL)
    assert cluster.wait("chief", 0, timeout=10) == -signal.SIGKILL
    killed_at = _latest_step(model_dir)  # the one being saved, or before
    assert killed_at > 0
    cluster.restart("chief", 0)  # the worker trains on meanwhile
    assert _wait_all(cluster, started) == [0, 0]
  records = _records(str(model_dir))
  chief, worker = records["chief:0"], records["worker:0"]
  # Restoring checkpoint `killed_at` onto the live ps would have set the
  # global step back to it, and the worker's updates since with it.
  assert chief["first_global_step"] > killed_at
  assert worker["global_step_went_back"] is False
  final = max(chief["last_global_step"], worker["last_global_step"])
  assert final >= 6000
  # The chief's last checkpoint is saved as it stops, at or after step
  # 6000: the worker may still take a step after it (asynchronous).
  assert 6000 <= _restored_loss(str(model_dir))["global_step"] <= final


def test_a_fresh_ps_gets_the_checkpoint_back(tmp_path):
  # The other branch of the chief's Saver: with nothing initialised on the
  # ps, the checkpoint is restored (here: a local session, nothing live).
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable(
        "w", [], initializer=tf.compat.v1.ones_initializer())
    saver = session_hooks.NoRollbackSaver()
    saver.build()
    with tf.compat.v1.Session() as session:
      session.run(w.initializer)
      session.run(w.assign(5.0))
      path = saver.save(session, str(tmp_path / "model.ckpt"))
      session.run(w.assign(7.0))
      saver.restore(session, path)  # all initialised: keeps 7
      assert session.run(w) == 7.0
    with tf.compat.v1.Session() as session:
      saver.restore(session, path)  # nothing initialised: restores 5
      assert session.run(w) == 5.0
  np.testing.assert_equal(tf.train.load_checkpoint(path).get_tensor("w"), 5.0)

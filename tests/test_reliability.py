"""Faults and scale: mixed precision skips, kill and resume, many towers, leaks."""

import gc
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import TRAIN, checkpoint_values, cpus, session_config
from replicate.call import current


def _mixed_precision_model_fn(features, labels, mode):
  del labels
  w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
  loss = tf.reduce_mean(w * features)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1),
          loss_scale="dynamic"))
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers, strategy", [
    (2, "parameter_server"), (3, "parameter_server"), (3, "replicated")])
def test_a_non_finite_gradient_in_one_tower_skips_the_step(towers, strategy):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [None])
    spec = replicate.replicate_model_fn(
        _mixed_precision_model_fn, devices=cpus(towers),
        variable_strategy=strategy)(x, None, TRAIN)
    variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
    # Replicated: w is copied; the loss scale is not, so the scale the
    # skipped step halves is the one every tower reads next.
    copies = ["tower_{}/w".format(i) for i in range(1, towers)]
    assert [v.op.name for v in tf.compat.v1.local_variables()] == (
        copies if strategy == "replicated" else [])
    with tf.compat.v1.Session(config=session_config(towers)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      seen = []
      # The inf row is the last one: it lands in the last tower only.
      for batch in ([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, np.inf],
                    [1.0, 2.0, 3.0, 4.0]):
        session.run(spec.train_op, {x: batch})
        seen.append(session.run(variables))
  # Step 1: w = 1 - 0.1 * mean(x) = 0.75 at the starting scale 2^15.
  assert seen[0]["w"] == pytest.approx(0.75)
  assert seen[0]["current_loss_scale"] == 2.0**15
  # Step 2: skipped everywhere (w and the global step stay), scale halves.
  assert seen[1]["w"] == pytest.approx(0.75)
  assert seen[1]["global_step"] == 1
  assert seen[1]["current_loss_scale"] == 2.0**14
  assert seen[1]["good_steps"] == 0
  # Step 3 trains again: w = 0.75 - 0.25 = 0.5.
  assert seen[2]["w"] == pytest.approx(0.5)
  assert seen[2]["global_step"] == 2


_TRAINING_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    import replicate

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    model_dir, max_steps, pause_at = sys.argv[1], int(sys.argv[2]), int(
        sys.argv[3])

    def model_fn(features, labels, mode):
      out = tf.compat.v1.layers.dense(
          features, 1, name="out",
          kernel_initializer=tf.compat.v1.constant_initializer(0.1))
      loss = tf.compat.v1.losses.mean_squared_error(labels, out)
      train_op = replicate.TowerOptimizer(
          tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
              loss, global_step=tf.compat.v1.train.get_global_step())
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    class PauseAfterSave(tf.estimator.CheckpointSaverListener):
      # Reports each checkpoint; at `pause_at` waits on stdin, where the
      # test kills the process (an event, not a timed guess).
      def after_save(self, session, global_step_value):
        print("saved", global_step_value, flush=True)
        if global_step_value == pause_at:
          sys.stdin.readline()

    x = np.linspace(0, 1, 21, dtype=np.float32).reshape(7, 3)
    y = x.sum(axis=1, keepdims=True)
    estimator = tf.estimator.Estimator(
        replicate.replicate_model_fn(model_fn), model_dir=model_dir,
        config=tf.estimator.RunConfig(
            session_config=tf.compat.v1.ConfigProto(device_count={"CPU": 2}),
            save_checkpoints_steps=5, tf_random_seed=0))
    estimator.train(lambda: tf.data.Dataset.from_tensors((x, y)).repeat(),
                    max_steps=max_steps, saving_listeners=[PauseAfterSave()])
    print("done", flush=True)
""")


def _start(model_dir, max_steps, pause_at):
  return subprocess.Popen(
      [sys.executable, "-c", _TRAINING_SCRIPT, model_dir, str(max_steps),
       str(pause_at)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL, text=True,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))



def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
  uninterrupted = _start(str(tmp_path / "whole"), 20, pause_at=-1)
  killed = _start(str(tmp_path / "killed"), 20, pause_at=10)
  for line in killed.stdout:  # wait for the checkpoint at step 10
    if line.split() == ["saved", "10"]:
      break
  killed.send_signal(signal.SIGKILL)
  assert killed.wait() == -signal.SIGKILL
  resumed = _start(str(tmp_path / "killed"), 20, pause_at=-1)
  resumed_lines = resumed.communicate()[0].split("\n")
  assert resumed.returncode == 0
  # It resumed from step 10 (the saver writes the restored step first when
  # the session starts), then checkpointed at 15 and 20.
  assert [l for l in resumed_lines if l.startswith("saved")] == [
      "saved 10", "saved 15", "saved 20"]
  assert uninterrupted.communicate()[0].split("\n")[-2] == "done"
  whole = checkpoint_values(str(tmp_path / "whole"))
  after_kill = checkpoint_values(str(tmp_path / "killed"))
  assert sorted(after_kill) == sorted(whole)
  assert after_kill["global_step"] == 20
  for name, value in whole.items():
    np.testing.assert_allclose(after_kill[name], value, rtol=1e-6,
                               err_msg=name)


def _linear_model_fn(features, labels, mode):
  w = tf.compat.v1.get_variable("w", [3, 1],
                                initializer=tf.ones_initializer())
  loss = tf.compat.v1.losses.mean_squared_error(labels, features @ w)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", [8, 16])
def test_many_towers_build_and_train_like_one_device(towers):
  x = np.linspace(-1, 1, 60, dtype=np.float32).reshape(20, 3)
  y = x @ np.array([[1.0], [2.0], [-1.0]], np.float32)
  results = []
  for model_fn, count in ((_linear_model_fn, 1),
                          (replicate.replicate_model_fn(
                              _linear_model_fn, devices=cpus(towers)),
                           towers)):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      spec = model_fn(tf.constant(x), tf.constant(y), TRAIN)
      with tf.compat.v1.Session(config=session_config(count)) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for _ in range(3):
          session.run(spec.train_op)
        results.append(session.run(tf.compat.v1.trainable_variables()[0]))
  # 20 rows over 16 towers: 4 towers get 2 rows, 12 get 1.
  np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


def _resident_bytes():
  with open("/proc/self/statm") as statm:
    return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_building_in_many_graphs_leaves_nothing_behind():
  wrapped = replicate.replicate_model_fn(_linear_model_fn, devices=cpus(3))

  def build_once():
    with tf.Graph().as_default() as graph:
      tf.compat.v1.train.get_or_create_global_step()
      wrapped(tf.ones([5, 3]), tf.ones([5, 1]), TRAIN)
      assert not graph.get_collection(current._COLLECTION)
      assert "replicate" not in " ".join(
          str(k) for k in graph.get_all_collection_keys())

  for _ in range(20):  # warm up caches that legitimately fill once
    build_once()
  gc.collect()
  before = _resident_bytes()
  for _ in range(200):
    build_once()
  gc.collect()
  growth = _resident_bytes() - before
  # Measured here: one graph of this model_fn kept alive costs about 1.1 MB
  # of resident memory, so 200 leaked graphs would be ~220 MB; without a
  # leak the process grew by about 5 MB over 200 graphs.
  assert growth < 40 * 2**20, "{:.1f} MB more after 200 graphs".format(
      growth / 2**20)

"""The job every task of the multi-worker tests runs (see test_multiworker.py).

A linear model, 2 towers per worker (virtual CPUs), trained with
`tf.estimator.train_and_evaluate` on the cluster in `TF_CONFIG`. Each
training task writes what it did to `<model_dir>/tasks/<task>.json` when it
stops: its own number of steps and the global step before and after.

  python tests/cluster_job.py MODEL_DIR MAX_STEPS {async,sync}

The Estimator starts a task's server with only the `gpu_options` of the
session config, so virtual CPUs never reach it and a worker would have one
tower. This job starts the chief's and the worker's servers itself, with 2
virtual CPUs, and sets TF_CONFIG's environment to "google", the value that
tells `train_and_evaluate` the servers are started already (ps tasks keep
the Estimator's). On GPUs none of this is needed.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import replicate

WORKERS = 2  # chief + 1 worker
TRUE_W = np.array([[2.0], [-1.0]], np.float32)


def model_fn(features, labels, mode, params):
  w = tf.compat.v1.get_variable("w", [2, 1],
                                initializer=tf.compat.v1.zeros_initializer())
  loss = tf.compat.v1.losses.mean_squared_error(labels,
                                                tf.matmul(features, w))
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.05)
  if params["sync"]:
    optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
        optimizer, replicas_to_aggregate=WORKERS, total_num_replicas=WORKERS)
  optimizer = replicate.TowerOptimizer(optimizer)
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_or_create_global_step())
  hooks = ([optimizer.make_session_run_hook(params["is_chief"])]
           if params["sync"] else [])
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    training_hooks=hooks)


def input_fn():
  x = np.random.RandomState(0).rand(64, 2).astype(np.float32)
  return tf.compat.v1.data.Dataset.from_tensor_slices(
      (x, x @ TRUE_W)).repeat().batch(8)


class _Record(tf.compat.v1.train.SessionRunHook):
  """Counts this task's steps; writes them, with the global step, at the end."""

  def __init__(self, path):
    self._path = path
    self._steps = 0
    self._first = None
    self._previous = None
    self._went_back = False  # did the global step ever decrease?

  def begin(self):
    self._global_step = tf.compat.v1.train.get_global_step()

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._global_step)

  def after_run(self, run_context, run_values):
    global_step = int(run_values.results)
    if self._first is None:
      self._first = global_step
    if self._previous is not None and global_step < self._previous:
      self._went_back = True
    self._previous = global_step
    self._steps += 1

  def end(self, session):
    record = {"steps": self._steps, "first_global_step": self._first,
              "last_global_step": int(session.run(self._global_step)),
              "global_step_went_back": self._went_back}
    os.makedirs(os.path.dirname(self._path), exist_ok=True)
    with open(self._path, "w") as f:
      json.dump(record, f)


def _serve_with_two_cpus():
  """This training task's server, with 2 virtual CPUs (see the docstring)."""
  tf_config = json.loads(os.environ["TF_CONFIG"])
  task = tf_config["task"]
  if task["type"] not in ("chief", "worker"):
    return None
  tf_config["environment"] = "google"
  os.environ["TF_CONFIG"] = json.dumps(tf_config)
  return tf.distribute.Server(
      tf.train.ClusterSpec(tf_config["cluster"]), job_name=task["type"],
      task_index=task["index"],
      config=tf.compat.v1.ConfigProto(device_count={"CPU": 2}))


def main(model_dir, max_steps, mode):
  server = _serve_with_two_cpus()  # noqa: F841 (kept alive while training)
  config = tf.estimator.RunConfig(
      model_dir=model_dir, save_checkpoints_steps=100,
      session_config=tf.compat.v1.ConfigProto(device_count={"CPU": 2}),
      experimental_max_worker_delay_secs=0, log_step_count_steps=50)
  estimator = tf.estimator.Estimator(
      replicate.replicate_model_fn(model_fn), config=config,
      params={"sync": mode == "sync", "is_chief": config.is_chief})
  task = "{}:{}".format(config.task_type, config.task_id)
  record = _Record(os.path.join(model_dir, "tasks", task + ".json"))
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(input_fn, max_steps=max_steps, hooks=[record]),
      tf.estimator.EvalSpec(input_fn, steps=1))


if __name__ == "__main__":
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

"""Shared test set-up: quiet TensorFlow, virtual CPU devices, small graphs."""

import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import replicate  # noqa: E402

tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)

# `make test` runs part of the suite a second time with REPLICATE_TF1_BEHAVIOR=1:
# TensorFlow 1 behaviour (Dimension shapes, ref variables by default, v1
# control flow), as a model still written for TF 1 runs it. It is switched
# here, before any test module builds a graph, and holds for the process.
IS_TF1_BEHAVIOR = os.environ.get("REPLICATE_TF1_BEHAVIOR") == "1"
if IS_TF1_BEHAVIOR:
  tf.compat.v1.disable_v2_behavior()

TRAIN = tf.estimator.ModeKeys.TRAIN
EVAL = tf.estimator.ModeKeys.EVAL
PREDICT = tf.estimator.ModeKeys.PREDICT

MAX_CPUS = 4


def cpus(count):
  """['/cpu:0', ..., '/cpu:{count-1}']: virtual devices of `session_config`."""
  return ["/cpu:{}".format(i) for i in range(count)]


def session_config(count=MAX_CPUS):
  """A session with `count` virtual CPU devices, as the Estimator would get."""
  return tf.compat.v1.ConfigProto(device_count={"CPU": count})


@pytest.fixture(autouse=True)
def resource_variables_for_replicated(request):
  """Under TF 1 behaviour, resource variables for "replicated" tests only.

  TF 1 behaviour makes ref variables by default, and "replicated" refuses
  to copy a ref variable, with an error that says to use resource variables
  (tests/test_replicated.py checks it). A TF 1 model that wants
  "replicated" must therefore turn them on, as done here; every other test
  keeps TF 1's ref variables, which the other strategies must handle.
  """
  if not (IS_TF1_BEHAVIOR and "replicated" in request.node.nodeid):
    yield
    return
  tf.compat.v1.enable_resource_variables()
  try:
    yield
  finally:
    tf.compat.v1.disable_resource_variables()


@pytest.fixture
def graph():
  """A fresh default graph with a global step, as an Estimator builds."""
  with tf.Graph().as_default() as g:
    tf.compat.v1.train.get_or_create_global_step()
    yield g


def run_initialized(fetches, feed_dict=None, steps=1):
  """Initialises the default graph's variables, runs `fetches` `steps` times."""
  with tf.compat.v1.Session(config=session_config()) as session:
    session.run([tf.compat.v1.global_variables_initializer(),
                 tf.compat.v1.local_variables_initializer()])
    results = [session.run(fetches, feed_dict) for _ in range(steps)]
  return results if steps > 1 else results[0]


def replication_context(graph, count=2,
                        reduction=tf.compat.v1.losses.Reduction.MEAN):
  """A replication context for `count` towers on a batch of `count` rows."""
  from replicate.towers import context as context_lib  # pylint: disable=import-outside-toplevel
  from replicate.call import layout as layout_lib  # pylint: disable=import-outside-toplevel
  from replicate.shard import sharding  # pylint: disable=import-outside-toplevel
  from replicate.variables import strategies, tower_variables  # pylint: disable=import-outside-toplevel
  layout = layout_lib.TowerLayout.of(
      cpus(count), [lambda op, d=d: d for d in cpus(count)],
      sharding.split_batch(tf.ones([count, 1]), None, count),
      strategies.ParameterServer(cpus(count)))
  return context_lib.replication_context(
      layout, reduction, tower_variables.TowerVariables(graph, cpus(count),
                                                  is_replicated=False))


def regression_spec(mode, labels, predictions, optimizer):
  """A regression's EstimatorSpec: squared error, one TowerOptimizer, MAE."""
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  train_op = replicate.TowerOptimizer(optimizer).minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op,
      eval_metric_ops={"mae": tf.compat.v1.metrics.mean_absolute_error(
          labels, predictions)})


def assert_all_finite(values):
  for value in tf.nest.flatten(values):
    assert np.all(np.isfinite(value)), value


def checkpoint_values(model_dir):
  """{variable name: value} of the latest checkpoint in `model_dir`."""
  reader = tf.train.load_checkpoint(model_dir)
  return {name: reader.get_tensor(name)
          for name, _ in tf.train.list_variables(model_dir)}


class RecordingLog:
  """A `log` stream whose lines a test can wait for."""

  def __init__(self):
    self._text = ""
    self._changed = threading.Condition()

  def write(self, text):
    with self._changed:
      self._text += text
      self._changed.notify_all()

  def flush(self):
    pass

  def lines(self):
    with self._changed:
      return self._text.splitlines()

  def wait_for_prefix(self, prefix, timeout=20):
    """Waits for a line starting with `prefix`; returns that line."""
    return self.wait_for(lambda line: line.startswith(prefix), timeout,
                         "starting {!r}".format(prefix))

  def wait_for(self, is_wanted, timeout, description="wanted"):
    """Waits for a line for which `is_wanted(line)`; returns that line."""
    def find():
      return next((line for line in self._text.splitlines()
                   if is_wanted(line)), None)
    with self._changed:
      if not self._changed.wait_for(find, timeout):
        raise AssertionError("no line {} after {} s in:\n{}".format(
            description, timeout, self._text[-20000:]))
      return find()

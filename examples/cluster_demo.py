"""The digits demo on a TF_CONFIG cluster: ps tasks, a chief and workers.

Every task runs this script with its own TF_CONFIG; the local launcher
starts them all on loopback ports:

    python -m replicate.launch --ps 1 --workers 2 -- \\
        python examples/cluster_demo.py --model-dir /tmp/digits_cluster

On a real cluster, run it once per task with that task's TF_CONFIG (see the
docs/multi-worker.md). Each worker trains one tower per local device
(its GPUs; here the one CPU device the Estimator's server gets); variables
live on the ps tasks. The chief prints what it trains, then every
--progress-every global steps the step, the loss and the cluster's
examples/sec, and at the end the test accuracy from its last checkpoint;
each worker prints its global steps per second as a JSON line (which
`python -m benchmarks.cluster` reads).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import replicate  # noqa: E402
from digits_demo import (_dataset, _digits, model_fn, positive,  # noqa: E402
                         quiet_tensorflow)


class GlobalStepsPerSecondHook(tf.estimator.SessionRunHook):
  """The global step's rate between this task's first and last step."""

  def __init__(self):
    self._global_step = None
    self._first = None
    self.rate = float("nan")  # an evaluator never trains: it stays NaN

  def begin(self):
    self._global_step = tf.compat.v1.train.get_global_step()

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._global_step)

  def after_run(self, run_context, run_values):
    now = time.perf_counter()
    if self._first is None:  # the first step builds and warms up
      self._first = (now, run_values.results)
    elif now > self._first[0]:
      self.rate = (run_values.results - self._first[1]) / (now -
                                                           self._first[0])


class ProgressHook(tf.estimator.SessionRunHook):
  """Prints the global step, the loss and the cluster's examples/sec.

  Once every `every_steps` global steps, which all workers advance: each
  global step is one worker's batch of `batch_size` rows.
  """

  def __init__(self, loss, batch_size, max_steps, every_steps):
    self._loss = loss
    self._batch_size = batch_size
    self._max_steps = max_steps
    self._every_steps = every_steps
    self._global_step = None
    self._last = None  # (time, global step) of the last line

  def begin(self):
    self._global_step = tf.compat.v1.train.get_global_step()

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs([self._global_step, self._loss])

  def after_run(self, run_context, run_values):
    step, loss = run_values.results
    now = time.perf_counter()
    if self._last is None:  # the first step builds and warms up
      self._last = (now, step)
      return
    last_time, last_step = self._last
    if step // self._every_steps > last_step // self._every_steps:
      steps_per_second = (step - last_step) / (now - last_time)
      print("global step {:>{width}}/{}  loss {:<9.3g} {:>8,.0f} examples/sec "
            "({:.0f} global steps/sec)".format(
                step, self._max_steps, loss,
                steps_per_second * self._batch_size, steps_per_second,
                width=len(str(self._max_steps))), flush=True)
      self._last = (now, step)


def main():
  args = _parse_args()
  x_train, x_test, y_train, y_test = _digits()
  config = tf.estimator.RunConfig(
      model_dir=args.model_dir, experimental_max_worker_delay_secs=0,
      save_checkpoints_steps=500, log_step_count_steps=500)
  replicated = replicate.replicate_model_fn(model_fn)

  def model_fn_with_progress(features, labels, mode, params, config):
    # The replicated spec's loss is the whole batch's (a tower's own hooks
    # would see only tower 0's), so the progress hook is added here.
    spec = replicated(features, labels, mode, params, config)
    if mode == tf.estimator.ModeKeys.TRAIN and config.is_chief:
      spec = spec._replace(training_hooks=list(spec.training_hooks) + [
          ProgressHook(spec.loss, args.batch_size, args.steps,
                       args.progress_every)])
    return spec

  estimator = tf.estimator.Estimator(
      model_fn=model_fn_with_progress, config=config,
      params={"hidden_units": [128, 64], "learning_rate": 0.002})
  if config.is_chief:
    print("Training {:,} global steps of {} rows on {} (the chief "
          "included) and {}; checkpoints in {}".format(
              args.steps, args.batch_size,
              _count(config.num_worker_replicas, "worker"),
              _count(config.num_ps_replicas, "ps task"), args.model_dir),
          flush=True)
  speed = GlobalStepsPerSecondHook()
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(
          lambda: _dataset(x_train, y_train, args.batch_size, shuffle=True),
          max_steps=args.steps, hooks=[speed]),
      tf.estimator.EvalSpec(lambda: _dataset(x_test, y_test, args.batch_size),
                            steps=None, start_delay_secs=0, throttle_secs=0))
  task = "{}:{}".format(config.task_type, config.task_id)
  if config.task_type != "evaluator":
    print(json.dumps({"task": task, "global_steps_per_second":
                      round(speed.rate, 1)}), flush=True)
  if config.is_chief:
    local = tf.estimator.Estimator(
        model_fn=replicate.replicate_model_fn(model_fn),
        model_dir=args.model_dir,
        params={"hidden_units": [128, 64], "learning_rate": 0.002})
    metrics = local.evaluate(lambda: _dataset(x_test, y_test,
                                              args.batch_size))
    print("test accuracy {:.4f} at global step {}".format(
        metrics["accuracy"], metrics["global_step"]), flush=True)


def _count(number, noun):
  return "{} {}{}".format(number, noun, "" if number == 1 else "s")


def _parse_args(argv=None):
  return make_parser().parse_args(argv)


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model-dir", metavar="DIR", required=True,
                      help="shared by every task: checkpoints go here "
                      "(required)")
  parser.add_argument("--steps", metavar="N", type=positive, default=3000,
                      help="global steps to train (default: %(default)s)")
  parser.add_argument("--batch-size", metavar="ROWS", type=positive,
                      default=128,
                      help="each worker's batch (default: %(default)s)")
  parser.add_argument("--progress-every", metavar="STEPS", type=positive,
                      default=500, help="global steps between the chief's "
                      "progress lines (default: %(default)s)")
  return parser


if __name__ == "__main__":
  quiet_tensorflow()
  main()

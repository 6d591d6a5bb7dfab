"""The digits demo on a TF_CONFIG cluster: ps tasks, a chief and workers.

Every task runs this script with its own TF_CONFIG; the local launcher
starts them all on loopback ports:

    python -m replicate.launch --ps 1 --workers 2 -- \\
        python examples/cluster_demo.py --model-dir /tmp/digits_cluster

On a real cluster, run it once per task with that task's TF_CONFIG (see the
README's "Many machines"). Each worker trains one tower per local device
(its GPUs; here the one CPU device the Estimator's server gets); variables
live on the ps tasks. The chief prints the cluster's global steps per second
and, at the end, the test accuracy from its last checkpoint.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import replicate  # noqa: E402
from digits_demo import _dataset, _digits, model_fn, positive  # noqa: E402


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


def main():
  args = _parse_args()
  x_train, x_test, y_train, y_test = _digits()
  config = tf.estimator.RunConfig(
      model_dir=args.model_dir, experimental_max_worker_delay_secs=0,
      save_checkpoints_steps=500, log_step_count_steps=500)
  estimator = tf.estimator.Estimator(
      model_fn=replicate.replicate_model_fn(model_fn), config=config,
      params={"hidden_units": [128, 64], "learning_rate": 0.002})
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
  return parser


if __name__ == "__main__":
  main()

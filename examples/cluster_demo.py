"""The digits demo on a TF_CONFIG cluster: a chief, workers, maybe ps tasks.

Every task runs this script with its own TF_CONFIG; the local launcher
starts them all on loopback ports. Without ps tasks, the cluster trains
synchronously (`replicate.start_server`, `variable_strategy="replicated"`):

    python -m replicate.launch --workers 2 -- \\
        python examples/cluster_demo.py --model-dir /tmp/digits_sync

Each task then trains 2 towers (2 virtual CPU devices), each with a copy of
every variable, on its own share of the training set, and every step sums
all tasks' gradients: one global step is every task's batch. With ps tasks,
training is asynchronous, as in `tf.estimator`:

    python -m replicate.launch --ps 1 --workers 2 -- \\
        python examples/cluster_demo.py --model-dir /tmp/digits_cluster

Each worker then trains one tower per local device (its GPUs; here the one
CPU device the Estimator's server gets); variables live on the ps tasks and
one global step is one worker's batch.

On a real cluster, run it once per task with that task's TF_CONFIG (see the
docs/multi-worker.md). The chief prints what it trains, then every
--progress-every global steps the step, the loss and the cluster's
examples/sec, and at the end the test accuracy from its last checkpoint;
each training task prints, as a JSON line, how many steps it ran, the
global step at its end and the global steps per second (which `python -m
benchmarks.cluster` reads; null when it trained fewer than 2 steps).

Run again with the same --model-dir, it resumes from the chief's last
checkpoint and trains up to --steps global steps in all: if that
checkpoint is at --steps already, the chief says so, trains nothing and
evaluates it.
"""

import json
import math
import os
import time

import demo_flags


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  return demo_flags.cluster_parser(__doc__.splitlines()[0])


if __name__ == "__main__":
  # --help and a bad flag answer before TensorFlow's import, which takes
  # seconds; main() parses the command line again.
  make_parser().parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import replicate  # noqa: E402
from digits_demo import (_dataset, _digits, model_fn,  # noqa: E402
                         quiet_tensorflow)


class GlobalStepsPerSecondHook(tf.estimator.SessionRunHook):
  """The global step's rate between this task's first and last step.

  Also counts this task's steps and reads the global step at its end.
  """

  def __init__(self):
    self._global_step = None
    self._first = None
    # An evaluator never trains, nor a task whose checkpoint is at the
    # last step already: it stays NaN (printed as null).
    self.rate = float("nan")
    self.steps = 0
    self.last_global_step = None

  def begin(self):
    self._global_step = tf.compat.v1.train.get_global_step()

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._global_step)

  def after_run(self, run_context, run_values):
    now = time.perf_counter()
    self.steps += 1
    if self._first is None:  # the first step builds and warms up
      self._first = (now, run_values.results)
    elif now > self._first[0]:
      self.rate = (run_values.results - self._first[1]) / (now -
                                                           self._first[0])

  def end(self, session):
    # The step fetched above is read before its own update: read it again.
    self.last_global_step = int(session.run(self._global_step))


class ProgressHook(tf.estimator.SessionRunHook):
  """Prints the global step, the loss and the cluster's examples/sec.

  Once every `every_steps` global steps, which all workers advance: each
  global step is `rows_per_step` rows (one worker's batch with ps tasks,
  every task's batch in a synchronous cluster).
  """

  def __init__(self, loss, rows_per_step, max_steps, every_steps):
    self._loss = loss
    self._rows_per_step = rows_per_step
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
                steps_per_second * self._rows_per_step, steps_per_second,
                width=len(str(self._max_steps))), flush=True)
      self._last = (now, step)


def main():
  args = _parse_args()
  x_train, x_test, y_train, y_test = _digits()
  sync = _is_synchronous_cluster()
  config = tf.estimator.RunConfig(
      model_dir=args.model_dir, experimental_max_worker_delay_secs=0,
      save_checkpoints_steps=500, log_step_count_steps=500,
      # Without ps: 2 towers per task, each on a virtual CPU device.
      session_config=tf.compat.v1.ConfigProto(device_count={"CPU": 2})
      if sync else None)
  if sync:
    replicate.start_server(config)  # before train_and_evaluate, once
  replicated = replicate.replicate_model_fn(
      model_fn, variable_strategy="replicated" if sync else
      "parameter_server")
  workers = config.num_worker_replicas
  rows_per_step = args.batch_size * (workers if sync else 1)

  def model_fn_with_progress(features, labels, mode, params, config):
    # The replicated spec's loss is the whole batch's (a tower's own hooks
    # would see only tower 0's), so the progress hook is added here.
    spec = replicated(features, labels, mode, params, config)
    if mode == tf.estimator.ModeKeys.TRAIN and config.is_chief:
      spec = spec._replace(training_hooks=list(spec.training_hooks) + [
          ProgressHook(spec.loss, rows_per_step, args.steps,
                       args.progress_every)])
    return spec

  estimator = tf.estimator.Estimator(
      model_fn=model_fn_with_progress, config=config,
      params={"hidden_units": [128, 64], "learning_rate": 0.002})
  # A model dir trained before: Estimator.train trains only up to --steps,
  # so a checkpoint already there trains nothing, which the chief says.
  already = _checkpoint_step(args.model_dir)
  if config.is_chief and already is not None and already >= args.steps:
    print("Nothing to train: the checkpoint in {} is at global step {:,} "
          "already, and --steps is {:,}. Evaluating it; to train again, give "
          "a new --model-dir or more --steps.".format(
              args.model_dir, already, args.steps), flush=True)
  elif config.is_chief and sync:
    print("Training {:,} global steps of {} rows on {} (the chief "
          "included), synchronously: {} rows a step, 2 towers a worker; "
          "checkpoints in {}".format(
              args.steps, args.batch_size, _count(workers, "worker"),
              rows_per_step, args.model_dir), flush=True)
  elif config.is_chief:
    print("Training {:,} global steps of {} rows on {} (the chief "
          "included) and {}; checkpoints in {}".format(
              args.steps, args.batch_size, _count(workers, "worker"),
              _count(config.num_ps_replicas, "ps task"), args.model_dir),
          flush=True)
  if sync and config.task_type != "evaluator":
    # Each task trains on its own share of the rows, so a step's batches
    # differ (with ps tasks every worker reads all of them, as before).
    rank = 0 if config.is_chief else 1 + config.task_id
    x_train, y_train = x_train[rank::workers], y_train[rank::workers]
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
    # Valid JSON: no rate (fewer than 2 steps trained) is null, not NaN.
    print(json.dumps({
        "task": task, "steps": speed.steps,
        "last_global_step": (already if speed.last_global_step is None
                             else speed.last_global_step),
        "global_steps_per_second": (None if math.isnan(speed.rate) else
                                    round(speed.rate, 1))},
                     allow_nan=False), flush=True)
  if config.is_chief:
    local = tf.estimator.Estimator(
        model_fn=replicate.replicate_model_fn(model_fn),
        model_dir=args.model_dir,
        params={"hidden_units": [128, 64], "learning_rate": 0.002})
    metrics = local.evaluate(lambda: _dataset(x_test, y_test,
                                              args.batch_size))
    print("test accuracy {:.4f} at global step {}".format(
        metrics["accuracy"], metrics["global_step"]), flush=True)


def _checkpoint_step(model_dir):
  """The global step of `model_dir`'s latest checkpoint; None without one."""
  checkpoint = tf.train.latest_checkpoint(model_dir)
  if checkpoint is None:
    return None
  return int(tf.train.load_variable(checkpoint, "global_step"))


def _is_synchronous_cluster():
  """Whether TF_CONFIG gives a cluster without ps tasks: synchronous."""
  cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster")
  return bool(cluster) and not cluster.get("ps")


def _count(number, noun):
  return "{} {}{}".format(number, noun, "" if number == 1 else "s")


def _parse_args(argv=None):
  return make_parser().parse_args(argv)


if __name__ == "__main__":
  quiet_tensorflow()
  main()

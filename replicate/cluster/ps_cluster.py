"""Multi-worker placement: variables on the ps tasks, towers on this worker.

On the session (see `replicate.cluster.session_hooks`): a chief's TRAIN spec gets a Saver
that does not roll the live ps variables back when the chief restarts, and
a worker's gets a hook that starts its session as soon as the chief has
initialised the variables.

On clusters: an Estimator reads its cluster from `TF_CONFIG` into its
`RunConfig`. When that cluster has ps tasks and this process is a training
task (`chief`, `worker` or `master`), each worker builds one tower per
local device, qualified with its own job and task
(`/job:worker/task:1/device:GPU:0`), variables go to the ps tasks in turn,
in creation order (as `tf.compat.v1.train.replica_device_setter`, which the
Estimator also wraps around the `model_fn`, does), and the towers'
gradients are summed on the worker's CPU before the one update is sent to
the ps tasks. Without ps tasks nothing changes.
"""

from typing import List, Optional, Sequence

import tensorflow as tf

from replicate.cluster import session_hooks

_TRAINING_TASKS = ("chief", "worker", "master")


def num_ps_tasks(config, mode: str) -> int:
  """The ps tasks this process trains against; 0 when not in a ps cluster.

  Only TRAIN runs on the cluster: the Estimator evaluates and predicts in a
  local session, even on the chief, so those graphs stay on local devices.
  """
  if (mode != tf.estimator.ModeKeys.TRAIN or config is None or
      getattr(config, "task_type", None) not in _TRAINING_TASKS):
    return 0
  return getattr(config, "num_ps_replicas", 0) or 0


def num_training_tasks(config) -> int:
  """How many tasks of the RunConfig's cluster train (chief, workers)."""
  spec = getattr(config, "cluster_spec", None)
  if not spec or not spec.jobs:
    return 0
  return sum(spec.num_tasks(job) for job in spec.jobs
             if job in _TRAINING_TASKS)


def worker_device(config) -> str:
  """This task's device prefix, e.g. '/job:worker/task:1'."""
  return "/job:{}/task:{}".format(config.task_type, config.task_id)


def tower_devices(devices: Optional[Sequence[str]], config) -> List[str]:
  """This task's devices for the towers: `devices`, or all its GPUs or CPUs.

  They are what this task's server has, asked of the server itself: the
  Estimator starts it with only the session config's `gpu_options`, so its
  devices can differ from what the session config alone would give (a
  `device_count` of virtual CPUs never reaches it).
  """
  task = worker_device(config)
  if devices is not None:
    _check_on_task(devices, config)
  available = _server_devices(config.master, task)
  if devices is None:
    gpus = [d for d in available if "/device:GPU:" in d]
    return gpus or [d for d in available if "/device:CPU:" in d]
  qualified = [_on_task(d, task) for d in devices]
  missing = [d for d in qualified if d not in available]
  if missing:
    raise ValueError(
        "devices contains {}, which this task's server does not have (it "
        "has {}). Use devices=None for every device of the task.".format(
            ", ".join(repr(d) for d in missing), ", ".join(available)))
  return qualified


def gradient_sum_device(config) -> str:
  """Where a worker sums its towers' gradients: its own first CPU."""
  return worker_device(config) + "/device:CPU:0"


def for_cluster(spec: tf.estimator.EstimatorSpec, config, num_ps: int
               ) -> tf.estimator.EstimatorSpec:
  """`spec`, with what a training task of a ps cluster needs around it."""
  if not num_ps or spec.mode != tf.estimator.ModeKeys.TRAIN:
    return spec
  if not config.is_chief:
    return spec._replace(training_hooks=list(spec.training_hooks) + [
        session_hooks.WaitForChiefHook(config.master, config.session_config)])
  if spec.scaffold.saver is not None or tf.compat.v1.get_collection(
      tf.compat.v1.GraphKeys.SAVERS):
    return spec  # the model_fn chose its own Saver
  # The Saver the Estimator would make, but one that keeps live variables.
  saver = session_hooks.NoRollbackSaver(
      sharded=True, max_to_keep=config.keep_checkpoint_max,
      keep_checkpoint_every_n_hours=config.keep_checkpoint_every_n_hours,
      defer_build=True, save_relative_paths=True)
  return spec._replace(scaffold=tf.compat.v1.train.Scaffold(
      saver=saver, copy_from_scaffold=spec.scaffold))


def _check_on_task(devices, config):
  """A task's towers are its own devices; another job or task is refused."""
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    if (spec.job not in (None, config.task_type) or
        spec.task not in (None, config.task_id)):
      raise ValueError(
          "devices contains {!r}, which is not on this task ({}): in a "
          "cluster with ps tasks each training task builds its towers on "
          "its own devices. Name devices without a job or task, e.g. "
          "'/gpu:0', and every task uses its own.".format(
              device, worker_device(config)))


def _server_devices(master, task):
  """The devices of `task`, as its running server lists them."""
  only_this_task = tf.compat.v1.ConfigProto(device_filters=[task])
  with tf.Graph().as_default(), tf.compat.v1.Session(
      master, config=only_this_task) as session:
    return [_on_task(d.name, task) for d in session.list_devices()]


def _on_task(device, task):
  """`device` qualified with `task`, in canonical spelling (no replica)."""
  spec = tf.DeviceSpec.from_string(task).make_merged_spec(
      tf.DeviceSpec.from_string(device))
  return spec.replace(replica=None).to_string()

"""Multi-worker placement: variables on the ps tasks, towers on this worker.

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

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

_TRAINING_TASKS = ("chief", "worker", "master")


def num_ps_tasks(config) -> int:
  """The ps tasks this process trains against; 0 when not in a ps cluster."""
  if config is None or getattr(config, "task_type", None) not in \
      _TRAINING_TASKS:
    return 0
  return getattr(config, "num_ps_replicas", 0) or 0


def worker_device(config) -> str:
  """This task's device prefix, e.g. '/job:worker/task:1'."""
  return "/job:{}/task:{}".format(config.task_type, config.task_id)


def on_this_worker(devices: Sequence[str], config) -> List[str]:
  """Local device strings, qualified with this task's job and index."""
  task = tf.DeviceSpec.from_string(worker_device(config))
  return [task.make_merged_spec(tf.DeviceSpec.from_string(d)).to_string()
          for d in devices]


def gradient_sum_device(config) -> str:
  """Where a worker sums its towers' gradients: its own first CPU."""
  return worker_device(config) + "/device:CPU:0"


def variable_device_chooser(num_ps: int) -> Callable[[tf.Operation], str]:
  """Places variables on the ps tasks in turn, in creation order."""
  order = {}  # variable op name -> its place in creation order

  def choose(op):
    position = order.setdefault(op.name, len(order))
    return "/job:ps/task:{}/device:CPU:0".format(position % num_ps)

  return choose


def check_strategy(variable_strategy: str, num_ps: int,
                   replicated: Optional[str]):
  """'replicated' keeps variables on the towers, which a ps cluster cannot."""
  if num_ps and variable_strategy == replicated:
    raise ValueError(
        "variable_strategy='replicated' keeps a copy of every variable on "
        "each tower, but this RunConfig's cluster has {} ps task(s), where "
        "the variables live in multi-worker training. Use "
        "variable_strategy='parameter_server' (the default) with ps tasks."
        .format(num_ps))

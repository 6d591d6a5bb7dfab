"""`replicate.start_server`: this task's server for a synchronous cluster
(and a ps task's, which serves until it is stopped).

On why: TensorFlow's collectives across processes need every task's server
to name the group leader (`experimental.collective_group_leader`, the
chief) in the server's own configuration; in the session's, or unset,
every task waits forever for a group that never forms. The Estimator
starts a task's server with only the session config's `gpu_options` and no
leader (and, on a CPU-only machine, none of its virtual CPU devices), so a
synchronous cluster cannot use it. `start_server` starts the server with
the run config's session settings and the leader, and marks `TF_CONFIG`
(`"environment": "google"`) so that the Estimator does not start a second
one. The server is kept here for the life of the process: a
`tf.distribute.Server` stops when collected.
"""

import json
import os
import socket
import time
from typing import Dict, NoReturn, Optional, Tuple

import tensorflow as tf

from replicate.cluster import sync_cluster

# (job, index) -> the server this process started for that task.
_servers: Dict[Tuple[str, int], tf.distribute.Server] = {}


def start_server(run_config) -> Optional[tf.distribute.Server]:
  """Starts this task's `tf.distribute.Server` for synchronous training.

  Call it once per process, before `tf.estimator.train_and_evaluate`, with
  the `RunConfig` the Estimator gets: every task of a `TF_CONFIG` cluster of
  `chief` and `worker` tasks then trains in lockstep with
  `replicate_model_fn(..., variable_strategy="replicated")`; with `ps`
  tasks too, what the `model_fn` partitions lives on them
  (`replicate.cluster.hybrid`).

  Args:
    run_config: the Estimator's `tf.estimator.RunConfig`. Its
      `session_config` is the server's too (`device_count` gives a CPU-only
      task its virtual CPU devices, one tower each).

  On a `ps` task it starts the task's server and serves until the process
  is stopped (`serve`): it does not return, so the rest of the program,
  which would train (`estimator.train` refuses to run on a ps task), never
  runs there, whichever way it ends.

  Returns:
    The running server, or None for a process with nothing to serve: no
    cluster (`TF_CONFIG` unset), or an `evaluator` task, which evaluates
    checkpoints in a local session.

  Raises:
    ValueError: `run_config` is not a `RunConfig`, or its task is not one
      of the cluster's training tasks.
    RuntimeError: on a worker, the chief's server did not take connections
      within `REPLICATE_SYNC_TIMEOUT_SECS` (default 120 s), which also
      bounds how long any task waits for the others later.
  """
  if not isinstance(run_config, tf.estimator.RunConfig):
    raise ValueError(
        "start_server takes the Estimator's tf.estimator.RunConfig. "
        "Received: {!r}.".format(run_config))
  spec = run_config.cluster_spec
  if not spec or not spec.jobs or run_config.task_type == "evaluator":
    return None
  if run_config.task_type == "ps":
    serve(run_config)  # does not return
  tasks = sync_cluster.training_tasks(spec)
  task = (run_config.task_type, run_config.task_id)
  if task not in tasks:
    raise ValueError(
        "start_server: this RunConfig's task {}:{} is not a training task "
        "of its cluster ({}). Set TF_CONFIG's task to one of them.".format(
            task[0], task[1], ", ".join("{}:{}".format(*t) for t in tasks)))
  if task in _servers:
    return _servers[task]
  _filter_sessions(run_config, task)
  config = tf.compat.v1.ConfigProto()
  if run_config.session_config is not None:
    config.CopyFrom(run_config.session_config)
  del config.device_filters[:]  # the server serves every task's sessions
  config.experimental.collective_group_leader = (
      "/job:{}/replica:0/task:{}".format(*tasks[0]))
  server = tf.distribute.Server(
      spec, job_name=task[0], task_index=task[1], config=config,
      protocol=run_config.protocol or "grpc", start=True)
  _servers[task] = server
  _mark_started()
  if task != tasks[0]:
    _wait_for_leader(spec.task_address(*tasks[0]), tasks[0])
  tf.compat.v1.logging.info(
      "replicate: started the server of %s:%d for synchronous training "
      "(%d tasks, leader %s:%d, timeout %g s).", task[0], task[1],
      len(tasks), tasks[0][0], tasks[0][1], sync_cluster.timeout_seconds())
  return server


def serve(run_config) -> NoReturn:
  """A ps task's server, serving until the process is stopped.

  A ps task takes no part in the collectives; its variables are the
  training tasks' to create, initialise and update. It ends when it is
  stopped: by `python -m replicate.launch` once the chief is done, on a
  real cluster by the cluster manager (a Kubernetes TFJob's success policy
  counts the chief, or the workers, never the ps tasks).
  """
  spec = run_config.cluster_spec
  config = tf.compat.v1.ConfigProto()
  if run_config.session_config is not None:
    config.CopyFrom(run_config.session_config)
  del config.device_filters[:]  # it serves every training task
  server = tf.distribute.Server(
      spec, job_name="ps", task_index=run_config.task_id, config=config,
      protocol=run_config.protocol or "grpc", start=True)
  tf.compat.v1.logging.info(
      "replicate: ps:%d serves at %s until it is stopped (the launcher, or "
      "the cluster manager, stops it when the training tasks are done).",
      run_config.task_id, spec.task_address("ps", run_config.task_id))
  server.join()
  # join() returns only if the server is stopped from within, which
  # nothing here does; the program's training must not run on a ps task.
  raise SystemExit(0)


def check_started(config) -> None:
  """Refuses a synchronous cluster's TRAIN when start_server was not called."""
  if (config.task_type, config.task_id) not in _servers:
    raise ValueError(
        "This RunConfig's cluster trains synchronously (chief and worker "
        "tasks with variable_strategy='replicated'), which needs this "
        "task's server started by replicate.start_server(run_config), with "
        "the group leader "
        "TensorFlow's collectives need, before "
        "tf.estimator.train_and_evaluate. Call it once, with the "
        "Estimator's RunConfig.")


def _wait_for_leader(address: str, leader) -> None:
  """Waits (up to the timeout) until the leader's server takes connections.

  A task whose first collective finds no leader retries, logging six
  error lines a second; once the leader's port is open it meets the group
  at once.
  """
  host, port = address.rsplit(":", 1)
  timeout = sync_cluster.timeout_seconds()
  deadline = time.monotonic() + timeout
  while True:
    try:
      socket.create_connection((host, int(port)), timeout=1.0).close()
      return
    except OSError:
      if time.monotonic() > deadline:
        raise RuntimeError(
            "replicate.start_server: the group leader {}:{} ({}) did not "
            "start its server within {:g} s (REPLICATE_SYNC_TIMEOUT_SECS). "
            "Start every task of the cluster, the chief first or at the "
            "same time.".format(leader[0], leader[1], address, timeout))
      time.sleep(0.25)


def _filter_sessions(run_config, task) -> None:
  """Limits the Estimator's sessions to this task's devices, in place.

  Unfiltered, a session made again after a failure waits for every task's
  reply, the dead one's too. The session config is the one object the
  Estimator was (or will be) given with this RunConfig.
  """
  own = "/job:{}/task:{}".format(*task)
  shared = ["/job:ps"] if "ps" in run_config.cluster_spec.jobs else []
  session_config = run_config.session_config
  if session_config is None:
    tf.compat.v1.logging.warning(
        "replicate.start_server: the RunConfig has no session_config, so "
        "the Estimator's sessions are not limited to this task (%s): after "
        "a task fails, the others may wait for the watchdog rather than "
        "fail at once. Pass tf.estimator.RunConfig(session_config="
        "tf.compat.v1.ConfigProto()) to both.", own)
  elif not session_config.device_filters:
    session_config.device_filters.extend([own] + shared)


def _mark_started() -> None:
  """Tells the Estimator its server runs already (`environment: google`)."""
  tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
  tf_config["environment"] = "google"
  os.environ["TF_CONFIG"] = json.dumps(tf_config)

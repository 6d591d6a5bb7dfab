"""A synchronous cluster's sessions: one start, equal copies, fail fast.

On the start: the chief initialises its variables or restores its last
checkpoint, as one machine does; nobody initialises another task's, since
every task keeps its own. So every task's TRAIN spec gets a Scaffold whose
`ready_for_local_init_op`, the first thing a session runs once the
variables are restored or initialised (on a worker, at once), does the
start of the cluster, in order:
1. the guard: a second run in this process is an error (below);
2. on a worker, its own variables' initialisers;
3. the check of the model: an all-gather of each task's fingerprint (its
   saved variables' names, shapes and dtypes in creation order, and its
   step's collectives in key order, by type, dtype and shape) on a key
   fixed apart from the model's, so that tasks built differently meet
   there and all raise the same `ValueError`, instead of waiting on keys
   the others do not have;
4. the broadcast of every saved variable (weights, optimizer slots,
   `global_step`, statistics), packed per dtype, from the chief;
then it reports what is left uninitialised (nothing, on a worker), and the
`local_init_op` copies the values to the task's towers. This runs at every
start, so also right after a restore: every copy starts equal.

On failures: a collective that fails (a task died, froze, or went away)
leaves TensorFlow's collectives in this process aborted for good, while a
`MonitoredSession` takes `UnavailableError` and `AbortedError` for a
preemption and makes a new session, which would fail at once, forever.
The guard ends that: the new session raises a `RuntimeError` saying what
happened and what to do (restart every task; the chief's last checkpoint
resumes). Waits no TensorFlow timeout bounds (a step's collectives, which
carry none; a worker asking a dead chief for step ids before its first
step) are ended by `WatchdogHook`.

On the step: its `train_op` also waits for every collective of the step
(`CrossTask.step_ops`), so each runs once a step on every task, whatever
else one task fetches.

On checkpoints and summaries: the Estimator gives the saver and summary
hooks to the chief only. The Saver is the Estimator's default, over the
global variables, which are tower 0's under the unwrapped names: the
towers' copies are local variables and never saved.
"""

import hashlib
import os
import sys
import threading
import time

import numpy as np
import tensorflow as tf

from replicate.cluster import hybrid
from replicate.cluster import sync_cluster
from replicate.communication import collectives

# How many values a task's fingerprint has (see `_fingerprint`).
_FINGERPRINT_SIZE = 4


def for_task(spec: tf.estimator.EstimatorSpec,
             cross: sync_cluster.CrossTask) -> tf.estimator.EstimatorSpec:
  """`spec`, with the start, the checks and the watchdog of the cluster."""
  if spec.mode != tf.estimator.ModeKeys.TRAIN:
    return spec
  scaffold = spec.scaffold
  if scaffold.ready_for_local_init_op is not None:
    raise ValueError(
        "The model_fn's Scaffold has its own ready_for_local_init_op, which "
        "in a synchronous cluster replicate_model_fn uses to start every "
        "task alike (the chief's values broadcast to every task). Leave it "
        "out of the Scaffold.")
  # A ps task's variables are the chief's to initialise or restore, and
  # nobody's to broadcast: every task reads the one copy.
  saved = [v for v in tf.compat.v1.global_variables() if not hybrid.on_ps(v)]
  _check_dtypes(saved)
  shared = hybrid.ps_held(tf.compat.v1.global_variables())
  train_op = spec.train_op
  if shared:
    train_op = hybrid.after_the_ps_update(cross, train_op, shared)
  with tf.name_scope("start_of_cluster"):
    with tf.device(cross.device):
      guard = tf.numpy_function(_Guard(cross.group.name()), [], tf.int64,
                                stateful=True, name="second_start_guard")
    steps = [guard]
    if not cross.group.is_chief:
      with tf.control_dependencies(steps):
        steps = [tf.compat.v1.variables_initializer(saved)]
    with tf.control_dependencies(steps):
      checked = _check_alike(cross, saved)
    with tf.control_dependencies([checked]):
      received = _broadcast(cross, saved)
    with tf.control_dependencies([received]):
      if cross.group.is_chief:
        ready = tf.compat.v1.report_uninitialized_variables(saved)
        ready.mark_used()  # run by the session's start, not fetched here
      else:
        ready = tf.constant([], tf.string)
  scaffold = tf.compat.v1.train.Scaffold(
      ready_for_local_init_op=ready, copy_from_scaffold=scaffold)
  watchdog = WatchdogHook(cross.group.name(), start_seconds(cross.timeout),
                          cross.timeout)
  cross.on_stop.append(watchdog.disarm)  # the end of an input: no failure
  # Every collective of the step runs once a step on every task, also one
  # only a chief's summary would fetch.
  with tf.name_scope("train_op_over_tasks"):
    train_op = tf.group(train_op, *cross.step_ops)
  return spec._replace(scaffold=scaffold, train_op=train_op,
                       training_hooks=list(spec.training_hooks) + [watchdog])


def start_seconds(timeout: float) -> float:
  """How long a session's start may take before the task exits.

  The start waits up to `timeout` at each of its collectives, after the
  chief's restore: twice that, and 10 s for the rest.
  """
  return 2 * timeout + 10


def _check_dtypes(saved):
  refused = [v for v in saved if not collectives.supports(v.dtype)]
  if refused:
    raise ValueError(
        "In a synchronous cluster the chief's variables are broadcast to "
        "every task at the start, which TensorFlow's collectives can do for "
        "float16/32/64 and int32/64 only. These are not: {}. Fix: make them "
        "one of those dtypes, or local variables "
        "(collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES]).".format(
            ", ".join("{!r} ({})".format(v.op.name, v.dtype.base_dtype.name)
                      for v in refused)))


def _fingerprint(saved, step_ops) -> np.ndarray:
  """This task's model in numbers: hash, variables, elements, collectives.

  The hash is of the saved variables' names, shapes and dtypes in creation
  order (the broadcast's and the gradient packs' order) and of the step's
  collectives, in key order, by type, dtype and shape.
  """
  described = ["{}|{}|{}".format(v.op.name, v.shape, v.dtype.name)
               for v in saved]
  described += ["{}|{}|{}".format(op.type, op.inputs[0].dtype.name,
                                  op.inputs[0].shape) for op in step_ops]
  digest = hashlib.sha256("\n".join(described).encode("utf-8")).digest()
  elements = sum(v.shape.num_elements() or 0 for v in saved)
  return np.array([int.from_bytes(digest[:7], "big"), len(saved), elements,
                   len(step_ops)], np.int64)


def _check_alike(cross, saved) -> tf.Operation:
  """An all-gather of every task's fingerprint; raises if any differs."""
  # Every collective of the step is built by now: the model_fn is done.
  mine = tf.constant(_fingerprint(saved, cross.step_ops))
  mine = tf.reshape(mine, [1, _FINGERPRINT_SIZE])
  every_task = cross.gather(mine, sync_cluster.FINGERPRINT_INSTANCE_KEY,
                            timeout=cross.timeout)
  with tf.device(cross.device):
    return tf.numpy_function(_Compare(cross.group), [every_task], tf.int64,
                             stateful=True, name="same_model_on_every_task"
                            ).op


class _Compare:
  """Raises a ValueError naming what differs when tasks' models differ."""

  def __init__(self, group):
    self._group = group

  def __call__(self, every_task):
    chief = every_task[0]
    differ = [rank for rank in range(len(every_task))
              if not np.array_equal(every_task[rank], chief)]
    if differ:
      def describe(rank):
        _, count, elements, keys = every_task[rank]
        return "{}: {} variables, {} values, {} collectives per step".format(
            self._group.name(rank), count, elements, keys)
      raise ValueError(
          "replicate: the tasks of the synchronous cluster built different "
          "models ({}; differing from the chief: {}). Every task must run the "
          "same model_fn with the same params, variables, shapes and "
          "optimizer calls; only its input may differ.".format(
              "; ".join(describe(rank) for rank in range(len(every_task))),
              ", ".join(self._group.name(rank) for rank in differ)))
    return np.int64(0)


def _broadcast(cross, saved) -> tf.Operation:
  """Every saved variable gets the chief's value (packed per dtype)."""
  by_dtype = {}
  for variable in saved:
    by_dtype.setdefault(variable.dtype.base_dtype, []).append(variable)
  assigns = []
  with tf.device(cross.device):
    for variables in by_dtype.values():
      packed = tf.concat([tf.reshape(v.read_value(), [-1])
                          for v in variables], axis=0)
      received = cross.broadcast(packed, timeout=cross.timeout)
      if cross.group.is_chief:
        assigns.append(received.op)
        continue
      pieces = tf.split(received, [v.shape.num_elements() for v in variables])
      for variable, piece in zip(variables, pieces):
        assigns.append(tf.compat.v1.assign(
            variable, tf.reshape(piece, variable.shape)).op)
  return tf.group(*assigns, name="broadcast_from_chief")


class _Guard:
  """A second start of the cluster in this process is an error."""

  def __init__(self, task: str):
    self._task = task
    self._runs = 0

  def __call__(self):
    self._runs += 1
    if self._runs > 1:
      raise RuntimeError(
          "replicate: task {} lost the synchronous cluster (the error "
          "logged above: a task died, froze or stopped answering), and "
          "TensorFlow's collectives cannot recover within this process. "
          "Every task stops; restart all of them, and training resumes "
          "from the chief's last checkpoint.".format(self._task))
    return np.int64(self._runs)


class WatchdogHook(tf.compat.v1.train.SessionRunHook):
  """Exits the process when a session start or a step does not end in time.

  A step waits for every task at its collectives, which carry no timeout
  of their own (see `replicate.cluster.sync_cluster`): a frozen task would
  hold the others forever. Some waits no TensorFlow timeout ends at all: a
  worker asking a dead chief for step ids before its first step, or a
  `MonitoredSession` making its session again after a failure, which waits
  for every task its session config does not filter out, the dead one
  too. The watchdog is armed from `begin` until the session is made
  (`start_seconds`), and from each step's `before_run` to its `after_run`
  (`step_seconds`); when armed longer, it writes why to stderr and exits
  the process with status 1. A step that fails leaves it armed: the
  session is then made again, or the process ends with the error first.
  """

  def __init__(self, task: str, start_seconds: float, step_seconds: float):
    self._task = task
    self._limits = {"starting its session": start_seconds,
                    "running a step": step_seconds}
    self._armed = None  # (what, when) of the current wait, or None
    self._stopped = threading.Event()

  def begin(self):
    self._armed = ("starting its session", time.monotonic())
    threading.Thread(target=self._watch, daemon=True,
                     name="replicate-watchdog").start()

  def after_create_session(self, session, coord):
    del session, coord
    self._armed = None

  def before_run(self, run_context):
    self._armed = ("running a step", time.monotonic())

  def after_run(self, run_context, run_values):
    self._armed = None

  def end(self, session):
    del session
    self._stopped.set()

  def disarm(self):
    """No limit from now on: the job ends cleanly (an input ended)."""
    self._stopped.set()

  def _watch(self):
    poll = min(1.0, min(self._limits.values()) / 4)
    while not self._stopped.wait(poll):
      armed = self._armed
      if armed is None:
        continue
      what, since = armed
      if time.monotonic() - since > self._limits[what]:
        sys.stderr.write(
            "replicate: task {} has been {} for over {:g} s: a task of the "
            "synchronous cluster is missing, dead or frozen, or a step "
            "failed (REPLICATE_SYNC_TIMEOUT_SECS={:g}). Exiting; restart "
            "every task, and training resumes from the chief's last "
            "checkpoint.\n".format(self._task, what, self._limits[what],
                                   self._limits["running a step"]))
        sys.stderr.flush()
        os._exit(1)

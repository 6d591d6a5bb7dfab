"""The across-workers job's timing: the chief's hook, and its memory.

`Timer` times the global steps after the warm-up and traces the steps
whose bytes the chief counts (`benchmarks.ctr_model.step_bytes`);
`benchmarks.step_trace` traces the job's steps with it too.
"""

import time

import tensorflow as tf

from benchmarks import ctr_model


class Timer(tf.compat.v1.train.SessionRunHook):
  """Times the global steps after the warm-up, from one step's end on."""

  def __init__(self, warmup, traced=None):
    self._warmup = warmup
    self._traced = dict(traced or {})  # local step -> name
    self._op_types = None
    self.bytes = {}  # name -> what crossed tasks in that traced step
    self.stop_after = None  # global steps timed, if the hook stops the run
    self._step = None
    self._local_steps = 0
    self.start = None  # (time, global step) at the end of the warm-up
    self.last = None  # (time, global step) at the end of the last step
    self.collectives = None

  def begin(self):
    self._step = tf.compat.v1.train.get_global_step()
    graph = tf.compat.v1.get_default_graph()
    types = [op.type for op in graph.get_operations()]
    self.collectives = {kind: types.count(kind) for kind in sorted(set(
        types)) if kind.startswith("Collective")}
    if self._traced:
      self._op_types = {op.name: op.type for op in graph.get_operations()}

  def before_run(self, run_context):
    if self._local_steps in self._traced:
      return tf.compat.v1.train.SessionRunArgs(
          self._step, options=tf.compat.v1.RunOptions(
              trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
              output_partition_graphs=True))
    return tf.compat.v1.train.SessionRunArgs(self._step)

  def after_run(self, run_context, run_values):
    now = time.perf_counter()
    if self._local_steps in self._traced:
          self.bytes[self._traced[self._local_steps]] = ctr_model.step_bytes(
          run_values.run_metadata, self._op_types,
          "/job:chief/replica:0/task:0")
    self._local_steps += 1
    # The global step read in the same run as the update: before or after
    # it; either way the same each step, so the differences count steps.
    point = (now, int(run_values.results))
    # Not before the traced steps are done (with ps-async, the other tasks'
    # steps count too).
    if (self.start is None and point[1] >= self._warmup and
        self._local_steps > max(self._traced, default=-1) + 1):
      self.start = point
    self.last = point
    if self.stop_after and self.start and (
        point[1] - self.start[1] >= self.stop_after):
      run_context.request_stop()

  @property
  def local_steps(self):
    return self._local_steps


def resident_mb():
  """This process's peak resident memory (Linux), in MB, or None."""
  try:
    with open("/proc/self/status") as status:
      for line in status:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024.0
  except OSError:
    pass
  return None

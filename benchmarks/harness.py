"""Running one benchmark cell: one model, one configuration, one repeat.

What each configuration trains and reads: `benchmarks.configs`.

On timing: a hook notes when the graph is built (`begin`), then times every
step after the warm-up (from one `after_run` to the next) and asks the
session to stop once `seconds` have been measured, so a cell's length does
not depend on the machine's speed and a run's length can be estimated.
Graph building, session creation and warm-up are left out. Each step's rows
come from the pipeline's layout (`pipelines.rows_per_step`), so a partial
batch counts its own rows.

On the statistic: `examples_per_second` is the rows of the measured steps
over their time after dropping the slowest tenth of the steps
(`TRIMMED_FRACTION`); the plain window (all rows over all the time) is kept
as `window_examples_per_second`, and every run prints the A/A ratio by both.
Other processes on a shared machine only ever make a step slower, so a
spike lands in the dropped tail instead of in the cell; a partial batch's
step is fast, never dropped, so its rows and time both count (a median of
step times would drop it and bias the dynamic path by its share of rows).
Measured on this 2-core machine while other jobs kept its load at 3 to 4.5,
with 5 repeats of 1.2 s cells and two A/A pairs per model (`single`,
`single-static`), the sum over the 8 pairs of the A/A ranges (max - min)
was 2.48 for this trimmed rate, 2.72 for the window, 2.97 for a lower
quartile and 3.48 for a median of step times (each taken per kind of step,
full or partial, so the partial batch kept its weight). None was near 3 %
on a machine that busy, and none won everywhere; the trimmed rate had the
smallest total and the reason above, so it is the one reported.

On noise, measured with the MLP's `single` (the median step of 1.5 s cells,
each its own session, and of the 1.5 s stretches of one 12 s session): one
set of eight cells gave 9.81 to 10.55 ms; half an hour later six cells, one
long session and six cells again, back to back, gave 8.65 to 8.88 ms for the
cells and 8.67 to 8.78 ms for the stretches. The spread between cells comes
and goes with the machine (other tenants of the host: the kernel's steal
time stays near 0), not with sessions, and TensorFlow's BFC allocator on the
CPU did not change it. Trimming drops short spikes and pairing within a
repeat cancels slow drift; what is left shows in the A/A line, so a run made
in a noisy spell says so.

Devices are GPUs where present, else N virtual CPU devices made through the
session config (the only way they reach an Estimator's session).
"""

import functools
import math
import tempfile
import time
from typing import Callable, List, NamedTuple, Optional

import tensorflow as tf

import replicate
from benchmarks import expected
from benchmarks import hand_ring
from benchmarks import pipelines
from benchmarks.configs import Config
from benchmarks.models import MODELS

TRIMMED_FRACTION = 0.1  # of a cell's steps, the slowest, left out
# Seconds a cell takes beyond its measured seconds (building, session,
# warm-up, closing), for a model and N: a + b * N, fitted to --quick cells
# on this 2-core machine while other jobs shared it (so a quiet machine
# should be faster). Only for the estimate a run prints; the progress lines
# scale it by how fast the run actually goes.
_OVERHEAD_SECONDS = {"mlp": (1.0, 0.4), "wide": (0.5, 0.4),
                     "convnet": (1.0, 0.3), "dnn_classifier": (1.0, 0.5),
                     "bn_convnet": (1.5, 0.6), "bn_convnet_plain": (1.5, 0.6)}
# The run around the cells (importing TensorFlow, making the data, the
# table and plots) and a machine slower than the one fitted: a fresh
# clone's --quick run took 6 min 13 s (issue 29) where the cells alone gave
# 5.2 minutes, so every estimate is scaled by that ratio (373 / 311 s).
_WHOLE_RUN = 1.2


class Cell(NamedTuple):
  examples_per_second: float  # trimmed: without the slowest steps
  window_examples_per_second: float  # all measured rows / all their time
  build_seconds: float  # from train() to the built graph
  step_seconds: float  # median
  cpu_per_wall: float  # process CPU seconds per wall second while measured
  steps: int  # measured
  cell_seconds: float  # the whole cell, building and warm-up included


def estimate_seconds(model: str, config: Config, seconds: float) -> float:
  """About how long one cell takes here, its share of the run around it
  included (see _OVERHEAD_SECONDS and _WHOLE_RUN)."""
  fixed, per_tower = _OVERHEAD_SECONDS[model]
  return _WHOLE_RUN * (seconds + fixed + per_tower * config.towers)


def prepare() -> None:
  """Call once, before any Estimator runs in this process.

  Seen with TF 2.15: once an Estimator without a distribution strategy has
  trained in a process, a MirroredStrategy Estimator built afterwards over
  virtual CPU devices fails to place its ops on CPU:1 ("Could not satisfy
  device specification"), unless a MirroredStrategy was constructed before
  the first one. Constructing one here makes the order of cells free.
  """
  if not _gpus():
    tf.distribute.MirroredStrategy(devices=_devices(2))


def failure(error: tf.errors.OpError) -> str:
  """What a failed cell's row says: the first line of TensorFlow's error.

  Graph execution errors open with a heading ("Graph execution error:"),
  may give where the node was defined (an indented stack) and name it
  ("Node: ..."); the cause is the first line that is none of those.
  """
  causes = [line.strip() for line in error.message.splitlines()
            if line.strip() and not line[0].isspace()
            and not line.rstrip().endswith(":")
            and not line.startswith(("Detected at node", "Node:"))]
  return (causes or [type(error).__name__])[0][:160].replace("|", "/")


class Outcome(NamedTuple):
  """A cell, or the cause of its failure; `hidden`: E-level lines dropped."""
  cell: Optional[Cell]
  failure: Optional[str]  # `failure(error)`, what the row says
  hidden: int  # TensorFlow's E-level lines of the expected failure
  as_expected: bool  # the failure `benchmarks.expected` describes


def attempt(model_name: str, config: Config, warmup_steps: int,
            seconds: float) -> Outcome:
  """`run_cell`, or the failure's cause if TensorFlow raised.

  The expected failure's cell runs with stderr captured: failing as
  expected, TensorFlow's E-level lines are dropped from what is written
  back (`benchmarks.expected`); any other outcome writes back all of it.
  """
  if not expected.is_expected(model_name, config):
    try:
      return Outcome(run_cell(model_name, config, warmup_steps, seconds),
                     None, 0, False)
    except tf.errors.OpError as error:
      return Outcome(None, failure(error), 0, False)
  cell = cause = None
  caught = []
  try:
    with expected.captured_stderr() as caught:
      try:
        cell = run_cell(model_name, config, warmup_steps, seconds)
      except tf.errors.OpError as error:
        cause = failure(error)
  finally:
    text, hidden = (caught or [""])[0], 0
    as_expected = expected.failed_as_expected(model_name, config, cause)
    if as_expected:
      text, hidden = expected.error_lines(text)
    expected.write_back(text)
  return Outcome(cell, cause, hidden, as_expected)


def run_cell(model_name: str, config: Config, warmup_steps: int,
             seconds: float) -> Cell:
  """Trains `warmup_steps` steps, then times steps for `seconds`."""
  started = time.perf_counter()
  run = build(model_name, config)
  timer = _Timer(warmup_steps, seconds)
  timer.started = time.perf_counter()
  run.estimator.train(run.input_fn, steps=10**9, hooks=[timer])
  durations = timer.durations
  rows = run.rows(warmup_steps, len(durations))
  wall = sum(durations)
  return Cell(
      examples_per_second=trimmed_rate(rows, durations),
      window_examples_per_second=sum(rows) / wall,
      build_seconds=timer.built - timer.started,
      step_seconds=sorted(durations)[len(durations) // 2],
      cpu_per_wall=(timer.cpu_stopped - timer.cpu_measuring) / wall,
      steps=len(durations),
      cell_seconds=time.perf_counter() - started)


class Run(NamedTuple):
  """What a cell trains: its Estimator, input_fn and rows per step."""
  estimator: tf.estimator.Estimator
  input_fn: Callable
  # rows(first_step, steps): the rows each of those steps takes
  rows: Callable[[int, int], List[int]]


def build(model_name: str, config: Config) -> Run:
  """The Estimator of `config` on `model_name`, in a fresh model_dir."""
  model = MODELS[model_name]
  devices = _devices(config.towers)
  run_config = tf.estimator.RunConfig(
      model_dir=tempfile.mkdtemp(prefix="replicate_bench_"),
      session_config=_session_config(config.towers),
      save_checkpoints_secs=None, save_checkpoints_steps=None,
      save_summary_steps=0, log_step_count_steps=None,
      train_distribute=_mirrored(config, devices))
  batch, batches_per_step = model.global_batch, 1
  if config.kind == "mirrored":
    # The input_fn batch is per replica; each replica takes one a step.
    batch, batches_per_step = batch // config.towers, config.towers
  model_fn = model.make_model_fn(config.kind == "replicate")
  if config.kind == "replicate":
    model_fn = replicate.replicate_model_fn(
        model_fn, devices=devices, **config.replicate_arguments)
    if config.uses_hand_ring:
      model_fn = hand_ring.with_hand_ring(model_fn)
  rows = functools.partial(
      pipelines.rows_per_step, config.pipeline,
      pipelines.dataset_rows(model.global_batch), batch, batches_per_step)
  return Run(tf.estimator.Estimator(model_fn, config=run_config),
             model.make_input_fn(config.pipeline, batch), rows)


def trimmed_rate(rows, durations, fraction=TRIMMED_FRACTION):
  """Rows per second over the steps left after dropping the slowest ones.

  `rows[i]` and `durations[i]` are step i's; `ceil(fraction * steps)` of the
  slowest steps are dropped (at least one once there are 10 steps).
  """
  if len(rows) != len(durations) or not rows:
    raise ValueError("rows and durations must be as long as each other and "
                     "not empty. Received {} and {}.".format(
                         len(rows), len(durations)))
  dropped = math.ceil(fraction * len(rows)) if len(rows) >= 10 else 0
  kept = sorted(zip(durations, rows))[:len(rows) - dropped]
  return sum(r for _, r in kept) / sum(d for d, _ in kept)


class _Timer(tf.estimator.SessionRunHook):
  """Notes the build time, times each step after the warm-up, stops."""

  def __init__(self, warmup_steps, seconds):
    self._warmup_steps = warmup_steps
    self._seconds = seconds
    self._steps = 0
    self._last = None
    self.durations = []
    self.started = self.built = None
    self.measuring = self.cpu_measuring = self.cpu_stopped = None

  def begin(self):
    self.built = time.perf_counter()

  def after_run(self, run_context, run_values):
    del run_values
    self._steps += 1
    now = time.perf_counter()
    if self._steps > self._warmup_steps:
      self.durations.append(now - self._last)
    elif self._steps == self._warmup_steps:
      self.measuring, self.cpu_measuring = now, time.process_time()
    self._last = now
    if self.measuring is not None and now - self.measuring >= self._seconds:
      self.cpu_stopped = time.process_time()
      run_context.request_stop()


def _gpus():
  return [d.name for d in tf.config.list_physical_devices("GPU")]


def _devices(towers):
  gpus = _gpus()
  if gpus:
    if towers > len(gpus):
      raise ValueError("{} towers asked for, but this machine has {} GPUs."
                       .format(towers, len(gpus)))
    return ["/device:GPU:{}".format(i) for i in range(towers)]
  return ["/device:CPU:{}".format(i) for i in range(towers)]


def _session_config(towers):
  if _gpus():
    return None
  return tf.compat.v1.ConfigProto(device_count={"CPU": towers})


def _mirrored(config, devices):
  if config.kind != "mirrored":
    return None
  cross_device_ops = (tf.distribute.ReductionToOneDevice()
                      if config.variant == "r1d" else None)
  return tf.distribute.MirroredStrategy(devices=devices,
                                        cross_device_ops=cross_device_ops)

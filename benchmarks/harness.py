"""Running one benchmark cell: one model, one configuration, one repeat.

On configurations:

| name                    | what trains                                              |
| ----------------------- | -------------------------------------------------------- |
| `single`                | the unwrapped model_fn on one device                     |
| `replicate-N-ps`        | `replicate_model_fn`, N towers, `parameter_server`       |
| `replicate-N-rr`        | `replicate_model_fn`, N towers, `round_robin`            |
| `replicate-N-gather`    | N towers, `replicated`, `all_reduce="gather"`            |
| `replicate-N-ring`      | N towers, `replicated`, `all_reduce="ring"` (collective, |
|                         | TensorFlow's `CollectiveReduceV2`)                       |
| `replicate-N-handring`  | N towers, `replicated`, the ring built from graph ops    |
|                         | that `ring` was before (`allreduce.HAND_RING`, internal) |
| `replicate-N-nccl`      | N towers, `replicated`, `all_reduce="nccl"` (GPUs only)  |
| `mirrored-N-default`    | `MirroredStrategy` over N devices, default cross-device ops |
| `mirrored-N-r1d`        | `MirroredStrategy` with `ReductionToOneDevice`           |

Every configuration trains on the same global batch; under MirroredStrategy
the `input_fn` batch is per replica, so it gets global / N rows.

On timing: a hook notes when the graph is built (`begin`), then the wall and
process CPU clocks after the warm-up steps and after the last step;
examples/sec is measured between the two, so graph building, session
creation and warm-up are left out. Devices are GPUs where present, else N
virtual CPU devices made through the session config (the only way they
reach an Estimator's session).
"""

import re
import tempfile
import time
from typing import NamedTuple

import tensorflow as tf

import replicate
from benchmarks.models import MODELS
from replicate import allreduce

_CONFIG = re.compile(r"^(?:single|replicate-(\d+)-"
                     r"(ps|rr|gather|ring|handring|nccl)|"
                     r"mirrored-(\d+)-(default|r1d))$")
CONFIG_FORMS = ("single, replicate-N-ps, replicate-N-rr, replicate-N-gather, "
                "replicate-N-ring, replicate-N-handring, replicate-N-nccl, "
                "mirrored-N-default, mirrored-N-r1d (N a number of towers)")
# A replicate configuration's variant: its replicate_model_fn arguments.
_REPLICATE_ARGUMENTS = {
    "ps": {"variable_strategy": "parameter_server"},
    "rr": {"variable_strategy": "round_robin"},
    "gather": {"variable_strategy": "replicated", "all_reduce": "gather"},
    "ring": {"variable_strategy": "replicated", "all_reduce": "ring"},
    # Not a public all_reduce value: the internal hook kept for this
    # comparison (see replicate.allreduce).
    "handring": {"variable_strategy": "replicated",
                 "all_reduce": allreduce.HAND_RING},
    "nccl": {"variable_strategy": "replicated", "all_reduce": "nccl"},
}


class Config(NamedTuple):
  name: str
  kind: str  # "single", "replicate" or "mirrored"
  towers: int
  variant: str  # ps/rr/gather/ring/handring/nccl, or default/r1d mirrored


class Cell(NamedTuple):
  examples_per_second: float
  build_seconds: float  # from train() to the built graph
  step_seconds: float
  cpu_per_wall: float  # process CPU seconds per wall second while measured


def parse_config(name: str) -> Config:
  """A configuration from its name; a clear error for anything else."""
  match = _CONFIG.match(name)
  if not match:
    raise ValueError("Unknown configuration {!r}; the forms are: {}.".format(
        name, CONFIG_FORMS))
  if name == "single":
    return Config(name, "single", 1, "")
  replicate_towers, strategy, mirrored_towers, ops = match.groups()
  towers = int(replicate_towers or mirrored_towers)
  if towers < 1:
    raise ValueError("Configuration {!r} asks for {} towers; use 1 or "
                     "more.".format(name, towers))
  if replicate_towers:
    return Config(name, "replicate", towers, strategy)
  return Config(name, "mirrored", towers, ops)


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


def check_model(name: str) -> None:
  if name not in MODELS:
    raise ValueError("Unknown model {!r}; the models are: {}.".format(
        name, ", ".join(MODELS)))


def run_cell(model_name: str, config: Config, warmup_steps: int,
             measured_steps: int) -> Cell:
  """Trains `warmup_steps + measured_steps` steps and times the last ones."""
  model = MODELS[model_name]
  devices = _devices(config.towers)
  run_config = tf.estimator.RunConfig(
      model_dir=tempfile.mkdtemp(prefix="replicate_bench_"),
      session_config=_session_config(config.towers),
      save_checkpoints_secs=None, save_checkpoints_steps=None,
      save_summary_steps=0, log_step_count_steps=None,
      train_distribute=_mirrored(config, devices))
  batch = model.global_batch
  if config.kind == "mirrored":
    batch //= config.towers  # the input_fn batch is per replica
  model_fn = model.make_model_fn(config.kind == "replicate")
  if config.kind == "replicate":
    model_fn = replicate.replicate_model_fn(
        model_fn, devices=devices, **_REPLICATE_ARGUMENTS[config.variant])
  timer = _Timer(warmup_steps)
  estimator = tf.estimator.Estimator(model_fn, config=run_config)
  timer.started = time.perf_counter()
  estimator.train(model.make_input_fn(batch),
                  steps=warmup_steps + measured_steps, hooks=[timer])
  wall = timer.stopped - timer.measuring
  return Cell(
      examples_per_second=measured_steps * model.global_batch / wall,
      build_seconds=timer.built - timer.started,
      step_seconds=wall / measured_steps,
      cpu_per_wall=(timer.cpu_stopped - timer.cpu_measuring) / wall)


class _Timer(tf.estimator.SessionRunHook):
  """Notes the build time and the clocks around the measured steps."""

  def __init__(self, warmup_steps):
    self._warmup_steps = warmup_steps
    self._steps = 0
    self.started = self.built = None
    self.measuring = self.cpu_measuring = None
    self.stopped = self.cpu_stopped = None

  def begin(self):
    self.built = time.perf_counter()

  def after_run(self, run_context, run_values):
    del run_context, run_values
    self._steps += 1
    now, cpu = time.perf_counter(), time.process_time()
    if self._steps == self._warmup_steps:
      self.measuring, self.cpu_measuring = now, cpu
    self.stopped, self.cpu_stopped = now, cpu


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

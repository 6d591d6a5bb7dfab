"""Which devices the towers use and where their variables live.

On device strings: any spelling TensorFlow accepts (`'/gpu:0'`, `'/GPU:0'`,
`'/device:GPU:0'`, `'cpu:1'`, with or without `/job:.../task:...`) is normalised
to TensorFlow's canonical form, so `'/gpu:0'` and `'/GPU:0'` are one device.
A wildcard (`'/cpu:*'`) is refused when wrapping, since each entry is one
tower; a job, replica or task is refused when the wrapped `model_fn` is
called, unless the session it runs in has it (this task's own, in a ps
cluster's training; the local session's otherwise).

On placement: a device function puts every op of a tower on the tower's
device, except the ops that create variables, which go where the
`variable_strategy` says (see `replicate.strategies`).
"""

from typing import Callable, List, Optional, Sequence

import tensorflow as tf
from tensorflow.python.client import device_lib

# Op types that create a variable's storage; these are the ops a variable
# strategy places, everything else follows its tower.
_VARIABLE_OP_TYPES = frozenset(
    ["Variable", "VariableV2", "VarHandleOp", "AutoReloadVariable"])


# Ops that run functions (tf.cond, tf.while_loop, RNNs, tf.function calls).
# They take a captured variable's handle to pass it to their functions; when
# TensorFlow lowers them, their nodes and the functions' reads are colocated
# with that handle, so they can run on the tower only if the variable does.
_CONTROL_FLOW_OP_TYPES = frozenset([
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall"])


def normalize_devices(devices: Optional[Sequence[str]]) -> Optional[List[str]]:
  """Returns `devices` in canonical spelling, or None; raises on bad entries."""
  if devices is None:
    return None
  if isinstance(devices, str) or not hasattr(devices, "__iter__"):
    raise ValueError(
        "devices must be a list of device strings such as ['/gpu:0', "
        "'/gpu:1'], or None for every local device. Received: {!r}.".format(
            devices))
  devices = list(devices)
  if not devices:
    raise ValueError(
        "devices is empty; give at least one device, e.g. ['/gpu:0'], or "
        "None for every local device. Received: [].")
  normalized = []
  for device in devices:
    canonical = _canonical_device(device, devices)
    if canonical in normalized:
      spelled = "" if device == canonical else " (as {!r})".format(canonical)
      raise ValueError(
          "devices contains {!r} twice{}; each device may appear once. "
          "Received: {!r}.".format(device, spelled, devices))
    normalized.append(canonical)
  return normalized


def tower_devices(devices: Optional[List[str]], config) -> List[str]:
  """The towers' devices: `devices` as given, or every local device.

  Under an Estimator (`config` is its RunConfig) a given device that its
  session will not have is an error, not a silent soft placement onto
  another device or a placement error when the session starts: another
  job, replica or task (this session is local), or a device of a kind or
  index it lacks.
  """
  session_config = config.session_config if config is not None else None
  if devices is None:
    return local_devices(session_config)
  if config is not None:
    _check_in_local_session(devices, config)
    available = local_devices(session_config, every_kind=True)
    missing = [d for d in devices if _without_task(d) not in available]
    if missing:
      raise ValueError(
          "devices contains {}, which the Estimator's session does not have "
          "(it has {}). Use devices=None for every local device, or, without "
          "GPUs, make virtual CPU devices with tf.estimator.RunConfig("
          "session_config=tf.compat.v1.ConfigProto(device_count={{'CPU': "
          "N}})).".format(", ".join(repr(d) for d in missing),
                          ", ".join(available)))
  return devices


def local_devices(session_config=None, every_kind=False) -> List[str]:
  """Every local GPU, or with none every local CPU, as the session sees them.

  The devices are counted with the session config the Estimator will use, so
  `ConfigProto(device_count={'CPU': N})` gives N CPU devices.
  """
  found = device_lib.list_local_devices(session_config)
  if every_kind:
    return [d.name for d in found]
  gpus = [d.name for d in found if d.device_type == "GPU"]
  if gpus:
    return gpus
  return [d.name for d in found if d.device_type == "CPU"]


def tower_device_function(tower_device: str,
                          choose_variable_device: Callable[[tf.Operation], str]
                         ) -> Callable[[tf.Operation], str]:
  """Places a tower's ops on `tower_device` and its variables by strategy.

  A device the model_fn sets itself (`with tf.device(...)`) is kept: it is
  merged over the chosen one, as `tf.compat.v1.train.replica_device_setter`
  does. Ops that take a variable's handle are left to the placer, which
  puts them with the variable. Control flow (`If`, `While`, function
  calls) that captures only variables on the tower's own device (replicated
  copies, round-robin variables placed there) runs on the tower; the ops
  inside its functions are placed like the tower's other ops either way.
  """

  def choose(op):
    if op.type in _VARIABLE_OP_TYPES:
      spec = tf.DeviceSpec.from_string(
          choose_variable_device(op) or tower_device)
    elif any(t.dtype == tf.resource for t in op.inputs) and not (
        op.type in _CONTROL_FLOW_OP_TYPES and
        _handles_are_on(op, tower_device)):
      # An op on a variable's handle runs where the variable lives; the
      # placer puts it there. Pinning it to the tower breaks, e.g., a read
      # inside a tf.cond branch, whose handle has no device of its own.
      return op.device
    else:
      spec = tf.DeviceSpec.from_string(tower_device)
    return spec.make_merged_spec(
        tf.DeviceSpec.from_string(op.device or "")).to_string()

  return choose


def _handles_are_on(op, tower_device) -> bool:
  """Whether every variable handle `op` takes lives on `tower_device`.

  A handle from elsewhere (a parameter-server variable, or one captured by
  an outer function, whose device is unknown) would pin the variable's
  reads inside the control flow to the tower: TensorFlow refuses that
  ("Cannot colocate nodes"), so such an op is left with the variable.
  """
  tower = tf.DeviceSpec.from_string(tower_device)
  for tensor in op.inputs:
    if tensor.dtype != tf.resource:
      continue
    if tensor.op.type not in _VARIABLE_OP_TYPES or not tensor.op.device:
      return False
    if tf.DeviceSpec.from_string(tensor.op.device) != tower:
      return False
  return True


def _canonical_device(device, devices) -> str:
  if not isinstance(device, str):
    raise ValueError(
        "devices must hold device strings such as '/gpu:0'; {!r} is a {}. "
        "Received: {!r}.".format(device, type(device).__name__, devices))
  if "*" in device:
    # TensorFlow parses '/cpu:*' as a CPU with no index, which would
    # silently become the one tower '/device:CPU:0'.
    raise ValueError(
        "devices contains {!r}, a wildcard; replicate_model_fn builds one "
        "tower per device listed, so list each device, e.g. ['/cpu:0', "
        "'/cpu:1'], or pass devices=None for every local GPU (or, with "
        "none, every local CPU). Received: {!r}.".format(device, devices))
  try:
    spec = tf.DeviceSpec.from_string(device)
  except ValueError as error:
    raise ValueError(
        "devices contains {!r}, which TensorFlow cannot parse as a device "
        "({}). Use a form like '/gpu:0' or '/device:CPU:1'. Received: "
        "{!r}.".format(device, error, devices)) from None
  if spec.device_type is None:
    raise ValueError(
        "devices contains {!r}, which names no device type; use a form like "
        "'/gpu:0' or '/device:CPU:1'. Received: {!r}.".format(device, devices))
  if spec.device_index is None:
    spec = spec.replace(device_index=0)
  return spec.to_string()


def _check_in_local_session(devices: Sequence[str], config) -> None:
  """Refuses a job, replica or task other than the local session's own.

  Outside a ps cluster's training (see `replicate.cluster`) the Estimator
  runs a local session: evaluation and prediction always, training when
  the RunConfig has no ps tasks. Its only devices are
  '/job:localhost/replica:0/task:0/...'.
  """
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    names = [
        "job {!r}".format(spec.job) if spec.job not in (None, "localhost")
        else None,
        "replica {}".format(spec.replica) if spec.replica not in (None, 0)
        else None,
        "task {}".format(spec.task) if spec.task not in (None, 0) else None,
    ]
    names = [name for name in names if name]
    if not names:
      continue
    if getattr(config, "cluster_spec", None) and config.cluster_spec.jobs:
      why = ("evaluation, prediction and training without ps tasks run in "
             "a local session")
    else:
      why = ("this RunConfig has no cluster (no TF_CONFIG), so the session "
             "is local")
    raise ValueError(
        "devices contains {!r}, which names {}; but {}, whose devices are "
        "'/job:localhost/replica:0/task:0/...' only. Name devices without a "
        "job, replica or task, e.g. '/cpu:0' or '/gpu:1': in a cluster with "
        "ps tasks each training task places them on its own task.".format(
            device, " and ".join(names), why))


def _without_task(device: str) -> str:
  spec = tf.DeviceSpec.from_string(device)
  return tf.DeviceSpec(device_type=spec.device_type,
                       device_index=spec.device_index).to_string()


def cpu_of(device: str) -> str:
  """The first CPU of the task that holds `device` (the parameter device)."""
  spec = tf.DeviceSpec.from_string(device)
  return spec.replace(device_type="CPU", device_index=0).to_string()

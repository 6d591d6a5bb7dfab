"""Which devices the towers use and where their variables live.

On device strings: any spelling TensorFlow accepts (`'/gpu:0'`, `'/GPU:0'`,
`'/device:GPU:0'`, `'cpu:1'`, with or without `/job:.../task:...`) is normalised
to TensorFlow's canonical form, so `'/gpu:0'` and `'/GPU:0'` are one device.
A wildcard (`'/cpu:*'`) is refused when wrapping, since each entry is one
tower; a job, replica or task is refused when the wrapped `model_fn` is
called, unless the session it runs in has it (this task's own, in a ps
cluster's training; the local session's otherwise).

On placement: a device function puts every op of a tower on the tower's
device, control flow included, except the ops that create variables, which
go where the `variable_strategy` says (see `replicate.variables.strategies`), and
the ops on a variable's handle (reads, writes), which go with it.
"""

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from replicate import _tf
from replicate.call import colocation
from replicate.graph import op_types

# Op types that create a variable's storage; these are the ops a variable
# strategy places, everything else follows its tower.
_VARIABLE_OP_TYPES = frozenset(
    ["Variable", "VariableV2", "VarHandleOp", "AutoReloadVariable"])



# Ops that pass a handle on unchanged (identities, v1 control flow): the
# resource a handle is of is found through them.
_HANDLE_PASSING_OP_TYPES = frozenset([
    "Identity", "Enter", "RefEnter", "Switch", "RefSwitch"])


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
  found = _tf.list_local_devices(session_config)
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
  does. An op on a handle (a variable's read or write, a v1 loop's `Enter`
  of it) runs where the resource lives, found through the captures of the
  functions it is built in; where that is unknown it is left to the
  placer, which puts it with the resource. Control flow (`If`, `While`,
  function calls) runs on the tower, wherever the variables it captures
  live.

  On control flow: TensorFlow lowers an `If` or `While` into the graph and
  gives the nodes of its functions that have no device the device of the
  `If` or `While`. A variable's read has none (see `_pin_reads`): lowered
  on a tower away from its variable, it is pulled back to the variable by
  the placer, but a node colocated with it (the `Switch` of a nested `cond`
  on the read's value, as in `tf.math.zero_fraction` under a `cond`) keeps
  the tower's device, and TensorFlow refuses the pair ("Cannot colocate
  nodes"). So reads inside functions are pinned to their variable.

  On v1 control flow (TF 1 behaviour): `Switch`, `Merge`, `Enter`, `Exit`,
  `NextIteration` and `LoopCond` go to the tower like any op. TensorFlow
  builds some under `colocate_with`, which hides them from device
  functions: the `Switch` of a tensor a `cond` captures, the `Enter` of a
  handle a read brings into a loop, the stacks and `Enter`s of gradient
  accumulators. They keep the device of what they are colocated with (or
  none, and the placer puts them with it), as TensorFlow means them to.
  """

  def choose(op):
    _pin_reads(op)
    colocation.own_group(op)
    if op.type in _VARIABLE_OP_TYPES:
      spec = tf.DeviceSpec.from_string(
          choose_variable_device(op) or tower_device)
    elif op.type in op_types.FUNCTION_CALL_TYPES:
      # They take the handles of the variables their functions capture only
      # to pass them on: they run on the tower wherever the variables live.
      spec = tf.DeviceSpec.from_string(tower_device)
    elif any(t.dtype == tf.resource for t in op.inputs):
      device = _resource_device(op)
      if device is None:
        return op.device  # left to the placer: with the resource
      spec = tf.DeviceSpec.from_string(device)
    else:
      spec = tf.DeviceSpec.from_string(tower_device)
    return spec.make_merged_spec(
        tf.DeviceSpec.from_string(op.device or "")).to_string()

  return choose


def _pin_reads(op) -> None:
  """Inside a function, puts the handle ops `op` uses on their resource.

  A variable's read is built under `colocate_with(None)`, which hides it
  from device functions, so it has no device of its own. It is given its
  variable's device when the first op that uses it is placed, before its
  function is finished. Outside functions nothing lowers them to the
  tower; the placer puts them with their variable.
  """
  if not hasattr(op.graph, "captures"):
    return
  for tensor in op.inputs:
    source = tensor.op
    if source.device or not any(t.dtype == tf.resource
                                for t in source.inputs):
      continue
    device = _resource_device(source)
    if device is not None:
      # The one way to place an op its device functions never saw.
      _tf.set_device(source, device)


def _resource_device(op) -> Optional[str]:
  """Where the resources whose handles `op` takes live, if known and one.

  None when a resource has no device (a TensorArray made under
  `device(None)`), its handle comes from a function's argument or loop
  variable, or `op` takes handles of resources on several devices.
  """
  found = {_handle_device(t) for t in op.inputs if t.dtype == tf.resource}
  return found.pop() if len(found) == 1 else None


def _handle_device(tensor) -> Optional[str]:
  """The device of the op that made the handle `tensor`, through captures."""
  while True:
    source = tensor.op
    if source.type in _HANDLE_PASSING_OP_TYPES:
      tensor = source.inputs[0]
    elif source.type == "Placeholder" and hasattr(source.graph, "captures"):
      # A function's input: the tensor it captured from the graph around.
      outer = [external for external, internal in source.graph.captures
               if internal is tensor]
      if not outer:
        return None  # an argument or a loop variable, not a capture
      tensor = outer[0]
    else:
      return source.device or None


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

  Outside a ps cluster's training (see `replicate.cluster.ps_cluster`) the Estimator
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

"""Colocation groups in the towers: as the unwrapped graph's, on one device.

On groups: TensorFlow colocates ops by group names (`_class`,
`loc:@<op name>`), which the placer resolves over the whole graph, lowered
functions included. One device never splits a group; towers on several
devices must not either, or TensorFlow refuses the graph at its first
session without soft placement ("Cannot colocate nodes"), which the
Estimator reports as a checkpoint that does not match the graph. The tower
device function (`replicate.call.devices`) gives each op built in a
function a group of its function (`own_group`), and once the towers are
built each group they split goes where its variable lives
(`place_colocated`), or is refused, naming the wrapper, at the build.
"""

import tensorflow as tf

from replicate import _tf
from replicate.graph import op_types


def place_colocated(graph, ops) -> None:
  """Puts each colocation group of the towers' `ops` on one device.

  A group the towers split over two devices, e.g. under TF 1 behaviour a
  tower's `tf.gather` of a variable's value (on the tower) whose gradient
  `tf.gradients` colocates with both the gather and the value (on the
  variable's device), goes where its variable lives, as one device has it
  (and as TensorFlow's soft placement would put it); with no variable in
  it, where the op it is named after is. A split that neither settles
  (variables, or named ops, on several devices) is refused, naming
  replicate: the placer would refuse it at the first session ("Cannot
  colocate nodes"), which the Estimator reports as a checkpoint that does
  not match the graph.
  """
  groups = {}  # group name -> its ops among `ops`, and the op so named
  for op in ops:
    if not _tf.built_colocated(op):
      continue
    try:
      names = op.get_attr("_class")
    except ValueError:
      continue  # not colocated after all
    for name in names:
      groups.setdefault(name.decode()[len("loc:@"):], []).append(op)
  for members, named in _joined(graph, groups):
    devices = [op for op in members if op.device]
    if _all_compatible(devices):
      continue
    settling = [op for op in devices if op.type in op_types.VARIABLE_TYPES] or [
        op for op in named if op.device]
    if not settling or not _all_compatible(settling):
      _refuse(devices)
    target = settling[0].device
    for op in devices:
      if not _compatible(tf.DeviceSpec.from_string(op.device),
                         tf.DeviceSpec.from_string(target)):
        _tf.set_device(op, target)




def _joined(graph, groups):
  """The ops of groups that share an op, joined (with the ops the groups
  are named after), each once: (the ops, those the groups are named
  after)."""
  parent = {}

  def root(name):
    while parent.setdefault(name, name) != name:
      name = parent[name]
    return name

  for op in {op for members in groups.values() for op in members}:
    names = [n.decode()[len("loc:@"):] for n in op.get_attr("_class")]
    for name in names[1:]:
      parent[root(name)] = root(names[0])
  joined, named = {}, {}
  for name, members in groups.items():
    joined.setdefault(root(name), set()).update(members)
    try:
      op = graph.get_operation_by_name(name)
    except KeyError:
      continue  # a group named after no op of the graph
    joined[root(name)].add(op)
    named.setdefault(root(name), []).append(op)
  return [(sorted(members, key=lambda op: op.name),
           sorted(named.get(key, []), key=lambda op: op.name))
          for key, members in joined.items()]


def _all_compatible(ops) -> bool:
  merged = tf.DeviceSpec()
  for op in ops:
    spec = tf.DeviceSpec.from_string(op.device)
    if not _compatible(merged, spec):
      return False
    merged = merged.make_merged_spec(spec)
  return True


def _refuse(ops):
  raise ValueError(
      "replicate_model_fn built ops colocated with each other on several "
      "devices: {}. TensorFlow refuses the graph at its first session "
      "unless soft placement is allowed; the unwrapped model_fn, on one "
      "device, never meets this: it is replicate's placement, please report "
      "it. Meanwhile: tf.estimator.RunConfig(session_config="
      "tf.compat.v1.ConfigProto(allow_soft_placement=True)).".format(
          ", ".join("{!r} on {!r}".format(op.name, op.device)
                    for op in ops[:4]) + (", ..." if len(ops) > 4 else "")))


_FIELDS = ("job", "replica", "task", "device_type", "device_index")


def _compatible(one: tf.DeviceSpec, other: tf.DeviceSpec) -> bool:
  """Whether the placer can merge the two: no field set to two values."""
  return all(getattr(one, field) is None or getattr(other, field) is None or
             getattr(one, field) == getattr(other, field)
             for field in _FIELDS)


def own_group(op) -> None:
  """Inside a function, names `op`'s colocation group after its function.

  TensorFlow builds a gradient op of a function's op (the `Shape` of a
  `GatherV2`'s gradient, in a `cond`'s gradient function) colocated with
  it by name, and the name is the function's own (`GatherV2_1`): once the
  functions are lowered into the graph the group is found by that name
  alone, so every tower's such ops, and a node of the graph named so, fall
  in one group, on several devices, which TensorFlow refuses without soft
  placement ("Cannot colocate nodes"). On one device the group is
  harmless. A group named after the function (unique in the graph) keeps
  the colocation TensorFlow meant, within the tower.
  """
  if hasattr(op.graph, "captures"):
    _tf.set_colocation_group(op, op.graph.name + "/" + op.name)

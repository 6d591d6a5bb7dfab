"""Colocation groups in the towers: as the unwrapped graph's, on one device.

On groups: TensorFlow colocates ops by group names (`_class`,
`loc:@<op name>`), which the placer resolves over the whole graph, lowered
functions included. One device never splits a group; towers on several
devices must not either, or TensorFlow refuses the graph at its first
session without soft placement ("Cannot colocate nodes"), which the
Estimator reports as a checkpoint that does not match the graph. The tower
device function (`replicate.call.devices`) gives each op built in a
function a group of its function (`own_group`), and the towers' ops are
checked once built (`check_colocations`), so that a split the wrapper
makes is said by the wrapper, at the build.
"""

import tensorflow as tf

from replicate import _tf


def check_colocations(graph, ops) -> None:
  """Refuses a colocation group that the towers' `ops` ask on two devices.

  TensorFlow's placer refuses such a group at the first session, without
  soft placement ("Cannot colocate nodes"), and the Estimator then reports
  a checkpoint that does not match the graph. One device never meets it:
  a group of two devices is the towers' doing, said here, at the build.
  """
  asking = {}  # group -> the ops in it that ask for a device
  for op in ops:
    if not _tf.built_colocated(op):
      continue
    try:
      groups = op.get_attr("_class")
    except ValueError:
      continue  # not colocated
    for group in groups:
      members = asking.setdefault(group.decode()[len("loc:@"):], [])
      if op.device:
        members.append(op)
  for name, members in asking.items():
    try:
      members.append(graph.get_operation_by_name(name))
    except KeyError:
      pass  # a group named after no op of the graph
    merged, first = tf.DeviceSpec(), None
    for op in members:
      spec = tf.DeviceSpec.from_string(op.device)
      if first is not None and not _compatible(merged, spec):
        raise ValueError(
            "replicate_model_fn built ops colocated with {!r} on two "
            "devices: {!r} on {!r} and {!r} on {!r}. TensorFlow refuses the "
            "graph at its first session unless soft placement is allowed; "
            "the unwrapped model_fn, on one device, never meets this: it is "
            "replicate's placement, please report it. Meanwhile: "
            "tf.estimator.RunConfig(session_config=tf.compat.v1.ConfigProto("
            "allow_soft_placement=True)).".format(
                name, first.name, first.device, op.name, op.device))
      merged = merged.make_merged_spec(spec)
      first = first or (op if op.device else None)


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

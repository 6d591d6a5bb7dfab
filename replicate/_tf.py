"""TensorFlow internals replicate reads, kept in one place.

Each is pinned by `tests/test_tf_internals.py` to its TensorFlow 2.15
behaviour.
"""

from typing import Optional, Set

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

# Attributes of the call ops that name the functions they run.
_FUNCTION_ATTRS = ("f", "then_branch", "else_branch", "cond", "body",
                   "branches")


def is_stateful(op: tf.Operation) -> bool:
  """Whether TensorFlow registers `op`'s type as stateful."""
  return op.op_def.is_stateful


def called_functions(op: tf.Operation) -> Optional[Set[str]]:
  """The op types of every function `op` calls, nested calls included.

  None when `op` calls no function (it is no `PartitionedCall`, `If`,
  `While`, `Case`, ...). Only the stateful types are returned.
  """
  names = _function_names(op.node_def.attr)
  if not names:
    return None
  found = set()
  seen = set()
  while names:
    name = names.pop()
    if name in seen:
      continue
    seen.add(name)
    function = op.graph._get_function(name)  # pylint: disable=protected-access
    if function is None:
      found.add("<unknown function {}>".format(name))
      continue
    for node in function.definition.node_def:
      op_def = op_def_registry.get(node.op)
      if op_def is not None and op_def.is_stateful:
        found.add(node.op)
      names.extend(_function_names(node.attr))
  return found


def _function_names(attrs):
  names = []
  for key in _FUNCTION_ATTRS:
    if key not in attrs:
      continue
    value = attrs[key]
    if value.HasField("func"):
      names.append(value.func.name)
    names.extend(f.name for f in value.list.func)
  return names

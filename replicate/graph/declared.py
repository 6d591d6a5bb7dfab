"""`replicate.rows_apart`: ops the user declares keep the batch's rows apart.

On why: the rows rule (`replicate.shard.rows_meet`) fails closed: an op on
the path from the rows whose type it does not know (a custom op, a
`py_func` applied row by row) is refused, because it might combine rows.
A user who knows it does not can say so, and the rule then trusts it;
`replicate.check` verifies the declaration on the user's own batches
(each tower's output must be one device's rows for that tower).

On where declarations live: an op type (`rows_apart("MyOp")`) is declared
for the process, before the `model_fn` is built, as TensorFlow registers
gradients and shape functions by type: the one mutable module global of
this module (docs/DESIGN.md lists it). A tensor (`rows_apart(tensor)`,
inside the `model_fn`) declares the op that made it, in that op's graph's
collection `COLLECTION` (by name), which lives as long as the graph, as
the user's own collections do; the wrapper and the check read it there.
"""

from typing import Union

import tensorflow as tf

COLLECTION = "replicate.rows_apart"

# The op types declared for the process (see "On where declarations live").
_DECLARED_TYPES = set()


def rows_apart(op_type_or_tensor: Union[str, tf.Tensor, tf.Operation]) -> None:
  """Declares that an op keeps the batch's rows apart: row i of its outputs
  depends only on row i of its inputs that hold rows.

  Args:
    op_type_or_tensor: an op type (`"MyCustomOp"`, `"PyFunc"`): every op of
      that type, in every graph built after; or a tensor (or op) made inside
      the `model_fn`: the op that made it, in that graph only.

  The rows rule then lets the op stand between the rows and the loss, a
  metric or a prediction. `replicate.check(model_fn, input_fn)` verifies
  the declaration on your batches. Outside `replicate_model_fn` it changes
  nothing.

  ```python
  scores = tf.compat.v1.py_func(score_rows, [x], tf.float32)
  replicate.rows_apart(scores)   # score_rows treats each row alone
  ```
  """
  if isinstance(op_type_or_tensor, str):
    if not op_type_or_tensor:
      raise ValueError(
          "replicate.rows_apart('') names no op type. Fix: pass an op type, "
          "e.g. rows_apart('PyFunc'), or the tensor the op made.")
    _DECLARED_TYPES.add(op_type_or_tensor)
    return
  op = getattr(op_type_or_tensor, "op", op_type_or_tensor)
  if not isinstance(op, tf.Operation):
    raise ValueError(
        "replicate.rows_apart({!r}): expected an op type (a str) or a graph "
        "tensor made in the model_fn, got a {}. Fix: pass the tensor the op "
        "made, inside the model_fn (graph mode), or its op type.".format(
            op_type_or_tensor, type(op_type_or_tensor).__name__))
  names = op.graph.get_collection_ref(COLLECTION)
  if op.name not in names:
    names.append(op.name)


def is_declared(op: tf.Operation) -> bool:
  """Whether `op` (its type, or the op itself) was declared by
  `rows_apart`. A tower's copy `tower_i/name` of a declared tower-0 op is
  declared too (each tower's `model_fn` call declares its own)."""
  if op.type in _DECLARED_TYPES:
    return True
  return op.name in op.graph.get_collection(COLLECTION)


def forget_type(op_type: str) -> None:
  """Takes back a declared op type (for tests and `replicate.check`'s
  verification runs)."""
  _DECLARED_TYPES.discard(op_type)

"""Walking a graph backwards from tensors, to see what they are made from."""

from typing import Iterable, Iterator

import tensorflow as tf


def ops_behind(tensors: Iterable[tf.Tensor],
               stop_at_types: frozenset = frozenset()) -> Iterator[
                   tf.Operation]:
  """Yields, once each, the ops `tensors` are computed from (theirs too).

  Follows data inputs only; does not walk past an op whose type is in
  `stop_at_types` (it is still yielded).
  """
  pending = [t.op for t in tensors]
  seen = set()
  while pending:
    op = pending.pop()
    if op in seen:
      continue
    seen.add(op)
    yield op
    if op.type not in stop_at_types:
      pending.extend(t.op for t in op.inputs)

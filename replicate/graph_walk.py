"""Walking a graph backwards from tensors, to see what they are made from."""

from typing import Container, Iterable, Iterator, Optional, Union

import tensorflow as tf


def ops_behind(starts: Iterable[Union[tf.Tensor, tf.Operation]],
               stop_at_types: Container[str] = frozenset(),
               within: Optional[Container[tf.Operation]] = None,
               follow_control: bool = False) -> Iterator[tf.Operation]:
  """Yields, once each, the ops `starts` are computed from (theirs too).

  Follows data inputs, and control inputs too if `follow_control`; does not
  walk past an op whose type is in `stop_at_types` (it is still yielded),
  nor to an op outside `within`, when given.
  """
  pending = [getattr(start, "op", start) for start in starts]
  seen = set()
  while pending:
    op = pending.pop()
    if op in seen or (within is not None and op not in within):
      continue
    seen.add(op)
    yield op
    if op.type in stop_at_types:
      continue
    pending.extend(t.op for t in op.inputs)
    if follow_control:
      pending.extend(op.control_inputs)

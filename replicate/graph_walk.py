"""Walking a graph: backwards from tensors, to see what they are made from;
forwards from ops, to see what is computed from them."""

from typing import (Callable, Container, Iterable, Iterator, Optional, Set,
                    Union)

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


def ops_after(starts: Iterable[Union[tf.Tensor, tf.Operation]],
              include_starts: bool = True,
              stop: Optional[Callable[[tf.Operation], bool]] = None
              ) -> Set[tf.Operation]:
  """Every op computed from `starts` (data edges): their consumers, theirs,
  and so on; the starts' own ops too if `include_starts`; not through a
  consumer for which `stop` is true (nor that consumer)."""
  pending = [getattr(start, "op", start) for start in starts]
  found = set(pending) if include_starts else set()
  while pending:
    op = pending.pop()
    for output in op.outputs:
      for consumer in output.consumers():
        if consumer not in found and not (stop and stop(consumer)):
          found.add(consumer)
          pending.append(consumer)
  return found

"""What the build asks of a variable strategy: the `VariableStrategy`
Protocol every strategy object has (`replicate.variables.strategies` makes
them).
"""

from typing import Any, List, Optional, Protocol, Sequence, Tuple
from typing import runtime_checkable

import tensorflow as tf

# A tower's (gradient, variable) pairs, gradients Tensors, IndexedSlices or
# None.
GradsAndVars = List[Tuple[Any, tf.Variable]]


@runtime_checkable
class VariableStrategy(Protocol):
  """What the build asks a strategy object; every strategy has these.

  Read by: `replicate.model_fn` (`variable_device`, for each tower's
  device function; `copies_variables`, for the towers' variables),
  `replicate.call.layout` (`copies_variables`) and
  `replicate.gradients.optimizer_calls` (`combine`, once per optimizer
  call, in the last tower).
  """

  # Whether towers 1..N-1 train their own copies of the trainable variables
  # (True) or tower 0's (False).
  copies_variables: bool
  # In a synchronous cluster, the collectives across tasks
  # (`replicate.cluster.sync_cluster.CrossTask`); else None.
  cross_task: Any

  def variable_device(self, op: tf.Operation) -> Optional[str]:
    """Where the variable `op` creates lives; None: with the tower building
    it. Called once per variable-creating op, in creation order."""

  def combine(self, per_tower: Sequence[GradsAndVars],
              has_rows: Sequence[Any],
              tower_devices: Sequence[str]) -> GradsAndVars:
    """The (gradient, variable) pairs of the one update, from every tower's.

    `per_tower[i]` is tower i's pairs, the same variables in the same order
    in every tower (its own copies with `copies_variables`); `has_rows[i]`
    says whether tower i counts (a bool or a scalar bool tensor);
    `tower_devices[i]` is where tower i runs.
    """

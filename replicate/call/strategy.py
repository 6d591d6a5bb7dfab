"""What the build asks of a variable strategy: the `VariableStrategy`
Protocol every strategy object has (`replicate.variables.strategies` makes
them), and `CrossTask`, what a synchronous cluster's strategy holds to
combine across tasks (`replicate.cluster.sync_cluster.CrossTask` is one).

What a strategy's mode means (one task or a synchronous cluster's, copies
of the variables or tower 0's) is asked of the strategy object, never
through `cross_task is None`: its methods (`spans_tasks`,
`sum_over_tasks`, `is_first_task`, `builds_towers`, `take_batch`,
`count_rows`, `for_session`, `sum_gradients`) are in
`replicate.variables.strategies`, and `replicate.call.layout` passes the
first three on.
"""

from typing import Any, List, Optional, Protocol, Sequence, Tuple
from typing import runtime_checkable

import tensorflow as tf

# A tower's (gradient, variable) pairs, gradients Tensors, IndexedSlices or
# None.
GradsAndVars = List[Tuple[Any, tf.Variable]]


class TaskGroup(Protocol):
  """The training tasks of a synchronous cluster, and this one's place."""

  @property
  def is_chief(self) -> bool:
    """Whether this task is the first of the group (rank 0)."""

  @property
  def size(self) -> int:
    """How many training tasks there are."""


class CrossTask(Protocol):
  """The collectives across a synchronous cluster's tasks, each on this
  task's first CPU; what every task's step runs the same, in order."""

  group: TaskGroup
  # The check that every task's input goes on, which the step's state
  # changes wait for (`replicate.cluster.sync_input`); None before it.
  after_check: Optional[tf.Operation]

  def sum(self, tensor: tf.Tensor, name: str = "sum_over_tasks",
          timeout: float = 0) -> tf.Tensor:
    """`tensor` summed over every task."""

  def sum_all(self, tensors: Sequence[tf.Tensor],
              name: str = "sum_over_tasks") -> List[tf.Tensor]:
    """Each of `tensors` summed over every task, in one collective."""

  def gather(self, tensor: tf.Tensor, instance_key: Optional[int] = None,
             timeout: float = 0) -> tf.Tensor:
    """Every task's `tensor`, concatenated along dimension 0 in rank order."""


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
  # In a synchronous cluster, the collectives across tasks; else None.
  # Read through the strategy's methods (`spans_tasks`, ...), not compared
  # with None.
  cross_task: Optional[CrossTask]

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

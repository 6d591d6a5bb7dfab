"""What a strategy's mode means: the tasks its sums cross.

Every strategy object is one of two kinds, which answer what the build
used to ask as `cross_task is None`:
- `OneTask`: the towers' sums stay in this task (one machine, or a ps
  cluster's worker, which sends one update to the ps tasks);
- `AcrossTasks`: a synchronous cluster's task, whose sums run over every
  training task too, through the `cross_task` it holds
  (`replicate.call.strategy.CrossTask`).
"""

import contextlib
from typing import Any, Optional, Tuple

import tensorflow as tf

from replicate.call import strategy as strategy_lib
from replicate.cluster import ps_cluster
from replicate.cluster import sync_input
from replicate.cluster import sync_session


class OneTask:
  """Sums over this task's towers only."""

  cross_task: Optional[strategy_lib.CrossTask] = None
  spans_tasks = False  # whether sums run across a cluster's tasks too
  is_first_task = True  # whether this task's tower 0 is the first of all

  def sum_over_tasks(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
    """`tensor` summed over the tasks: itself."""
    del name
    return tensor

  def builds_towers(self, num_devices: int) -> bool:
    """Whether the call builds towers (else the `model_fn` once, placed):
    with several devices."""
    return num_devices > 1

  def tower_scope(self, index: int):
    """What tower `index` is built in, besides its device: nothing."""
    del index
    return contextlib.nullcontext()

  def take_batch(self, features, labels) -> Tuple[Any, Any, Any]:
    """(features, labels, the rows of every task or None): as they are."""
    return features, labels, None

  def count_rows(self, batch_size) -> Any:
    """Every task's rows (see `AcrossTasks.count_rows`): None, one task."""
    del batch_size
    return None

  def for_session(self, spec: tf.estimator.EstimatorSpec, config,
                  mode: str) -> tf.estimator.EstimatorSpec:
    """`spec` with what the task's session needs: a ps cluster's hooks and
    Saver (`replicate.cluster.ps_cluster.for_cluster`)."""
    return ps_cluster.for_cluster(spec, config,
                                  ps_cluster.num_ps_tasks(config, mode))


class AcrossTasks:
  """Sums over this task's towers, then across every training task.

  A mixin before a `OneTask` strategy: the class sets `cross_task`.
  """

  cross_task: strategy_lib.CrossTask
  spans_tasks = True

  @property
  def is_first_task(self) -> bool:
    """Whether this task's tower 0 is the first tower of all: the chief's."""
    return self.cross_task.group.is_chief

  def sum_over_tasks(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
    """`tensor` summed over every task."""
    return self.cross_task.sum(tensor, name=name)

  def builds_towers(self, num_devices: int) -> bool:
    """Always: one device's sums still cross the tasks."""
    del num_devices
    return True

  def tower_scope(self, index: int):
    """What tower `index` is built in, besides its device: nothing."""
    del index
    return contextlib.nullcontext()

  def take_batch(self, features, labels) -> Tuple[Any, Any, Any]:
    """The batch taken as an optional, so that an input's end stops every
    task at the step's first collective
    (`replicate.cluster.sync_input.take_batch`)."""
    return sync_input.take_batch(features, labels, self.cross_task)

  def count_rows(self, batch_size) -> tf.Tensor:
    """Every task's rows this step in rank order (int64 [tasks]): their
    sum is what the towers' shares count over."""
    return sync_input.count_rows(batch_size, self.cross_task)

  def for_session(self, spec: tf.estimator.EstimatorSpec, config,
                  mode: str) -> tf.estimator.EstimatorSpec:
    """`spec` with the start every task runs alike
    (`replicate.cluster.sync_session.for_task`)."""
    del config, mode
    return sync_session.for_task(spec, self.cross_task)

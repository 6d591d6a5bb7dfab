"""What is fixed for one wrapped `model_fn` call: the towers and the batch.

On the layout: `TowerLayout.of(...)` is made once per call, before any
tower is built, and never changes: the graph, one `Tower` record per tower
(its device, its shard of the batch, its share), the batch's split and the
variable strategy. Every build step may read it; none writes it.

On names: tower i is built under a `tower_i` name scope; `to_tower0_name`
gives the name tower 0 gave to what tower i named.
"""

import dataclasses
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import tensorflow as tf

from replicate.call import strategy as strategy_lib


@dataclasses.dataclass(frozen=True, eq=False)  # eq: it holds tensors
class Tower:
  """What is fixed for tower `index` in one call, built once per call."""
  index: int
  device: str
  device_function: Callable  # places the tower's ops (`call.devices`)
  features: Any  # the tower's shard of the features
  labels: Any  # the tower's shard of the labels (None when labels are)
  share: Any  # its share of the batch n_i / n: a float or a scalar tensor
  has_rows: Any  # whether its outputs count: a bool or a scalar bool tensor


class TowerLayout(NamedTuple):
  """What is fixed for one call: the towers, the batch, the strategy."""
  towers: List[Tower]
  shards: Any  # the batch's split (`replicate.shard.sharding.Shards`)
  strategy: strategy_lib.VariableStrategy  # where variables live, how
  # gradients combine
  graph: tf.Graph  # the graph the towers are built in
  # In a synchronous cluster, every task's rows this step in rank order
  # (int64 [tasks]); else None.
  task_rows: Optional[tf.Tensor] = None

  @classmethod
  def of(cls, devices: Sequence[str], device_functions: Sequence[Callable],
         shards: Any, strategy: strategy_lib.VariableStrategy,
         graph: Optional[tf.Graph] = None,
         task_rows: Optional[tf.Tensor] = None) -> "TowerLayout":
    """The layout of `shards` on `devices` (`graph`: the default graph).

    The hand-off from the split (step 1) to every later step: made once,
    read by all, changed by none.

    Args:
      devices: the towers' devices, in tower order.
      device_functions: per tower, the device function its ops are
        placed by (`replicate.call.devices.tower_device_function`).
      shards: the batch's split (`replicate.shard.sharding.Shards`).
      strategy: the call's `VariableStrategy`.
      graph: the graph the towers are built in (default: the default one).
      task_rows: in a synchronous cluster, every task's rows this step in
        rank order (int64 [tasks]); the shares then count over their sum,
        not the batch's.

    Returns:
      The `TowerLayout`: one `Tower` per device (its shard, its share
      `n_i / n`, whether it has rows), the split, the strategy, the graph,
      the tasks' rows.
    """
    total_rows = None
    if task_rows is not None:
      with tf.device(strategy.cross_task.device):
        total_rows = tf.reduce_sum(task_rows)
    shares = shards.shares(total_rows)
    has_rows = shards.has_rows()
    towers = [
        Tower(index, device, device_function, shards.features[index],
              shards.labels[index], shares[index], has_rows[index])
        for index, (device, device_function) in enumerate(
            zip(devices, device_functions))]
    return cls(towers, shards, strategy,
               graph or tf.compat.v1.get_default_graph(), task_rows)

  @property
  def num_towers(self) -> int:
    return len(self.towers)

  @property
  def devices(self) -> List[str]:
    """Each tower's device, in tower order."""
    return [tower.device for tower in self.towers]

  @property
  def has_rows(self) -> List[Any]:
    """Whether each tower's outputs count, in tower order."""
    return [tower.has_rows for tower in self.towers]

  @property
  def cross_task(self) -> Optional[strategy_lib.CrossTask]:
    """The collectives across a synchronous cluster's tasks, or None (ask
    `spans_tasks` whether there are any)."""
    return self.strategy.cross_task

  @property
  def spans_tasks(self) -> bool:
    """Whether the step's sums cross a synchronous cluster's tasks."""
    return self.strategy.spans_tasks

  @property
  def combines(self) -> bool:
    """Whether anything is combined: several towers, or several tasks."""
    return self.strategy.builds_towers(self.num_towers)

  @property
  def is_first_task(self) -> bool:
    """Whether this task's tower 0 is the first tower of all: always, but
    in a synchronous cluster's tasks other than the chief."""
    return self.strategy.is_first_task

  def sum_over_tasks(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
    """`tensor` summed over a synchronous cluster's tasks; else itself."""
    return self.strategy.sum_over_tasks(tensor, name)

  @property
  def is_replicated(self) -> bool:
    """Whether towers 1..N-1 train their own copies of the variables."""
    return self.strategy.copies_variables


def to_tower0_name(name: str, index: int) -> str:
  """The name tower 0 gives to what tower `index` named `name`.

  Tower i's names are tower 0's with a `tower_i` scope added: at the front,
  and again wherever a model captured the absolute name scope it was built
  in (the TF 2 canned DNN names a layer that way). Every such component
  goes.
  """
  if index == 0:
    return name
  tower = "tower_{}".format(index)
  return "/".join(part for part in name.split("/") if part != tower)

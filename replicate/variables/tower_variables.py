"""Per-tower variables: the copies of `"replicated"` and tower-local variables.

On copies: with `variable_strategy="replicated"` (in TRAIN), tower 0 creates
every variable under its own name, and tower i (i >= 1) gets, in place of
each trainable one, a copy named `tower_i/<name>` on its own device. A copy
is a local variable (`LOCAL_VARIABLES`, so never saved, and not trainable,
so never in `TRAINABLE_VARIABLES`) whose initial value is tower 0's
variable: the Scaffold's `local_init_op` runs after the global variables
were initialised or restored from a checkpoint, so towers start equal after
a restore too. The optimizer's slots of a copy are made the same way, from
tower 0's slots. Non-trainable variables (batch-norm moving statistics, a
loss scale, a counter) are not copied: every tower uses tower 0's, as with
`"parameter_server"`, so what the update changes there (a loss scale it
halves) every tower sees.

On ps-held variables (a cluster with ps tasks, `replicate.cluster.hybrid`):
what tower 0 made on a ps task is never copied: every tower of every task
reads it there, and only the first task (`updates_shared`) updates it.

On tower-local variables: the copies of the variables made inside
`replicate.tower_local_scope` are made here too, under any
`variable_strategy`, and folded into tower 0's variable by
`replicate.variables.tower_local`, which says how.
"""

import contextlib
from typing import List, Optional

import tensorflow as tf

from replicate.call import name_counters
from replicate.cluster import hybrid
from replicate.cluster import ps_placement
from replicate.variables import tower_local


class TowerVariables:
  """Which variables each tower sees, for one replicated model_fn call."""

  def __init__(self, graph, devices, is_replicated: bool,
               updates_shared: bool = True):
    self.graph = graph
    # Whether this task updates the variables every task shares, on ps
    # tasks (only the first task does).
    self.updates_shared = updates_shared
    # Whether towers 1..N-1 train their own copies (the strategy's
    # `copies_variables`); asked through `has_copies`.
    self.is_replicated = is_replicated
    self.local_reduce = None  # set inside tower_local_scope
    self._devices = devices
    self._tower0 = set()  # refs of the variables tower 0 created
    self._reduce_of = {}  # tower 0 variable ref -> "sum" or "mean"
    self._copies = [dict() for _ in devices]  # tower 0 variable ref -> copy
    self._tower0_of = {}  # copy ref -> tower 0's variable
    self._slots = {}  # op name -> slot variable made for tower 0's variables
    self._making_copy = False  # creating one of the copies below
    self._made_early = set()  # copies whose names no tower has taken yet
    # Per "sum" variable: its value at the last fold, where copies started.
    self._bases = {}


  def has_copies(self, index: Optional[int] = None) -> bool:
    """Whether tower `index` trains its own copies of the trainable
    variables (tower 0 never does); `index` None: whether any tower does."""
    return self.is_replicated and index != 0

  def check_not_local(self, kwargs):
    """Refuses a local variable in a tower_local_scope, which cannot fold."""
    if self.local_reduce is not None and not self._making_copy:
      raise ValueError(
          "tower_local_scope: the variable {!r} is created in collections {} "
          "that leave out GLOBAL_VARIABLES. A tower-local variable is a "
          "global one (tower 0's is saved, holding the reduction over "
          "towers): create it with the default collections, or outside the "
          "scope.".format(kwargs.get("name"), kwargs.get("collections")))

  def note_tower0_variable(self, variable, trainable: bool):
    """Records a variable tower 0 created (tower-local if in the scope)."""
    self._tower0.add(variable.ref())
    if self.local_reduce is None:
      return
    name = variable.op.name
    if trainable:
      raise ValueError(
          "tower_local_scope: the variable {!r} is trainable. Variables in "
          "a tower_local_scope are updated by each tower on its own, not by "
          "an optimizer: create it with trainable=False.".format(name))
    if self.local_reduce == tower_local.MEAN and not variable.dtype.is_floating:
      raise ValueError(
          "tower_local_scope(reduce='mean'): the variable {!r} is {}, but a "
          "mean needs a floating-point variable. Use reduce='sum' or a float "
          "dtype.".format(name, variable.dtype.base_dtype.name))
    self._reduce_of[variable.ref()] = self.local_reduce

  def is_tower_local(self, variable) -> bool:
    """Whether tower 0 made `variable` in a `tower_local_scope`."""
    return variable.ref() in self._reduce_of

  def is_shared(self, variable) -> bool:
    """Whether tower 0 made `variable` for every tower (not a metric's)."""
    return variable.ref() in self._tower0

  def updates(self, variable) -> bool:
    """Whether this task's update applies to `variable` (a ps-held one is
    updated by the first task alone)."""
    return self.updates_shared or not self._on_ps(variable)

  def _on_ps(self, variable) -> bool:
    """Whether `variable` lives on a ps task: asked once tower 0 is built,
    when the partitioned variables have been placed by how tower 0 reads
    them (`replicate.cluster.hybrid.settle_placements`)."""
    if not self.is_replicated:
      return False
    ps_placement.settle_placements(self.graph, self._devices[0])
    return hybrid.on_ps(variable)

  def made_by_update(self, name: str):
    """Where the update makes a variable named `name`: beside a ps-held
    variable, as `replicate.cluster.hybrid.made_by_update` says. Yields a
    list that gets the variable made. Only where towers have copies: in a
    ps cluster trained "parameter_server" every variable lives on the ps
    tasks, an optimizer's own too."""
    if not self.is_replicated:
      return contextlib.nullcontext([])
    ps_placement.settle_placements(self.graph, self._devices[0])
    return hybrid.made_by_update(self.graph, name, self._devices[0])

  def for_tower(self, index: int, variable):
    """What tower `index` uses in place of tower 0's `variable`."""
    copy = self._copy_for(index, variable)
    if copy is not variable and copy.ref() in self._made_early:
      # The tower now takes the copy: its name is the tower's, as if the
      # copy were made here (see `copy_early`).
      self._made_early.discard(copy.ref())
      name_counters.take(self.graph, copy.op.name)
    return copy

  def copy_early(self, index: int, variable):
    """Tower `index`'s copy of `variable`, made before the tower is built.

    Tower 0's update is built before towers 1..N-1 and updates their copies
    too. A copy made then would hold the name tower i's own variable
    creation asks for (`tower_1/dense/kernel`), so that a Keras layer's
    variable there would be named, and matched, as `kernel_1`: the name is
    given back until the tower takes the copy through `for_tower`.
    """
    known = variable.ref() in self._copies[index] if index else True
    copy = self._copy_for(index, variable)
    if not known and copy is not variable:
      self._made_early.add(copy.ref())
      name_counters.release(self.graph, copy.op.name)
    return copy

  def _copy_for(self, index, variable):
    if index == 0 or not isinstance(variable, tf.Variable):
      return variable
    reduce = self._reduce_of.get(variable.ref())
    if reduce is None and not (self.is_replicated and variable.trainable and
                               variable.ref() in self._tower0 and
                               not self._on_ps(variable)):
      return variable
    copies = self._copies[index]
    if variable.ref() not in copies:
      copy = self._local_variable(index, variable)
      copies[variable.ref()] = copy
      self._tower0_of[copy.ref()] = variable
      if reduce == tower_local.SUM and variable.ref() not in self._bases:
        self._bases[variable.ref()] = self._local_variable(
            0, variable, name="tower_local_base/" + variable.op.name)
    return copies[variable.ref()]

  def in_tower(self, index: int, variable):
    """Tower `index`'s copy of `variable` if it made one, else `variable`."""
    if index == 0 or not isinstance(variable, tf.Variable):
      return variable
    return self._copies[index].get(variable.ref(), variable)

  def tower0_variable(self, variable):
    """Tower 0's variable for a copy; any other variable is itself."""
    return self._tower0_of.get(variable.ref(), variable)

  def copies_of(self, variable) -> List[Optional[tf.Variable]]:
    """Per tower, its copy of tower 0's `variable` (tower 0: the variable)."""
    return [variable] + [c.get(variable.ref()) for c in self._copies[1:]]

  def slot_for(self, name: str, tower0_name: str, next_creator, kwargs):
    """Creates an optimizer slot; a copy's slot copies tower 0's slot."""
    if name == tower0_name:
      slot = next_creator(**kwargs)
      self._slots[tower0_name] = slot
      return slot
    if tower0_name not in self._slots:
      raise ValueError(
          "variable_strategy='replicated': the optimizer creates {!r} for a "
          "tower's copy, but made no {!r} for tower 0's variable first. Only "
          "optimizers that create per-variable slots in variable order are "
          "supported.".format(name, tower0_name))
    tower0_slot = self._slots[tower0_name]
    with self._copying():
      return tf.compat.v1.Variable(
          initial_value=_value_of(tower0_slot), trainable=False,
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
          name=kwargs.get("name"), dtype=tower0_slot.dtype.base_dtype,
          use_resource=True)

  def copy_ops(self, index: int) -> set:
    """The ops of tower `index`'s copies (tower-local or replicated)."""
    if index == 0:
      return set()
    return {copy.op for copy in self._copies[index].values()}

  def then_fold(self, op, has_rows, cross_task=None):
    """`op`, then the fold of the tower-local variables, if there are any.

    With `cross_task` (a synchronous cluster's), the fold is over every
    task's towers, even a task of one tower.
    """
    with tf.control_dependencies([op]):
      fold = self.fold_tower_local(has_rows, cross_task)
    return op if fold is None else tf.group(op, fold)

  def fold_tower_local(self, has_rows, cross_task=None
                      ) -> Optional[tf.Operation]:
    """Folds every tower's copy into tower 0's variable, per its reduction."""
    folds = []
    for ref, reduce in self._reduce_of.items():
      variable = ref.deref()
      per_tower = self.copies_of(variable)
      if cross_task is None and all(copy is None for copy in per_tower[1:]):
        continue
      base = self._bases.get(ref)
      if reduce == tower_local.SUM and base is None:
        # Only where no tower copied it: one tower in a cluster's task.
        base = self._bases[ref] = self._local_variable(
            0, variable, name="tower_local_base/" + variable.op.name)
      folds.append(tower_local.fold(variable, reduce, per_tower, has_rows,
                                    base, cross_task))
    return tf.group(*folds, name="tower_local_fold") if folds else None

  @contextlib.contextmanager
  def _copying(self):
    self._making_copy = True
    try:
      yield
    finally:
      self._making_copy = False

  def _local_variable(self, index, variable, name=None):
    """A local variable on tower `index`'s device, starting as `variable`."""
    if not is_resource_variable(variable):
      # TensorFlow rebuilds a ref variable's initial value inside the new
      # variable's colocation, where tower 0's variable cannot be read.
      raise ValueError(
          "Tower {} needs its own copy of {!r}, which is a ref variable "
          "(use_resource=False). Per-tower copies are made of resource "
          "variables, TensorFlow 2's default: create it with "
          "use_resource=True, or use variable_strategy='parameter_server'."
          .format(index, variable.op.name))
    with self.graph.name_scope(None), tf.device(
        self._devices[index]), self._copying():
      return tf.compat.v1.Variable(
          initial_value=_value_of(variable), trainable=False,
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
          name=name or "tower_{}/{}".format(index, variable.op.name),
          dtype=variable.dtype.base_dtype, use_resource=True)


def is_resource_variable(variable) -> bool:
  """Whether `variable` is a resource variable (or wraps one), not a ref one.

  What `resource_variable_ops.is_resource_variable` says for the variables
  a graph holds (resource, ref, Keras's `AutoCastVariable`), from public
  parts: a resource variable's op makes its handle, a `tf.resource`.
  """
  return variable.op.outputs[0].dtype == tf.resource


def _value_of(variable):
  """A read of `variable` where it lives, for another variable's initializer.

  Made here rather than in the copy's initializer, which is colocated with
  the copy: a variable can only be read on its own device. Outside any
  control flow and control dependencies, as an initial value must be.
  """
  with tf.init_scope(), tf.compat.v1.colocate_with(variable.op,
                                                  ignore_existing=True):
    return tf.identity(variable.read_value())

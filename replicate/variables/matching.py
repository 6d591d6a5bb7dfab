"""Which of tower 0's variables a variable creation in tower i stands for.

On matching: tower 0 creates every shared variable; towers 1..N-1 build the
same `model_fn` and so ask to create the same variables, in the same order.
A `tf.compat.v1.get_variable` in tower i finds tower 0's variable by name
through `reuse=True` (and `variable_getter`); anything else (`tf.Variable`,
Keras layers) reaches `variable_creator`, which gets tower 0's variable
from `Tower0Variables`: the one tower 0 created at the same point, under the
same name less the `tower_i` scope, with the same shape and dtype. Anything
else is an error, never a silent mix-up of two variables. The replication
context's `tower_scope` enters both for every tower; where a tower has its
own copies, both hand it those (`replicate.variables.tower_variables`).
"""

import re
from typing import Callable

import numpy as np
import tensorflow as tf

from replicate.call import layout as layout_lib


def variable_getter(context, index: int) -> Callable:
  """For `get_variable` in tower `index`: tower 0's variable or its copy.

  A variable named after one of the tower's tensors (an
  `ExponentialMovingAverage` of the loss: `tower_1/loss/Exponential...`)
  is tower 0's of the same name less the tower scope.
  """

  def custom_getter(getter, name, *args, **kwargs):
    try:
      variable = getter(name, *args, **kwargs)
    except ValueError:
      tower0_name = layout_lib.to_tower0_name(name, index)
      if tower0_name == name:
        raise
      variable = getter(tower0_name, *args, **kwargs)
    context.collections.reach(index, variable)
    own = context.variables.for_tower(index, variable)
    if own is not variable and kwargs.get("regularizer") is not None:
      _regularize_copy(own, name, kwargs["regularizer"])
    return own

  return custom_getter


def _regularize_copy(copy, name, regularizer) -> None:
  """A tower's copy of a variable (variable_strategy="replicated") is
  regularized as `get_variable` regularizes a variable it creates: the
  tower then sees its copies' regularization losses
  (`replicate.towers.tower_collections`), whose gradients reach the copies,
  as a layer's regularizer does."""
  with tf.compat.v1.colocate_with(copy), tf.name_scope(name + "/Regularizer/"):
    loss = regularizer(copy)
  if loss is not None:
    tf.compat.v1.add_to_collection(
        tf.compat.v1.GraphKeys.REGULARIZATION_LOSSES, loss)


def variable_creator(context, index: int) -> Callable:
  """Tower 0 records its variables; towers 1..N-1 get tower 0's.

  `reuse=True` shares what `tf.compat.v1.get_variable` makes; this shares
  the rest (`tf.Variable`, Keras layers as in the TF 2 canned estimators)
  by creation: each variable tower i creates is the one tower 0 created at
  the same point (see `Tower0Variables`). Tower-local variables (metrics:
  created with collections that leave out GLOBAL_VARIABLES) are created
  as usual, and so are the optimizer's own variables made by the
  aggregated update, except that with replicated variables a copy's slots
  copy tower 0's. Where a tower has its own copies (see
  `replicate.variables.tower_variables`), it gets those in place of tower 0's variables.
  """

  graph = context.layout.graph

  def creator(next_creator, **kwargs):
    if _is_tower_local(kwargs):
      context.variables.check_not_local(kwargs)
      return next_creator(**kwargs)
    requested = kwargs.get("name") or "Variable"
    own_name = graph.unique_name(requested, mark_as_used=False)
    if context.progress.is_applying:
      with context.variables.made_by_update(requested) as made:
        if not context.variables.has_copies():
          made.append(next_creator(**kwargs))
        else:
          made.append(context.variables.slot_for(
              own_name, _without_towers(own_name), next_creator, kwargs))
      return made[0]
    if index == 0:
      variable = next_creator(**kwargs)
      context.tower0_variables.record(variable)
      context.variables.note_tower0_variable(variable, variable.trainable)
      return variable
    tower0_variable = context.tower0_variables.match(
        index, own_name, layout_lib.to_tower0_name(own_name, index), kwargs)
    context.collections.reach(index, tower0_variable)
    variable = context.variables.for_tower(index, tower0_variable)
    if graph.unique_name(requested, mark_as_used=False) == own_name:
      # Creating the variable would have taken its name, as it did in
      # tower 0: take it, so the tower's next one ('Variable_1', 'w_1')
      # is named, and matched, as tower 0's next one was.
      graph.unique_name(requested, mark_as_used=True)
    return variable

  return creator


class Tower0Variables:
  """The variables tower 0 created, in order; matched by the other towers.

  Towers 1..N-1 create the same variables in the same order as tower 0
  (their names, less the `tower_i` scope, are tower 0's, since every tower
  starts from the same name counters). Tower 0 may create variables the
  others do not, e.g. a Keras layer or optimizer object shared by every
  tower builds its variables once; those are skipped. A tower's variable
  must come after the previous one it matched and have its shape and dtype,
  or the towers would silently train other variables than tower 0's.
  """

  def __init__(self):
    self._in_order = []
    self._position = {}  # op name -> index in _in_order
    self._next = {}  # tower index -> where its next match may start

  def record(self, variable):
    self._position[variable.op.name] = len(self._in_order)
    self._in_order.append(variable)

  def match(self, index, own_name, tower0_name, kwargs):
    """Tower 0's variable for tower `index`'s creation of `own_name`."""
    position = self._position.get(tower0_name)
    start = self._next.get(index, 0)
    if position is None or position < start:
      expected = [v.op.name for v in self._in_order[start:]]
      raise ValueError(
          "Tower {} creates the variable {!r}, but tower 0 created no "
          "variable {!r} at that point (tower 0's variables from there on: "
          "{}). Each tower's model_fn must create the same variables in the "
          "same order, so that every tower trains tower 0's; create them "
          "independently of the tower's data.".format(
              index, own_name, tower0_name, expected or "none"))
    variable = self._in_order[position]
    shape, dtype = requested_shape_and_dtype(kwargs)
    if ((shape is not None and not variable.shape.is_compatible_with(shape))
        or (dtype is not None and dtype.base_dtype !=
            variable.dtype.base_dtype)):
      raise ValueError(
          "Tower {} creates the variable {!r} with shape {} and dtype {}, "
          "but tower 0's {!r} has shape {} and dtype {}. Each tower's "
          "model_fn must create the same variables; make their shapes "
          "independent of the tower's batch.".format(
              index, own_name, shape, dtype and dtype.base_dtype.name,
              tower0_name, variable.shape, variable.dtype.base_dtype.name))
    self._next[index] = position + 1
    return variable


def requested_shape_and_dtype(kwargs):
  """The shape and dtype a variable creation asks for, where known.

  A callable initial value is not called: that would build its ops.
  """
  shape = kwargs.get("shape")
  dtype = kwargs.get("dtype")
  initial_value = kwargs.get("initial_value")
  if not callable(initial_value) and initial_value is not None:
    if isinstance(initial_value, (tf.Tensor, tf.Variable)):
      value_shape, value_dtype = initial_value.shape, initial_value.dtype
    else:  # a Python or numpy value; its dtype depends on conversion
      value_shape, value_dtype = np.shape(initial_value), None
    shape = value_shape if shape is None else shape
    dtype = value_dtype if dtype is None else dtype
  return (None if shape is None else tf.TensorShape(shape),
          None if dtype is None else tf.as_dtype(dtype))


def _is_tower_local(variable_kwargs) -> bool:
  """Metric variables: made for one tower's ops, never shared."""
  collections = variable_kwargs.get("collections")
  return (collections is not None and
          tf.compat.v1.GraphKeys.GLOBAL_VARIABLES not in collections)


def _without_towers(name: str) -> str:
  """`name` less every `tower_i` component (i >= 1): tower 0's name for it."""
  return "/".join(part for part in name.split("/")
                  if not _TOWER_COMPONENT.fullmatch(part))


_TOWER_COMPONENT = re.compile(r"tower_[1-9][0-9]*")

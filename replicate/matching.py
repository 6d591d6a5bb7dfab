"""Which of tower 0's variables a variable creation in tower i stands for.

On matching: tower 0 creates every shared variable; towers 1..N-1 build the
same `model_fn` and so ask to create the same variables, in the same order.
A `tf.compat.v1.get_variable` in tower i finds tower 0's variable by name
through `reuse=True`; anything else (`tf.Variable`, Keras layers) reaches the
replication context's variable creator, which gets tower 0's variable from
here: the one tower 0 created at the same point, under the same name less
the `tower_i` scope, with the same shape and dtype. Anything else is an
error, never a silent mix-up of two variables.
"""

import numpy as np
import tensorflow as tf


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

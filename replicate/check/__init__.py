"""`replicate.check` and `python -m replicate.check`: does a user's
`model_fn` on N towers equal one device, and if not, where does it part?

Modules, one concern each:
- `batches`: the first `steps` batches of the `input_fn`, read once and
  replayed to every run;
- `runs`: one run (one device, or N towers with a strategy) built and run
  as the Estimator would, from one initial state;
- `randoms`: one device's random draws, fed to each tower's copy;
- `compare`: values equal to a tolerance (the oracle in tests/oracle uses
  it too);
- `localize`: the first op whose value in a tower is not one device's;
- `report`: what was found, as a table or JSON;
- `checking`: the steps together; `__main__`: the command line.

This module imports no TensorFlow, so that `python -m replicate.check
--help` answers at once; `check` imports what it needs when called.
`replicate.check` is callable whether it names this module (after `import
replicate.check`) or the function (`replicate.check` first used as the
public name): both take the same arguments.
"""

import sys
import types


def check(model_fn, input_fn, *, towers=(2,), strategies=None, steps=3,
          params=None, config=None, eval_input_fn=None,
          modes=("train", "eval", "predict"), **tolerances):
  """Compares `model_fn` wrapped in `replicate_model_fn` with itself on one
  device, on your batches; returns a report.

  Args:
    model_fn: an Estimator `model_fn` (its optimizer in
      `replicate.TowerOptimizer`), unwrapped.
    input_fn: its training `input_fn`; its first `steps` batches are read
      once and given to every run (a shuffling or endless input is
      compared on the same rows).
    towers: the tower counts to compare, each on that many virtual CPU
      devices.
    strategies: the `variable_strategy`s to compare (default
      `["parameter_server"]`).
    steps: how many batches: training steps, evaluation and prediction
      batches.
    params, config: what the Estimator would pass the `model_fn`.
    eval_input_fn: batches for evaluation and prediction (default: the
      training batches).
    modes: which of "train", "eval", "predict" to compare (a mode the
      `model_fn` does not support is left out, with a note).
    **tolerances: `rtol`, `atol` (default 1e-5, 1e-6).

  Returns:
    A `replicate.check.report.Report`: `exact`, `differences` (each with
    both values and the first op that differs: name, type, source line),
    `str(report)` the table, `report.to_json()`.
  """
  from replicate.check import checking  # pylint: disable=import-outside-toplevel
  return checking.check(
      model_fn, input_fn, towers=towers, strategies=strategies, steps=steps,
      params=params, config=config, eval_input_fn=eval_input_fn, modes=modes,
      **tolerances)


class _CallableModule(types.ModuleType):
  """This module, callable as `check` (see the module's docstring)."""

  def __call__(self, *args, **kwargs):
    return check(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

"""`replicate.check`: a user's `model_fn` on N towers against one device.

The steps (see `replicate.check`'s docstring for the contract): read the
batches once (`batches`), make one initial state (`runs.initial_state`),
run one device, recording its random draws, then every tower count and
strategy fed those draws (`runs`, `randoms`); compare every value
(`compare`) and, for a run that differs, find the first op that does
(`localize`); a `report.Report` of it all.
"""

import re
import shutil
import tempfile
import time
from typing import Optional, Sequence

import tensorflow as tf

from replicate.check import batches as batches_lib
from replicate.check import compare
from replicate.check import localize
from replicate.check import report as report_lib
from replicate.check import runs
from replicate.variables import strategies as strategies_lib

_MODES = ("train", "eval", "predict")


def check(model_fn, input_fn, *, towers: Sequence[int] = (2,),
          strategies: Optional[Sequence[str]] = None, steps: int = 3,
          params: Optional[dict] = None, config=None, eval_input_fn=None,
          modes: Sequence[str] = _MODES, rtol: float = compare.RTOL,
          atol: float = compare.ATOL) -> report_lib.Report:
  """Compares `model_fn` wrapped on each tower count and strategy with the
  unwrapped `model_fn` on one device, on the first `steps` batches of
  `input_fn`; returns a `report.Report` (`exact`, `differences`, and
  `str()` a table)."""
  towers, strategies, modes = _checked(towers, strategies, steps, modes)
  workdir = tempfile.mkdtemp(prefix="replicate-check-")
  try:
    return _check(model_fn, input_fn, towers, strategies, steps, params,
                  config, eval_input_fn, modes, rtol, atol, workdir)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _checked(towers, strategies, steps, modes):
  towers = tuple(towers)
  if not towers or any(not isinstance(n, int) or n < 1 for n in towers):
    raise ValueError(
        "replicate.check: towers={!r}; expected tower counts, integers of 1 "
        "or more, e.g. towers=(2, 3).".format(towers))
  strategies = tuple(strategies or (strategies_lib.PARAMETER_SERVER,))
  known = (strategies_lib.PARAMETER_SERVER, "round_robin", "replicated")
  for strategy in strategies:
    if strategy not in known:
      raise ValueError(
          "replicate.check: strategy {!r} is not a variable_strategy; "
          "expected some of {}.".format(strategy, ", ".join(known)))
  if not isinstance(steps, int) or steps < 1:
    raise ValueError("replicate.check: steps={!r}; expected an integer of "
                     "1 or more.".format(steps))
  modes = tuple(modes)
  if not modes or any(mode not in _MODES for mode in modes):
    raise ValueError("replicate.check: modes={!r}; expected some of "
                     "{}.".format(modes, ", ".join(_MODES)))
  return towers, strategies, modes


def _check(model_fn, input_fn, towers, strategies, steps, params, config,
           eval_input_fn, modes, rtol, atol, workdir):
  clock = _Clock()
  session_config = tf.compat.v1.ConfigProto(
      device_count={"CPU": max(towers)})
  run_config = (config or tf.estimator.RunConfig()).replace(
      model_dir=workdir, session_config=session_config, tf_random_seed=0)
  setup = runs.Setup(model_fn, params, run_config, session_config, workdir)
  with clock("reading batches"):
    train_batches = batches_lib.read(input_fn, steps, "train", params,
                                     run_config)
    eval_batches = (batches_lib.read(eval_input_fn, steps, "eval", params,
                                     run_config)
                    if eval_input_fn is not None else train_batches)
  data = {"train": train_batches, "eval": eval_batches,
          "predict": eval_batches}
  notes = []
  with clock("building one device"):
    built = {}
    for mode in modes:
      try:
        one = runs.build(setup, mode, data[mode])
      except Exception as error:  # pylint: disable=broad-except
        notes.append("{}: not compared, the model_fn raised {}: {}".format(
            mode, type(error).__name__, error))
        continue
      if runs.supports(one, mode):
        built[mode] = one
      else:
        notes.append("{}: not compared, the model_fn's spec has no {} in "
                     "that mode".format(mode, "train_op" if mode == "train"
                                        else "loss" if mode == "eval" else
                                        "predictions"))
  modes = [mode for mode in modes if mode in built]
  if not modes:
    raise ValueError(
        "replicate.check: the model_fn supports none of the modes asked "
        "for ({}). Fix: check that it builds a spec for them.".format(
            "; ".join(notes)))
  with clock("initial state"):
    start = runs.initial_state(setup, built[modes[0]])
  one_device, draws = {}, {}
  with clock("one device"):
    trained = start
    for mode in modes:
      result = runs.run(setup, built[mode], mode, data[mode], trained,
                        "one-device")
      one_device.update(result.values)
      draws[mode] = result.draws
      if mode == "train":
        trained = result.checkpoint
  random_ops = sorted({name for mode in modes for step in draws[mode]
                       for name in step})
  report = report_lib.Report(
      runs=[], modes=list(modes), steps=len(train_batches),
      rows=[b.rows for b in data[modes[0]]], rtol=rtol, atol=atol,
      compared={}, random_ops=random_ops, notes=notes)
  for count in towers:
    for strategy in strategies:
      name = "{} tower{}, {}".format(count, "" if count == 1 else "s",
                                     strategy)
      report.runs.append(name)
      with clock(name):
        found, compared = _one_run(setup, data, modes, count, strategy,
                                   start, trained, one_device, draws, name,
                                   rtol, atol, report.notes)
      report.compared[name] = compared
      with clock("localizing"):
        _localize(setup, found, data, start, trained, draws, count,
                  strategy, rtol, atol)
      report.differences.extend(found)
  report.seconds = clock.seconds
  report.seconds["runs compared"] = clock.seconds["one device"] + sum(
      clock.seconds[name] for name in report.runs)
  report.seconds["total"] = sum(
      value for part, value in clock.seconds.items()
      if part not in ("runs compared",))
  return report


def _one_run(setup, data, modes, count, strategy, start, trained,
             one_device, draws, name, rtol, atol, notes):
  """(the differences of one run, how many values it compared)."""
  values = {}
  for mode in modes:
    try:
      built = runs.build(setup, mode, data[mode], count, strategy)
      result = runs.run(setup, built, mode, data[mode],
                        start if mode == "train" else trained,
                        name.replace(" ", "_").replace(",", ""),
                        draws=draws[mode])
    except runs.Refused as refused:
      op = localize.op_in_message(str(refused.error), refused.graph)
      kind = "refused" if refused.by_replicate else "failed"
      return [report_lib.Difference(
          name, "{} when built ({})".format(kind, mode),
          message=str(refused.error),
          first_op=report_lib.FirstOp(
              op.name if op else "", op.type if op else "",
              localize.source_line(op) if op else
              localize.source_of_error(refused.error), 0, "", "",
              note="refused by replicate" if refused.by_replicate else
              "where it failed"))], 0
    except tf.errors.OpError as error:
      op = error.op
      return [report_lib.Difference(
          name, "failed when run ({})".format(mode),
          message="{}: {}".format(type(error).__name__,
                                  _what_failed(error.message)),
          first_op=None if op is None else report_lib.FirstOp(
              op.name, op.type, localize.source_line(op), 0, "", "",
              note="the op that failed"))], 0
    values.update(result.values)
  off, missing, extra = compare.differing(one_device, values, rtol, atol)
  # A summary's value over the batch is the whole batch's, but some stay
  # tower 0's, by design (outputs/whole_batch.py): noted, not counted.
  summaries = sorted({what.rsplit(" step ", 1)[0][len("summary "):]
                      for _, _, what in off if what.startswith("summary ")})
  if summaries:
    notes.append("{}: the scalar summaries {} differ from one device's: "
                 "replicate writes these as tower 0's (its shard's rows), "
                 "by design; not counted".format(name, ", ".join(summaries)))
  off = [entry for entry in off if not entry[2].startswith("summary ")]
  unmatched = sorted({what.rsplit(" step ", 1)[0][len("summary "):]
                      for what in missing + extra
                      if what.startswith("summary ")})
  if unmatched:
    notes.append("{}: the scalar summaries {} are written by one run only; "
                 "not counted".format(name, ", ".join(unmatched)))
  missing = [what for what in missing if not what.startswith("summary ")]
  extra = [what for what in extra if not what.startswith("summary ")]
  found = [report_lib.Difference(
      name, what, compare.summary(one_device[what]),
      compare.summary(values[what]), detail) for _, detail, what in
           sorted(off, key=lambda entry: _order(entry[2]))]
  found += [report_lib.Difference(name, what, compare.summary(
      one_device[what]), "(missing)", "missing in the replicated run")
            for what in missing]
  found += [report_lib.Difference(name, what, "(missing)", compare.summary(
      values[what]), "not in the one-device run") for what in extra]
  return found, len(set(one_device) & set(values))


def _what_failed(message: str) -> str:
  """The line of a session's error that says what failed (not the Python
  stack TensorFlow prints before it)."""
  lines = [line.strip() for line in message.splitlines() if line.strip()]
  said = [line for line in lines if not line.startswith(_BOILERPLATE) and
          not line.endswith("(most recent call last):")]
  coded = [line for line in said if re.match(
      r"(\(\d+\) )?[A-Z_]+: ", line)]  # "(0) INVALID_ARGUMENT: ..."
  return (coded or said or lines or [""])[0][:500]


# Lines of a session's error that are its stack, not what failed.
_BOILERPLATE = ("Graph execution error", "Detected at node", "File ",
                "Traceback", "[[", "Original stack trace", "Node:",
                "0 successful", "0 derived", "Errors may have")


def _order(what):
  """Losses first, by step; then metrics, predictions, variables."""
  kinds = ("loss", "summary", "metric", "prediction", "variable")
  kind = what.split(" ")[0]
  return (kinds.index(kind) if kind in kinds else len(kinds), what)


def _localize(setup, found, data, start, trained, draws, count, strategy,
              rtol, atol):
  """The first differing op, for the first difference of each mode."""
  done = set()
  for difference in found:
    if difference.message:
      continue
    what = difference.what
    mode = ("predict" if what.startswith("prediction ") else
            "eval" if what.startswith(("metric ", "eval ")) else "train")
    if mode in done or mode not in draws:
      continue
    done.add(mode)
    checkpoint = start if mode == "train" else trained
    difference.first_op = localize.first_op(
        setup, mode, data[mode][0], checkpoint, draws[mode][0], count,
        strategy, what, rtol, atol)
    if difference.first_op is None:
      difference.detail += _NOTHING_FOUND


# When every op the value is computed from equals one device's on the
# first batch.
_NOTHING_FOUND = (
    "; on the first batch, every op of the towers it is computed from "
    "equals one device's rows: the towers' values are combined unlike one "
    "device (the loss's reduction: loss_reduction or "
    "replicate.loss_denominator; the gradients), or it grows from rounding "
    "(a variable whose gradient is about 0, e.g. an attention key's bias "
    "under Adam, moves by rounding noise)")


class _Clock:
  """Seconds spent in each part of the check."""

  def __init__(self):
    self.seconds = {}

  def __call__(self, part):
    clock = self

    class _Timing:

      def __enter__(self):
        self.start = time.perf_counter()

      def __exit__(self, *exc):
        clock.seconds[part] = clock.seconds.get(part, 0.0) + (
            time.perf_counter() - self.start)

    return _Timing()

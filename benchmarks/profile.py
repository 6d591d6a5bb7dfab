"""python -m benchmarks.profile: where a step's time goes, per configuration.

Where a ratio in RESULTS.md is below a target, this says why: it trains a
model under each configuration (as `python -m benchmarks` does, on the same
pipelines), times some untraced steps, then traces steps with
`RunOptions(trace_level=FULL_TRACE)` and adds up the ops' own times by op
type. For each configuration it prints the graph's size, the ops run per
step, the untraced step time and the op types that take the most time; and
for every configuration after the first, what each op type adds to the
first's (the cost of the towers, op type by op type).

On reading it: op times are summed over both cores and every device, so
their total exceeds the step's wall time where ops ran side by side, and an
op that shared the cores with another took longer without doing more work
(the towers' matrix products: `benchmarks.split_cost` times what splitting
the batch costs them alone). A traced step is slower than an untraced one.
Op types are the kernels that ran (after grappler's rewrites, e.g.
`_MklNativeFusedMatMul`), read from the trace's labels.
"""

import collections
import datetime
import os
import re
import statistics
import sys
import time
from typing import Dict, List, NamedTuple

from benchmarks import cli
from benchmarks import configs as configurations


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  parser = cli.parser("python -m benchmarks.profile", __doc__.splitlines()[0])
  add = parser.add_argument
  add("--models", metavar="NAMES", default="mlp,convnet,dnn_classifier",
      type=cli.comma_list(cli.checked(configurations.check_model),
                          twice=cli.ONCE),
      help="comma-separated, from: " + ", ".join(
          configurations.MODEL_NAMES))
  add("--configs", metavar="NAMES",
      default="single,replicate-2-ps,replicate-4-ps",
      type=cli.comma_list(configurations.parse_config, twice=cli.ONCE),
      help="comma-separated configurations (as python -m benchmarks names "
      "them); the first is the reference")
  add("--warmup", metavar="STEPS", type=cli.whole_number(1), default=10,
      help="untimed, untraced steps first")
  add("--timed", metavar="STEPS", type=cli.whole_number(1), default=50,
      help="untraced steps timed, after the warm-up")
  add("--traced", metavar="STEPS", type=cli.whole_number(1), default=20,
      help="steps traced (FULL_TRACE) after the timed ones")
  add("--top", metavar="N", type=cli.whole_number(1), default=12,
      help="op types shown per table, the most time first")
  add("--record", metavar="FILE", default=None,
      help="also write the text to this file, e.g. benchmarks/PROFILE.md "
      "(default: none)")
  return parser


if __name__ == "__main__":
  # --help and a bad flag answer before TensorFlow's import, which
  # takes seconds; main() parses the command line again.
  make_parser().parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from benchmarks import harness  # noqa: E402

# "node = OpType(inputs)", after a "[mklcpu 1.0MB 1.0MB] " for oneDNN kernels
_LABEL = re.compile(r"^(?:\[[^]]*\] )?\S+ = (\w+)\(")


class Profile(NamedTuple):
  graph_ops: int
  step_ms: float  # median untraced step
  ms_by_type: Dict[str, float]  # per traced step
  count_by_type: Dict[str, float]  # per traced step


def main(argv=None):
  args = make_parser().parse_args(argv)
  models, configs = args.models, args.configs
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  harness.prepare()
  sections = []
  for model in models:
    profiles = {}
    for config in configs:
      profiles[config.name] = profile(model, config, args.warmup,
                                      args.timed, args.traced)
      print("profiled {} {}: {:.2f} ms a step".format(
          model, config.name, profiles[config.name].step_ms), flush=True)
    sections.append(markdown(model, profiles, args.top))
  text = "\n".join([
      "# Where a step's time goes", "",
      "Command: `python -m benchmarks.profile {}`  ".format(" ".join(
          argv if argv is not None else sys.argv[1:])),
      "Date: {}; {} cores; op times summed over devices and cores, per "
      "traced step (see the module's docstring)".format(
          datetime.date.today().isoformat(), os.cpu_count()), ""] + sections)
  print("\n" + text)
  if args.record:
    with open(args.record, "w") as output:
      output.write(text + "\n")


def profile(model: str, config: configurations.Config, warmup: int,
            timed: int, traced: int) -> Profile:
  run = harness.build(model, config)
  tracer = _Tracer(warmup, timed, traced)
  run.estimator.train(run.input_fn, steps=10**9, hooks=[tracer])
  return Profile(
      graph_ops=tracer.graph_ops,
      step_ms=1000 * statistics.median(tracer.durations),
      ms_by_type={k: v / 1000 / traced for k, v in tracer.micros.items()},
      count_by_type={k: v / traced for k, v in tracer.counts.items()})


def markdown(model: str, profiles: Dict[str, Profile], top: int) -> str:
  """One model's section: a table per configuration, and what each adds."""
  lines = ["## {}".format(model), ""]
  reference_name = next(iter(profiles))
  reference = profiles[reference_name]
  for name, found in profiles.items():
    lines += [
        "### {}".format(name), "",
        "{:,} ops in the graph; {:,.0f} run a step, {:.2f} ms of op time a "
        "traced step; untraced step {:.2f} ms.".format(
            found.graph_ops, sum(found.count_by_type.values()),
            sum(found.ms_by_type.values()), found.step_ms), "",
        "| op type | ms a step | ops a step |", "|---|---|---|"]
    for op_type in _largest(found.ms_by_type, top):
      lines.append("| {} | {:.3f} | {:.0f} |".format(
          op_type, found.ms_by_type[op_type], found.count_by_type[op_type]))
    lines.append("")
    if found is reference:
      continue
    added = {t: found.ms_by_type.get(t, 0) - reference.ms_by_type.get(t, 0)
             for t in set(found.ms_by_type) | set(reference.ms_by_type)}
    lines += [
        "What {} adds to {}: {:+.2f} ms of op time and {:+.2f} ms of step "
        "time.".format(name, reference_name,
                       sum(added.values()), found.step_ms - reference.step_ms),
        "", "| op type | ms a step | ops a step |", "|---|---|---|"]
    for op_type in _largest({t: abs(v) for t, v in added.items()}, top):
      lines.append("| {} | {:+.3f} | {:+.0f} |".format(
          op_type, added[op_type],
          found.count_by_type.get(op_type, 0) -
          reference.count_by_type.get(op_type, 0)))
    lines.append("")
  return "\n".join(lines)


def _largest(values: Dict[str, float], top: int) -> List[str]:
  return sorted(values, key=values.get, reverse=True)[:top]


class _Tracer(tf.estimator.SessionRunHook):
  """Warms up, times untraced steps, then traces steps and stops."""

  def __init__(self, warmup, timed, traced):
    self._warmup, self._timed, self._traced = warmup, timed, traced
    self._step, self._last = 0, None
    self.durations = []
    self.micros = collections.Counter()
    self.counts = collections.Counter()
    self.graph_ops = 0

  def begin(self):
    self.graph_ops = len(tf.compat.v1.get_default_graph().get_operations())

  def before_run(self, run_context):
    self._last = time.perf_counter()
    if self._step >= self._warmup + self._timed:
      return tf.estimator.SessionRunArgs(
          None, options=tf.compat.v1.RunOptions(
              trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
    return None

  def after_run(self, run_context, run_values):
    elapsed = time.perf_counter() - self._last
    self._step += 1
    if self._warmup < self._step <= self._warmup + self._timed:
      self.durations.append(elapsed)
    if self._step > self._warmup + self._timed:
      self._add(run_values.run_metadata.step_stats)
    if self._step == self._warmup + self._timed + self._traced:
      run_context.request_stop()

  def _add(self, step_stats):
    for device in step_stats.dev_stats:
      for node in device.node_stats:
        match = _LABEL.match(node.timeline_label)
        if not match:
          continue  # _SOURCE and the like: no kernel ran
        self.micros[match.group(1)] += node.all_end_rel_micros
        self.counts[match.group(1)] += 1


if __name__ == "__main__":
  main()

"""python -m benchmarks [--quick]: replicate vs single device vs MirroredStrategy.

Times Estimator training of each model under each configuration on the same
global batch, repeats the whole grid, rotating the order of configurations
between repeats, and reports examples/sec with ratios paired within a repeat
(so the shared machine's noise cancels), each with its spread. Every
configuration reads the dynamic pipeline (`.batch(b)`, as users write it)
unless named `-static`; `single-again` measures `single` a second time, and
the ratio of the two (A/A) says how far the measurement alone moves a ratio.
Writes a markdown table to stdout, and results.json, examples_per_sec.png and
scaling.png to --output.

On the default grid: every configuration at N = 1, 2, 4, 8 on the dynamic
pipeline, `single` and `replicate-N-ps` also on the static one (x static),
and `single-again`; 5 repeats of cells measured for 1 s. `--quick`: N = 1,
2, 4, no `rr`, `gather`, `ring`, `handring`, 3 repeats of 0.5 s: about 6
minutes on 2 cores (`QUICK_TAKES`). A run prints its estimated length
first, from `harness.estimate_seconds` (`--estimate` prints only that), and
the time left after every cell.

On failures: a configuration whose training raises a TensorFlow error is
reported as failed, with the error's cause, and not run again. The one
seen: MirroredStrategy's default (collective) all-reduce on the
DNNClassifier's dynamic pipeline, "Shape mismatch in the collective
instance": the hashed embedding column's gradient is IndexedSlices of a
different length on each replica (with the same column as an indicator, or
on the static pipeline where the replicas' rows are the same, it runs). Its
row says it failed, as any other; its progress line says it failed as
expected and why, and TensorFlow's E-level lines of it are kept off the
terminal (`benchmarks.expected`).
"""

import os
import platform
import sys
import time

from benchmarks import cli
from benchmarks import configs as configurations


# How long --quick takes, as its help, the estimate it prints and
# docs/benchmarks.md say (a fresh clone's run took 6 min 13 s).
QUICK_TAKES = "about 6 minutes on 2 cores"


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  parser = cli.parser("python -m benchmarks", __doc__.splitlines()[0])
  add = parser.add_argument
  add("--quick", action="store_true",
      help="N up to 4, fewer configurations, 3 repeats of 0.5 s: " +
      QUICK_TAKES)
  add("--estimate", action="store_true",
      help="print how long the run would take, and stop")
  add("--models", metavar="NAMES",
      default=",".join(configurations.DEFAULT_MODELS),
      type=cli.comma_list(cli.checked(configurations.check_model),
                          twice=cli.ONCE),
      help="comma-separated, from: " + ", ".join(configurations.MODEL_NAMES))
  add("--towers", metavar="N,...", default=None,
      type=cli.comma_list(cli.whole_number(1), twice=cli.ONCE),
      help="comma-separated tower counts (default: 1,2,4,8; with --quick "
      "1,2,4)")
  add("--configs", metavar="NAMES", default=None,
      type=cli.comma_list(cli.checked(configurations.parse_config),
                          twice="to measure one twice, add it again with "
                          "-again (single-again)"),
      help="comma-separated configurations, overriding --towers (default: "
      "the grid of --towers); forms: " + configurations.CONFIG_FORMS)
  add("--repeats", metavar="N", type=cli.whole_number(1), default=None,
      help="repeats of the grid (default: 5; with --quick 3)")
  add("--seconds", metavar="S", type=cli.positive_number, default=None,
      help="measured seconds per cell (default: 1; with --quick 0.5)")
  add("--warmup", metavar="STEPS", type=cli.whole_number(1), default=5,
      help="untimed steps per cell")
  add("--output", metavar="DIR", default=os.path.join("benchmarks",
                                                      "results"),
      help="folder for results.json and the plots")
  add("--record", metavar="FILE", default=None,
      help="also write the table to this file, e.g. benchmarks/RESULTS.md "
      "(default: none)")
  return parser


if __name__ == "__main__":
  # --help and a bad flag answer before TensorFlow's import, which
  # takes seconds; main() parses the command line again.
  make_parser().parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from benchmarks import across_workers_report, results_md  # noqa: E402
from benchmarks import expected  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402


def main(argv=None):
  args = _parse_args(argv)
  configs = [configurations.parse_config(name) for name in args.configs]
  total = args.repeats * len(args.models) * len(configs)
  estimate = args.repeats * sum(
      harness.estimate_seconds(model, config, args.seconds)
      for model in args.models for config in configs)
  print("{} cells ({} repeats x {} models x {} configurations) of {} s "
        "measured: about {:.0f} minutes on 2 cores.".format(
            total, args.repeats, len(args.models), len(configs),
            args.seconds, estimate / 60), flush=True)
  if args.estimate:
    return
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  harness.prepare()
  cells = {model: {c.name: [] for c in configs} for model in args.models}
  failures = {model: {} for model in args.models}
  for model in args.models:
    MODELS[model].make_input_fn("dynamic", 1)  # its data, made once, untimed
  done, started, estimated_done = 0, time.perf_counter(), 0.0
  for repeat in range(args.repeats):
    for model in args.models:
      shift = repeat % len(configs)
      for config in configs[shift:] + configs[:shift]:
        if config.name in failures[model]:
          continue  # a failure repeats; its row says it failed
        done += 1
        outcome = harness.attempt(model, config, args.warmup, args.seconds)
        if outcome.failure:
          failures[model][config.name] = outcome.failure
          del cells[model][config.name]
          print("[{:>3}/{}] {:<15} {:<24} {}".format(
              done, total, model, config.name, failed_line(outcome)),
            flush=True)
          continue
        cell = outcome.cell
        cells[model][config.name].append(cell)
        elapsed = time.perf_counter() - started
        estimated_done += harness.estimate_seconds(model, config,
                                                   args.seconds)
        print("[{:>3}/{}] {:.0f}s, about {:.0f} min left  repeat {}  {:<15} "
              "{:<24} {:>10,.0f} examples/sec (window {:,.0f})  {} steps  "
              "build {:.2f}s  cell {:.1f}s".format(
                  done, total, elapsed,
                  (estimate - estimated_done) * elapsed / estimated_done / 60,
                  repeat + 1, model, config.name, cell.examples_per_second,
                  cell.window_examples_per_second, cell.steps,
                  cell.build_seconds, cell.cell_seconds), flush=True)
  machine = _machine()
  command = "python -m benchmarks " + " ".join(
      argv if argv is not None else sys.argv[1:])
  table = report.markdown(cells, failures, configs, command, machine)
  print("\n" + table)
  os.makedirs(args.output, exist_ok=True)
  report.write_json(os.path.join(args.output, "results.json"), cells,
                    failures, command, machine)
  report.plot(os.path.join(args.output, "examples_per_sec.png"),
              os.path.join(args.output, "scaling.png"), cells, failures,
              configs, machine)
  if args.record:
    # The `## Across workers` section comes from another command
    # (`benchmarks.across_workers`); a new grid keeps it.
    kept = ""
    if os.path.exists(args.record):
      with open(args.record) as results:
        kept = results_md.kept_section(
            results.read(), across_workers_report.SECTION)
    with open(args.record, "w") as results:
      results.write(results_md.replace_section(
          table, kept, across_workers_report.SECTION) if kept
                    else table)
  print("Wrote {} (results.json, examples_per_sec.png, scaling.png){}".format(
      args.output, " and " + args.record if args.record else ""))


def failed_line(outcome):
  """What the progress line says of a failed cell, after its names."""
  if not outcome.as_expected:
    return "failed: " + outcome.failure
  return ("failed as expected: {} ({}; {} TensorFlow error line{} "
          "hidden)".format(expected.WHY, expected.CAUSE, outcome.hidden,
                           "" if outcome.hidden == 1 else "s"))


def _parse_args(argv):
  args = make_parser().parse_args(argv)
  towers = args.towers or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
  args.configs = args.configs or _default_configs(towers, args.quick)
  args.repeats = args.repeats or (3 if args.quick else 5)
  args.seconds = args.seconds or (0.5 if args.quick else 1.0)
  return args


def _default_configs(towers, is_quick):
  """The grid; `single-again` mid-way, so the A/A twins are apart in time."""
  variants = (["ps", "ps-static"] if is_quick else
              ["ps", "ps-static", "rr", "gather", "ring", "handring"])
  configs = ["single", "single-static"]
  for n in towers:
    if n == 1:
      configs += [] if is_quick else ["replicate-1-ps",
                                      "replicate-1-ps-static"]
      continue
    configs += ["replicate-{}-{}".format(n, v) for v in variants]
    configs += ["mirrored-{}-default".format(n), "mirrored-{}-r1d".format(n)]
  configs.insert(len(configs) // 2, "single-again")
  return configs


def _machine():
  gpus = tf.config.list_physical_devices("GPU")
  return "{} cores, {}, Python {}, TensorFlow {}, {}".format(
      os.cpu_count(), platform.machine(), platform.python_version(),
      tf.__version__,
      "{} GPUs".format(len(gpus)) if gpus else "virtual CPU devices (no GPU)")


if __name__ == "__main__":
  main()

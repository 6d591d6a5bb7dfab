"""python -m benchmarks [--quick]: replicate vs single device vs MirroredStrategy.

Times Estimator training of each model under each configuration on the same
global batch, repeats the whole grid, rotating the order of configurations
between repeats, and reports examples/sec with ratios paired within a repeat
(so the shared machine's noise cancels). Writes a markdown table to stdout,
and results.json, examples_per_sec.png and scaling.png to --output.
"""

import argparse
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402


def main(argv=None):
  args = _parse_args(argv)
  try:
    configs = [harness.parse_config(name) for name in args.configs]
    for model in args.models:
      harness.check_model(model)
  except ValueError as error:
    sys.exit("python -m benchmarks: error: {}".format(error))
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  harness.prepare()
  cells = {model: {c.name: [] for c in configs} for model in args.models}
  total = args.repeats * len(args.models) * len(configs)
  done, started = 0, time.perf_counter()
  for repeat in range(args.repeats):
    for model in args.models:
      steps = max(5, int(MODELS[model].measured_steps * args.step_scale))
      shift = repeat % len(configs)
      for config in configs[shift:] + configs[:shift]:
        cell = harness.run_cell(model, config, args.warmup, steps)
        cells[model][config.name].append(cell)
        done += 1
        print("[{:>3}/{}] {:.0f}s  repeat {}  {:<15} {:<20} {:>10,.0f} "
              "examples/sec  build {:.2f}s  cpu/wall {:.2f}".format(
                  done, total, time.perf_counter() - started, repeat + 1,
                  model, config.name, cell.examples_per_second,
                  cell.build_seconds, cell.cpu_per_wall), flush=True)
  machine = _machine()
  command = "python -m benchmarks " + " ".join(
      argv if argv is not None else sys.argv[1:])
  table = report.markdown(cells, configs, command, machine)
  print("\n" + table)
  os.makedirs(args.output, exist_ok=True)
  report.write_json(os.path.join(args.output, "results.json"), cells,
                    command, machine)
  report.plot(os.path.join(args.output, "examples_per_sec.png"),
              os.path.join(args.output, "scaling.png"), cells, configs)
  if args.record:
    with open(args.record, "w") as results:
      results.write(table)
  print("Wrote {} (results.json, examples_per_sec.png, scaling.png){}".format(
      args.output, " and " + args.record if args.record else ""))


def _parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="N up to 4, 2 repeats, fewer steps: under 5 "
                      "minutes on 2 cores")
  parser.add_argument("--models", default=",".join(MODELS),
                      help="comma-separated, from: " + ", ".join(MODELS))
  parser.add_argument("--towers", default=None,
                      help="comma-separated tower counts (default 1,2,4,8; "
                      "quick: 1,2,4)")
  parser.add_argument("--configs", default=None,
                      help="comma-separated configurations, overriding "
                      "--towers; forms: " + harness.CONFIG_FORMS)
  parser.add_argument("--repeats", type=int, default=None,
                      help="repeats of the grid (default 3; quick: 2)")
  parser.add_argument("--warmup", type=int, default=5,
                      help="untimed steps per cell (default 5)")
  parser.add_argument("--output", default=os.path.join("benchmarks",
                                                       "results"),
                      help="folder for results.json and the plots")
  parser.add_argument("--record", default=None,
                      help="also write the table to this file, e.g. "
                      "benchmarks/RESULTS.md")
  args = parser.parse_args(argv)
  args.models = [m for m in args.models.split(",") if m]
  towers = [int(n) for n in (args.towers or (
      "1,2,4" if args.quick else "1,2,4,8")).split(",")]
  args.configs = (args.configs.split(",") if args.configs else
                  _default_configs(towers))
  args.repeats = args.repeats or (2 if args.quick else 3)
  args.step_scale = 0.3 if args.quick else 1.0
  if args.repeats < 1 or args.warmup < 1:
    parser.error("--repeats and --warmup must be at least 1")
  return args


def _default_configs(towers):
  configs = ["single"]
  for n in towers:
    configs += ["replicate-{}-ps".format(n)]
    if n > 1:
      configs += ["replicate-{}-rr".format(n),
                  "replicate-{}-gather".format(n),
                  "replicate-{}-ring".format(n),
                  "replicate-{}-handring".format(n),
                  "mirrored-{}-default".format(n),
                  "mirrored-{}-r1d".format(n)]
  return configs


def _machine():
  gpus = tf.config.list_physical_devices("GPU")
  return "{} cores, {}, Python {}, TensorFlow {}, {}".format(
      os.cpu_count(), platform.machine(), platform.python_version(),
      tf.__version__,
      "{} GPUs".format(len(gpus)) if gpus else "virtual CPU devices (no GPU)")


if __name__ == "__main__":
  main()

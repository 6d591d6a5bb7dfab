"""Global steps per second of a local cluster with 1 worker and with 2.

    python -m benchmarks.cluster [--steps 3000] [--repeats 2]

Runs `examples/cluster_demo.py` on 1 ps + the chief (1 worker) and on 1 ps
+ chief + 1 worker (2 workers), alternating, through `replicate.launch`,
and prints each run's global steps per second as the chief measured it
(between its first and last step) and the ratio 2 workers / 1 worker per
repeat. All tasks share this machine's cores, so the ratio measures how
much a second worker adds here, not on separate machines.
"""

import io
import json
import os
import statistics
import sys
import tempfile

from benchmarks import cli
from replicate.launch import LocalCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "cluster_demo.py")


def main(argv=None):
  args = make_parser().parse_args(argv)
  rates = {1: [], 2: []}
  for repeat in range(args.repeats):
    order = (1, 2) if repeat % 2 == 0 else (2, 1)
    for workers in order:
      rate = _run(workers, args.steps)
      rates[workers].append(rate)
      print("repeat {} workers {}: {:.1f} global steps/sec".format(
          repeat + 1, workers, rate), flush=True)
  ratios = [two / one for one, two in zip(rates[1], rates[2])]
  print("\n| workers | global steps/sec (median) |\n| --- | --- |")
  for workers, values in rates.items():
    print("| {} | {:.1f} |".format(workers, statistics.median(values)))
  print("\n2 workers / 1 worker, per repeat: {}".format(
      ", ".join("{:.2f}".format(r) for r in ratios)))
  return 0


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  parser = cli.parser("python -m benchmarks.cluster", __doc__.splitlines()[0])
  parser.add_argument("--steps", metavar="N", type=cli.whole_number(1),
                      default=3000, help="global steps each cluster trains")
  parser.add_argument("--repeats", metavar="N", type=cli.whole_number(1),
                      default=2,
                      help="runs of each cluster, 1 and 2 workers alternating")
  return parser


def _run(workers, steps):
  """One cluster run; the chief's global steps per second."""
  log = io.StringIO()
  command = [sys.executable, DEMO, "--model-dir",
             tempfile.mkdtemp(prefix="replicate_cluster_"), "--steps",
             str(steps)]
  env = {"PYTHONPATH": ROOT + os.pathsep + os.path.join(ROOT, "examples")}
  with LocalCluster(command, num_ps=1, num_workers=workers, env=env,
                    log=log) as cluster:
    code = cluster.wait_for_chief(grace=60)
  text = log.getvalue()
  if code != 0:
    raise RuntimeError("The chief exited with {}:\n{}".format(
        code, text[-5000:]))
  for line in text.splitlines():
    if line.startswith("[chief:0] {"):
      return json.loads(line[len("[chief:0] "):])["global_steps_per_second"]
  raise RuntimeError("The chief printed no rate:\n" + text[-5000:])


if __name__ == "__main__":
  sys.exit(main())

"""python -m benchmarks.split_cost: what splitting the batch costs a layer.

The profile (`benchmarks.profile`) sums each op's own time, which cannot
say how much slower a matrix product gets when towers share the cores and
each gets a slice of the batch: ops running side by side each take longer
without doing more work. This times that directly, on one device and with
no wrapper: a dense layer of the MLP (`--inputs` x `--units`, the global
batch of 256 rows) computes its forward product and its weight gradient
(`x^T dy`) on the whole batch, then on N slices of it (N products of each
kind, as N towers make), then on N slices with the weight gradients summed
(`add_n`, as towers' gradients are). Each is a session run of its own,
interleaved in rounds; the ratios are paired within a round. Writes a
markdown table to stdout (and to --record).
"""

import datetime
import os
import statistics
import sys
import time

from benchmarks import cli


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  parser = cli.parser("python -m benchmarks.split_cost",
                      __doc__.splitlines()[0])
  parser.add_argument("--towers", metavar="N,...", default="1,2,4,8",
                      type=cli.comma_list(cli.whole_number(1),
                                          twice=cli.ONCE),
                      help="comma-separated numbers of slices; must include "
                      "1 (the whole batch, the reference) and divide --batch")
  parser.add_argument("--batch", metavar="ROWS", type=cli.whole_number(1),
                      default=256, help="rows of the whole batch")
  parser.add_argument("--inputs", metavar="N", type=cli.whole_number(1),
                      default=1024, help="the layer's inputs")
  parser.add_argument("--units", metavar="N", type=cli.whole_number(1),
                      default=1024, help="the layer's outputs")
  parser.add_argument("--rounds", metavar="N", type=cli.whole_number(1),
                      default=15,
                      help="rounds of 20 steps per variant, interleaved")
  parser.add_argument("--record", metavar="FILE", default=None,
                      help="also write the table to this file, e.g. "
                      "benchmarks/SPLIT_COST.md (default: none)")
  return parser


if __name__ == "__main__":
  # --help and a bad flag answer before TensorFlow's import, which
  # takes seconds; main() parses the command line again.
  make_parser().parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402


def main(argv=None):
  parser = make_parser()
  args = parser.parse_args(argv)
  towers = args.towers
  if 1 not in towers or any(args.batch % n for n in towers):
    parser.error("argument --towers: must include 1 (the reference) and "
                 "divide --batch ({}) evenly; got {}".format(
                     args.batch, ",".join(str(n) for n in towers)))
  tf.compat.v1.disable_eager_execution()
  session, fetches = _graph(towers, args.batch, args.inputs, args.units)
  ms = _time(session, fetches, args.rounds)
  whole = ms[(1, False)]
  lines = ["| N | rows a slice | products ms | x whole batch | with the sum "
           "ms | x whole batch |", "|---|---|---|---|---|---|"]
  for n in towers:
    lines.append("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |".format(
        n, args.batch // n, statistics.median(ms[(n, False)]),
        _paired(ms[(n, False)], whole), statistics.median(ms[(n, True)]),
        _paired(ms[(n, True)], whole)))
  table = "\n".join([
      "# Splitting the batch, one layer on one device", "",
      "Command: `python -m benchmarks.split_cost {}`  ".format(" ".join(
          argv if argv is not None else sys.argv[1:])),
      "Date: {}; {} cores".format(datetime.date.today().isoformat(),
                                  os.cpu_count()), "",
      "A {} x {} dense layer, {} rows: its forward product and weight "
      "gradient on N slices, without and with the weight gradients summed; "
      "milliseconds a step, median over {} rounds of 20; x whole batch: "
      "time against N = 1's without the sum, median of ratios paired "
      "within a round.".format(args.inputs, args.units, args.batch,
                               args.rounds), ""] + lines)
  print(table)
  if args.record:
    with open(args.record, "w") as output:
      output.write(table + "\n")


def _graph(towers, batch, inputs, units):
  """A session and, per (N, summed), a fetch making that step's products."""
  graph = tf.Graph()
  fetches = {}
  with graph.as_default():
    weights = tf.compat.v1.get_variable("weights", [inputs, units])
    rows = tf.compat.v1.get_variable("rows", [batch, inputs]).read_value()
    upstream = tf.compat.v1.get_variable("upstream",
                                         [batch, units]).read_value()
    for n in towers:
      slices, gradients = tf.split(rows, n), tf.split(upstream, n)
      outputs = [tf.matmul(x, weights) for x in slices]
      weight_gradients = [tf.matmul(x, dy, transpose_a=True)
                          for x, dy in zip(slices, gradients)]
      # One element of each result: a data dependency on every product (a
      # tf.group would let grappler prune them) at a negligible cost.
      used = [o[0, 0] for o in outputs]
      fetches[(n, False)] = tf.add_n(used + [w[0, 0]
                                             for w in weight_gradients])
      fetches[(n, True)] = tf.add_n(used + [tf.add_n(weight_gradients)[0, 0]])
    init = tf.compat.v1.global_variables_initializer()
  session = tf.compat.v1.Session(graph=graph)
  session.run(init)
  return session, fetches


def _time(session, fetches, rounds):
  for fetch in fetches.values():  # warm-up: oneDNN picks its kernels
    for _ in range(10):
      session.run(fetch)
  ms = {key: [] for key in fetches}
  for _ in range(rounds):
    for key, fetch in fetches.items():
      started = time.perf_counter()
      for _ in range(20):
        session.run(fetch)
      ms[key].append(1000 * (time.perf_counter() - started) / 20)
  return ms


def _paired(times, reference):
  return statistics.median(t / r for t, r in zip(times, reference))


if __name__ == "__main__":
  main()

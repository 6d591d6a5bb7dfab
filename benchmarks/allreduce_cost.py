"""python -m benchmarks.allreduce_cost: one all-reduce, timed alone.

Where the end-to-end tables say that `replicated` with the collective
`ring` is slower than with `gather` or the hand-written ring, this says
why: it times `replicate.communication.allreduce.all_reduce_grads` by itself, per
algorithm, on dense float32 tensors of a given size (the MLP's gradients,
or a single tensor of 1,000 to 4,000,000 elements) on N devices, with the
configurations interleaved in one process and the ratios paired within a
round. Writes a markdown table to stdout (and to --record).
"""

import contextlib
import datetime
import os
import statistics
import sys
import time

from benchmarks import cli

# name: the shapes of one tower's gradients
TENSORS = {
    "1k": [[1000]],
    "100k": [[100_000]],
    "1m": [[1_000_000]],
    "4m": [[4_000_000]],
    "mlp": [[784, 1024], [1024], [1024, 1024], [1024], [1024, 10], [10]],
}


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  parser = cli.parser("python -m benchmarks.allreduce_cost",
                      __doc__.splitlines()[0])
  parser.add_argument("--towers", metavar="N,...", default="2,4,8",
                      type=cli.comma_list(cli.whole_number(2),
                                          twice=cli.ONCE),
                      help="comma-separated numbers of devices, 2 or more")
  parser.add_argument("--tensors", metavar="NAMES",
                      default=",".join(TENSORS),
                      type=cli.comma_list(cli.one_of(TENSORS),
                                          twice=cli.ONCE),
                      help="comma-separated gradient sets: a single tensor "
                      "of 1k to 4m float32 elements, or the MLP's gradients")
  parser.add_argument("--rounds", metavar="N", type=cli.whole_number(1),
                      default=15,
                      help="rounds of 5 all-reduces per algorithm, "
                      "interleaved")
  parser.add_argument("--record", metavar="FILE", default=None,
                      help="also write the table to this file, e.g. "
                      "benchmarks/ALLREDUCE_COST.md (default: none)")
  return parser


if __name__ == "__main__":
  # --help and a bad flag answer before TensorFlow's import, which
  # takes seconds; main() parses the command line again.
  make_parser().parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from benchmarks import hand_ring  # noqa: E402
from replicate.communication import allreduce  # noqa: E402

# name: (the all_reduce algorithm, whether the hand ring replaces its sums)
ALGORITHMS = {"gather": (allreduce.GATHER, False),
              "ring": (allreduce.RING, False),
              "handring": (allreduce.GATHER, True)}


def main(argv=None):
  args = make_parser().parse_args(argv)
  tf.compat.v1.disable_eager_execution()
  lines = [
      "| tensors | N | gather ms | ring ms | handring ms | ring x gather "
      "| ring x handring |", "|---|---|---|---|---|---|---|"]
  for name in args.tensors:
    for towers in args.towers:
      ms = _time_algorithms(TENSORS[name], towers, args.rounds)
      lines.append("| {} | {} | {} | {:.2f} | {:.2f} |".format(
          name, towers, " | ".join("{:.2f}".format(statistics.median(
              ms[a])) for a in ALGORITHMS),
          _paired(ms["gather"], ms["ring"]),
          _paired(ms["handring"], ms["ring"])))
      print(lines[-1], flush=True)
  table = "\n".join([
      "# One all-reduce, timed alone", "",
      "Command: `python -m benchmarks.allreduce_cost {}`  ".format(
          " ".join(argv if argv is not None else sys.argv[1:])),
      "Date: {}; {} virtual CPU devices over {} cores".format(
          datetime.date.today().isoformat(),
          ",".join(str(n) for n in args.towers), os.cpu_count()),
      "",
      "Milliseconds per all-reduce (median over {} rounds of 5). ring x "
      "gather: ring's speed against gather's (gather's time / ring's), "
      "median of ratios paired within a round; likewise ring x "
      "handring.".format(args.rounds), ""] + lines)
  print("\n" + table)
  if args.record:
    with open(args.record, "w") as output:
      output.write(table + "\n")


def _time_algorithms(shapes, towers, rounds):
  """{algorithm: [ms per all-reduce, one per round]}, interleaved."""
  sessions = {name: _session(shapes, towers, *algorithm)
              for name, algorithm in ALGORITHMS.items()}
  times = {name: [] for name in sessions}
  for _ in range(rounds):
    for name, (session, fetch) in sessions.items():
      started = time.perf_counter()
      for _ in range(5):
        session.run(fetch)
      times[name].append(1000 * (time.perf_counter() - started) / 5)
  for session, _ in sessions.values():
    session.close()
  return times


def _session(shapes, towers, algorithm, by_hand_ring):
  """A session running one all-reduce of `shapes` per tower; warmed up."""
  graph = tf.Graph()
  devices = ["/device:CPU:{}".format(i) for i in range(towers)]
  with graph.as_default():
    per_tower = []
    for tower, device in enumerate(devices):
      with tf.device(device):
        per_tower.append([
            tf.compat.v1.get_variable("t{}_{}".format(tower, index), shape)
            .read_value() for index, shape in enumerate(shapes)])
    with (allreduce.gather_reduce_replaced(hand_ring.reduce)
          if by_hand_ring else contextlib.nullcontext()):
      summed = allreduce.all_reduce_grads(per_tower, devices, algorithm)
    # One element of each sum, added: a data dependency on every sum (a
    # `tf.group` of them would let grappler turn the unused sums into
    # no-ops), and a fetch of negligible cost.
    fetch = tf.math.add_n([tf.reshape(t, [-1])[0] for tower in summed
                           for t in tower])
    init = tf.compat.v1.global_variables_initializer()
  session = tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(
      device_count={"CPU": towers}))
  session.run(init)
  for _ in range(5):
    session.run(fetch)
  return session, fetch


def _paired(others, ring):
  return statistics.median(o / r for o, r in zip(others, ring))


if __name__ == "__main__":
  main()

"""python -m benchmarks.build_time: the wrapped graph's build against N
unwrapped builds.

Builds the Transformer of `benchmarks.transformer_model` (TRAIN: the
forward pass, the loss, Adam's update) unwrapped, once, and wrapped by
`replicate_model_fn` on N towers, each in a new graph, `--repeats` times
in turn, and reports the fastest of each: the wrapped build's time over N
times the unwrapped one's. N unwrapped builds are what the towers
themselves cost (each tower calls the `model_fn`), so the ratio is the
wrapper's own work on top: sharding, the rows rule's analysis of every op,
the gradients' sum and the one update. Also the graphs' op counts, whose
ratio the time should follow if the analysis is linear in the graph.

Only graph construction is timed; nothing runs, so the towers' devices
(`/cpu:0` ... `/cpu:N-1`) need not exist.
"""

import os
import sys
import time

from benchmarks import cli

DEFAULT_TOWERS = (2, 3, 8)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  rows = measure(args.configs, args.towers, args.repeats, args.ffn_pad)
  print(table(rows))
  return 0


def measure(configs, towers, repeats, ffn_pad=True):
  """[(config, towers, seconds, ops, unwrapped seconds, unwrapped ops)]."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  rows = []
  for config in configs:
    best = {}
    for _ in range(repeats):  # in turn, so that the machine's load is shared
      for count in (1,) + tuple(towers):
        seconds, ops = _build(config, count, ffn_pad)
        if count not in best or seconds < best[count][0]:
          best[count] = (seconds, ops)
    one_seconds, one_ops = best[1]
    rows.extend((config, count, best[count][0], best[count][1], one_seconds,
                 one_ops) for count in towers)
  return rows


def table(rows) -> str:
  """A markdown table of `measure`'s rows."""
  lines = ["| config | towers | wrapped build (s) | N x unwrapped (s) | "
           "ratio | ops ratio |", "| --- | --- | --- | --- | --- | --- |"]
  for config, count, seconds, ops, one_seconds, one_ops in rows:
    lines.append("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |".format(
        config, count, seconds, count * one_seconds,
        seconds / (count * one_seconds), ops / (count * one_ops)))
  return "\n".join(lines)


def _build(config, towers, ffn_pad):
  """(seconds, ops) of one TRAIN build, unwrapped when `towers` is 1."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import replicate  # pylint: disable=import-outside-toplevel
  from benchmarks import transformer_model  # pylint: disable=import-outside-toplevel
  params = transformer_model.params_of(config, allow_ffn_pad=ffn_pad)
  model_fn = transformer_model.model_fn
  if towers > 1:
    model_fn = replicate.replicate_model_fn(
        model_fn, devices=["/cpu:%d" % i for i in range(towers)])
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    inputs = tf.compat.v1.placeholder(tf.int32, [None, None], "inputs")
    targets = tf.compat.v1.placeholder(tf.int32, [None, None], "targets")
    start = time.perf_counter()
    model_fn(features={"inputs": inputs}, labels=targets,
             mode=tf.estimator.ModeKeys.TRAIN, params=params)
    seconds = time.perf_counter() - start
    return seconds, len(graph.get_operations())


def _parser():
  parser = cli.parser("python -m benchmarks.build_time",
                      __doc__.split("\n\n")[0])
  parser.add_argument("--configs", default=["tiny", "base"],
                      type=cli.comma_list(cli.one_of(["tiny", "base"]),
                                          twice=cli.ONCE),
                      help="Transformer configurations, comma-separated")
  parser.add_argument("--towers", default=list(DEFAULT_TOWERS),
                      type=cli.comma_list(cli.whole_number(2),
                                          twice=cli.ONCE),
                      help="tower counts, comma-separated")
  parser.add_argument("--repeats", default=3, type=cli.whole_number(),
                      help="builds of each, the fastest kept")
  parser.add_argument("--no-ffn-pad", dest="ffn_pad", action="store_false",
                      help="the feed-forward network on every position "
                      "(allow_ffn_pad=False), without the padding removal")
  return parser


if __name__ == "__main__":
  sys.exit(main())

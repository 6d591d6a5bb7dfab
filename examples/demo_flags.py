"""The demos' command lines, apart from TensorFlow.

Each demo parses its command line before it imports TensorFlow (which
takes seconds), so that `--help` and a bad flag answer at once; this
module imports argparse alone.
"""

import argparse


def digits_parser(description):
  """digits_demo.py's command line."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument(
      "--towers", metavar="N", type=positive, default=2,
      help="towers on a machine without GPUs: this many virtual CPU devices "
      "(default: %(default)s); with GPUs every GPU is used")
  parser.add_argument("--steps", metavar="N", type=positive, default=600,
                      help="training steps (default: %(default)s)")
  parser.add_argument("--batch-size", metavar="ROWS", type=positive,
                      default=128, help="global batch size, split across "
                      "towers (default: %(default)s)")
  parser.add_argument(
      "--model-dir", metavar="DIR", default=None,
      help="where checkpoints and the SavedModel go (default: a new "
      "temporary folder, named in the summary)")
  return parser


def cluster_parser(description):
  """cluster_demo.py's command line."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--model-dir", metavar="DIR", required=True,
                      help="shared by every task: checkpoints go here "
                      "(required)")
  parser.add_argument("--steps", metavar="N", type=positive, default=3000,
                      help="global steps to train (default: %(default)s)")
  parser.add_argument("--batch-size", metavar="ROWS", type=positive,
                      default=128,
                      help="each worker's batch (default: %(default)s)")
  parser.add_argument("--progress-every", metavar="STEPS", type=positive,
                      default=500, help="global steps between the chief's "
                      "progress lines (default: %(default)s)")
  return parser


def positive(text):
  """An argparse type: a whole number of at least 1.

  It raises ArgumentTypeError, which argparse reports naming the flag.
  """
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(
        "must be a whole number of at least 1; received {!r}".format(text))
  return value

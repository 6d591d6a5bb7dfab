"""`python -m replicate.check MODULE:MODEL_FN MODULE:INPUT_FN [...]`.

Prints the report's table; exit status 0 when every run equals one
device, 1 when something differs or is refused, 2 for bad arguments.
The arguments are parsed before TensorFlow is imported, so `--help`
answers at once. MODULE is imported from the current directory, as `python
-m` users expect (`mymodel:model_fn`, `pkg.mymodel:model_fn`).
"""

import argparse
import importlib
import json
import os
import sys


def parse(argv):
  parser = argparse.ArgumentParser(
      prog="python -m replicate.check",
      description="Compare a model_fn on N towers (replicate_model_fn) with "
      "the same model_fn on one device, on the first batches of its "
      "input_fn; print the first op that differs, with its source line.")
  parser.add_argument("model_fn", help="MODULE:FUNCTION, the unwrapped "
                      "model_fn (its optimizer in replicate.TowerOptimizer)")
  parser.add_argument("input_fn", help="MODULE:FUNCTION, the training "
                      "input_fn")
  parser.add_argument("--eval-input-fn", metavar="MODULE:FN",
                      help="the input_fn of evaluation and prediction "
                      "(default: the training batches)")
  parser.add_argument("--params", type=json.loads, default=None,
                      metavar="JSON", help="the Estimator's params, as JSON")
  parser.add_argument("--towers", default="2", metavar="N,...",
                      help="tower counts to compare (default 2)")
  parser.add_argument("--strategies", default="parameter_server",
                      metavar="S,...", help="variable strategies: "
                      "parameter_server, round_robin, replicated")
  parser.add_argument("--steps", type=int, default=3,
                      help="batches to compare (default 3)")
  parser.add_argument("--modes", default="train,eval,predict",
                      help="modes to compare (default train,eval,predict)")
  parser.add_argument("--json", metavar="FILE",
                      help="also write the report as JSON to FILE")
  args = parser.parse_args(argv)
  try:
    args.towers = tuple(int(n) for n in args.towers.split(","))
  except ValueError:
    parser.error("--towers {!r}: expected counts, e.g. 2,3".format(
        args.towers))
  args.strategies = tuple(s for s in args.strategies.split(",") if s)
  args.modes = tuple(m for m in args.modes.split(",") if m)
  return parser, args


def load(parser, spec):
  """MODULE:FUNCTION, MODULE imported from the current directory."""
  module, _, name = spec.partition(":")
  if not module or not name:
    parser.error("{!r}: expected MODULE:FUNCTION, e.g. mymodel:model_fn"
                 .format(spec))
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  try:
    found = importlib.import_module(module)
  except ImportError as error:
    parser.error("cannot import {!r} from {}: {}".format(module, os.getcwd(),
                                                        error))
  for part in name.split("."):
    if not hasattr(found, part):
      parser.error("{!r} has no {!r}".format(module, name))
    found = getattr(found, part)
  return found


def main(argv=None) -> int:
  parser, args = parse(sys.argv[1:] if argv is None else argv)
  model_fn = load(parser, args.model_fn)
  input_fn = load(parser, args.input_fn)
  eval_input_fn = (load(parser, args.eval_input_fn)
                   if args.eval_input_fn else None)
  from replicate.check import checking  # pylint: disable=import-outside-toplevel
  try:
    report = checking.check(
        model_fn, input_fn, towers=args.towers, strategies=args.strategies,
        steps=args.steps, params=args.params, eval_input_fn=eval_input_fn,
        modes=args.modes)
  except ValueError as error:
    print("replicate.check: {}".format(error), file=sys.stderr)
    return 2
  print(report)
  if args.json:
    with open(args.json, "w") as out:
      out.write(report.to_json())
  return 0 if report.exact else 1


if __name__ == "__main__":
  sys.exit(main())

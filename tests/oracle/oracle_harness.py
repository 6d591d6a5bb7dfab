"""The oracle: every cell of zoo x pipeline x towers x strategy x mode.

A cell trains, evaluates, predicts or exports one zoo model through one
input pipeline, wrapped with `replicate_model_fn` on N virtual CPU devices
(`RunConfig(session_config=ConfigProto(device_count={'CPU': N}))`, one
tower per device) with one `variable_strategy`, and compares the result with
the unwrapped `model_fn` on one device, the oracle:
- both start from the same checkpoint: the unwrapped estimator trained one
  step on all the rows, copied into each `model_dir` (Keras initializers
  draw their seeds from Python's `random`); a model with
  `warm_start=False` instead starts from its initial values, seeded before
  each Estimator as docs/guarantees.md says;
- "train": trains through the pipeline (at least 2 steps), then every
  variable of the checkpoint (optimizer slots, accumulators, averages and
  the global step included) must equal the oracle's;
- "eval": every key `evaluate` returns;
- "predict": every key of every prediction, row by row;
- "export": `export_saved_model` (raw tensors, or parsed `tf.Example`s for
  the "tf_example" pipeline), then every output of every signature served
  for batches of 1 and 7 rows, against the unwrapped model's export served
  the same way. Exports are served by a separate Python process that never
  builds a training graph: each one is loaded into a new graph and a
  session with one CPU and no soft placement, as a serving machine would
  (one process for the run, not one per export, which would cost a
  TensorFlow import, ~3 s, per cell).
"Equal" is to 1e-5 (absolute plus relative; NaN equals NaN); anything not a
number must be identical. A cell either equals the oracle or is refused
with a `ValueError` listed in `EXPECTED_REFUSALS`.

Towers: "1", "2" and "3" on the 7 rows in batches of 3 (7 = 3 + 3 + 1, so
the remainder batch already leaves towers without rows); "3_small": 3
towers on the first 2 rows in batches of 2, a batch smaller than the towers
in every pipeline.
"""

import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Tuple

import numpy as np
import pytest
import tensorflow as tf

from replicate.check import compare
import oracle_pairwise
import oracle_pipelines as pipelines
from oracle_zoo import ROWS, ZOO

TOWERS = {"1": (1, ROWS, 3), "2": (2, ROWS, 3), "3": (3, ROWS, 3),
          "3_small": (3, 2, 2)}  # towers, rows, batch size
STRATEGIES = ("parameter_server", "round_robin", "replicated")
MODES = ("train", "eval", "predict", "export")
FACTORS = (("model", tuple(ZOO)), ("pipeline", pipelines.PIPELINES),
           ("towers", tuple(TOWERS)), ("strategy", STRATEGIES),
           ("mode", MODES))
SERVING_SIZES = (1, 7)
TOLERANCE = 1e-5

# The published refusals: (zoo model, condition) -> a substring of the
# ValueError the wrapper must raise for every cell the condition holds for.
# A condition is "*" or "factor=value" terms joined by "&", e.g.
# "mode=train&towers=3". Empty: no refusal is expected yet.
# Refused on more than one tower (one tower forwards every call), with the
# fix in the message. The README lists them.
_ON_TOWERS = ("2", "3", "3_small")
_IN_TF_COND = "inside a tf.cond, a tf.while_loop or a tf.function"
EXPECTED_REFUSALS: Dict[Tuple[str, str], str] = {
    # The optimizer call sits in tf.cond: a NaN guard, and an accumulator
    # applied every second step.
    **{(model, "mode=train&towers=" + towers): _IN_TF_COND
       for model in ("nan_guard", "gradient_accumulation")
       for towers in _ON_TOWERS},
    # BERT's own tf.gradients(loss, tvars) differentiates with respect to
    # tower 0's variables, where "replicated" trains each tower's copies:
    # the message says to take compute_gradients' gradients and variables.
    **{("bert_adamw", "mode=train&strategy=replicated&towers=" + towers):
       "variable_strategy='replicated': tower 1 applies a gradient for tower "
       "0's variable" for towers in _ON_TOWERS},
}


@dataclasses.dataclass(frozen=True)
class Cell:
  model: str
  pipeline: str
  towers: str
  strategy: str
  mode: str

  def __str__(self):
    return "-".join(dataclasses.astuple(self))

  @property
  def tower_count(self) -> int:
    return TOWERS[self.towers][0]

  @property
  def rows(self) -> int:
    return TOWERS[self.towers][1]

  @property
  def batch(self) -> int:
    return TOWERS[self.towers][2]


def model_factors(model: str):
  """FACTORS with model `model`, each other factor restricted to the values
  the model's cells take (`ZooModel.only`)."""
  only = ZOO[model].only
  return [(name, (model,) if name == "model" else
           tuple(value for value in values if value in only.get(name, values)))
          for name, values in FACTORS]


def cells(full: bool) -> List[Cell]:
  """The whole cross, or a pairwise-covering sample of it.

  A model restricted by `ZooModel.only` takes only the values it names. The
  sample is `oracle_pairwise.pairwise(FACTORS)` over the unrestricted
  models, plus, for each restricted model, the fewest cells that give it
  each of its values of every factor once at least (the pairs of the other
  factors' values are the unrestricted models' to cover), plus, for each
  model it trains on one tower only, one TRAIN cell on 3 towers with its
  first pipeline ("batch" where it may: batches of 3, 3, 1: even shards,
  then towers without rows): training on several towers is what the wrapper
  is for, and pairs alone do not promise it.
  """
  if full:
    return [Cell(*values) for model in ZOO for values in itertools.product(
        *(values for _, values in model_factors(model)))]
  free = tuple(model for model in ZOO if not ZOO[model].only)
  sample = [Cell(**row) for row in oracle_pairwise.pairwise(
      (("model", free),) + FACTORS[1:])]
  for model in ZOO:
    if model not in free:
      values = [values for _, values in model_factors(model)]
      sample.extend(Cell(*(options[index % len(options)]
                           for options in values))
                    for index in range(max(map(len, values))))
  trained = {cell.model for cell in sample
             if cell.mode == "train" and cell.tower_count > 1}
  for index, model in enumerate(ZOO):
    if model not in trained:
      factors = dict(model_factors(model))
      pipeline, strategies = factors["pipeline"], factors["strategy"]
      sample.append(Cell(model, "batch" if "batch" in pipeline else
                         pipeline[0], "3",
                         strategies[index % len(strategies)], "train"))
  return sample


# Pipelines whose batches come through a feeding or parsing layer; the
# in-memory ones (batch, drop_remainder, from_tensors) split the same way.
_FED_PIPELINES = ("repeat", "numpy_input_fn", "tf_example")


def ci_cells() -> List[Cell]:
  """The cross `make test-oracle` runs: training on 3 towers (uneven) with
  every strategy on the in-memory pipelines and the model's first strategy
  on the fed ones, on 3 towers of 2 rows (towers without rows) with every
  strategy on the in-memory pipelines, on 2 towers with the plain batch;
  evaluation and prediction on 3 towers of 2 rows, and export once (3
  towers, the plain batch), with the model's first strategy.

  Left out, as the pairwise sample of `make test` still covers them: one
  tower (the `model_fn` placed on its device, no wrapper at work); 2 towers
  on the other pipelines (an even split of the same batches that 3 towers
  split unevenly); towers without rows fed by `repeat`, `numpy_input_fn`
  and `tf_example` (the same split of other inputs), and the fed pipelines'
  other strategies (how the batch arrives is the pipeline's, where the
  variables live the strategy's); evaluation and
  prediction on 2 and 3 towers of 7 rows and with the other strategies
  (they read the same variables, placed elsewhere: no update, no copies to
  combine); an export's other strategies, tower counts and pipelines (a
  SavedModel is built as one unplaced tower whatever the strategy, the
  towers and the input it trained on, so they export the same graph).
  """
  kept = []
  for cell in cells(full=True):
    strategies = dict(model_factors(cell.model))["strategy"]
    if cell.towers == "1":
      continue
    if cell.mode != "train" and cell.strategy != strategies[0]:
      continue
    if cell.mode == "export" and (cell.towers != "3" or
                                  cell.pipeline != "batch"):
      continue
    if (cell.mode == "train" and cell.pipeline in _FED_PIPELINES and
        cell.strategy != strategies[0]):
      continue
    if cell.towers == "2" and (cell.mode != "train" or
                               cell.pipeline != "batch"):
      continue
    if cell.mode in ("eval", "predict") and cell.towers != "3_small":
      continue
    if (cell.mode == "train" and cell.towers == "3_small" and
        cell.pipeline in _FED_PIPELINES):
      continue
    kept.append(cell)
  return kept


def shard(all_cells: List[Cell], spec: str) -> List[Cell]:
  """The cells of shard "i/n": those of the (model, pipeline) pairs i,
  i + n, ... in the cross's order.

  By pair, so that each shard computes only its own oracles (they are kept
  per model and pipeline) and the heavy models spread over the shards.
  """
  match = re.fullmatch(r"(\d+)/(\d+)", spec)
  if not match or int(match.group(1)) >= int(match.group(2)):
    raise ValueError("REPLICATE_ORACLE_SHARD must be 'i/n' with 0 <= i < n "
                     "(e.g. '0/2'); received {!r}".format(spec))
  index, count = int(match.group(1)), int(match.group(2))
  pairs = list(itertools.product(ZOO, pipelines.PIPELINES))
  return [cell for cell in all_cells
          if pairs.index((cell.model, cell.pipeline)) % count == index]


def expected_refusal(cell: Cell):
  """The message substring `cell` must be refused with, or None."""
  for (model, condition), message in EXPECTED_REFUSALS.items():
    if model in (cell.model, "*") and _holds(condition, cell):
      return message
  return None


def check(cell: Cell, workspace: "Workspace", tmp_path) -> None:
  """Runs `cell` wrapped and asserts it equals the oracle (or is refused)."""
  oracle = workspace.oracle(cell)
  model = ZOO[cell.model]
  model_dir = str(tmp_path / "wrapped")
  shutil.copytree(workspace.start(model), model_dir)
  estimator = model.build(model_dir, run_config(cell.tower_count),
                          {"variable_strategy": cell.strategy})
  refusal = expected_refusal(cell)
  if refusal is not None:
    with pytest.raises(ValueError, match=re.escape(refusal)):
      _run(estimator, model, cell, model_dir, workspace)
    return
  assert_equal(oracle, workspace.wrapped(
      cell, lambda: _run(estimator, model, cell, model_dir, workspace)),
               _WHAT[cell.mode])


def run_config(devices: int) -> tf.estimator.RunConfig:
  """The cells' RunConfig, wrapped and unwrapped alike.

  `checkpoint_save_graph_def=False`: checkpoints keep every variable, and
  the Estimator skips writing `graph.pbtxt` and the `.meta` graph, a
  quarter of a training cell's time, which no cell reads.
  """
  return tf.estimator.RunConfig(
      session_config=tf.compat.v1.ConfigProto(device_count={"CPU": devices}),
      tf_random_seed=0, save_summary_steps=None, log_step_count_steps=None,
      keep_checkpoint_max=1, checkpoint_save_graph_def=False)


def assert_equal(expected: dict, actual: dict, what: str) -> None:
  """Every key of `expected` in `actual`, equal to TOLERANCE; one-line error.

  The error leads with the worst entry: its name and how far it is off.
  The comparison is the library's (`replicate.check.compare`), the one
  `replicate.check` makes for users.
  """
  off, missing, extra = compare.differing(expected, actual, rtol=TOLERANCE,
                                          atol=TOLERANCE)
  problems = []
  if off:
    _, detail, name = off[0]
    problems.append("{} of {} {} differ; worst {!r}: {}".format(
        len(off), len(set(expected) & set(actual)), what, name, detail))
    if len(off) > 1:
      problems.append("also " + ", ".join(repr(e[2]) for e in off[1:6]) +
                      (" ..." if len(off) > 6 else ""))
  if missing:
    problems.append("missing {}".format(missing[:6]))
  if extra:
    problems.append("unexpected {}".format(extra[:6]))
  if problems:
    raise AssertionError("; ".join(problems))


class Workspace:
  """What the cells share: start checkpoints, oracle results, the server."""

  def __init__(self, root):
    self._root = str(root)
    self._starts = {}
    self._oracles = {}
    self._exports = {}
    self._server = None

  def start(self, model) -> str:
    """The model's shared starting checkpoint: one unwrapped step."""
    if model.name not in self._starts:
      model_dir = os.path.join(self._root, "start", model.name)
      if not model.warm_start:  # compared from its seeds: no checkpoint
        os.makedirs(model_dir)
        self._starts[model.name] = model_dir
        return model_dir
      input_fn, _, _ = pipelines.input_fn("from_tensors", model, ROWS, 3,
                                          "train")
      # Keras initializers without a seed draw one from Python's `random`:
      # seeded here, the start (and each failure's numbers) is the same on
      # every run.
      tf.keras.utils.set_random_seed(0)
      model.build(model_dir, run_config(1), None).train(input_fn, steps=1)
      self._starts[model.name] = model_dir
    return self._starts[model.name]

  def oracle(self, cell: Cell):
    """The unwrapped model's result for `cell`, computed once per run."""
    key = (cell.model, cell.pipeline, cell.mode, cell.rows, cell.batch)
    if cell.mode == "export":
      key = (cell.model, cell.pipeline == "tf_example", cell.mode)
    if key not in self._oracles:
      model = ZOO[cell.model]
      model_dir = os.path.join(self._root, "oracle",
                               "-".join(str(part) for part in key))
      shutil.copytree(self.start(model), model_dir)
      self._oracles[key] = _run(model.build(model_dir, run_config(1), None),
                                model, cell, model_dir, self)
    return self._oracles[key]

  def wrapped(self, cell: Cell, run) -> dict:
    """`run()`, once for the cells that do exactly the same thing.

    Only export cells repeat: an export reads neither the pipeline (only
    whether it parses `tf.Example`s) nor the rows, so the cells that differ
    in nothing else ("batch" and "repeat", "3" and "3_small") run one
    export and serve it once. Every other cell runs.
    """
    if cell.mode != "export":
      return run()
    key = (cell.model, cell.pipeline == "tf_example", cell.tower_count,
           cell.strategy)
    if key not in self._exports:
      self._exports[key] = run()
    return self._exports[key]

  def serve(self, export_dir: str, request: dict) -> dict:
    """Every signature's outputs for each of SERVING_SIZES, served apart."""
    if self._server is None or self._server.poll() is not None:
      # oneDNN's graph rewrites off: on AMD EPYC machines Grappler's
      # remapper aborts the process (protobuf CHECK "key not found: value")
      # on the unwrapped BERT export's serving graph, a TensorFlow 2.15 bug
      # that depends on the CPU. Both exports are served the same way.
      if self._server is not None:
        self._stderr.close()
      self._stderr = open(os.path.join(self._root, "server.stderr"), "w")
      self._server = subprocess.Popen(
          [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
          stdout=subprocess.PIPE, stderr=self._stderr, text=True,
          env=dict(os.environ, CUDA_VISIBLE_DEVICES="",
                   TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0"))
    self._server.stdin.write(json.dumps(dict(
        request, export_dir=export_dir, sizes=SERVING_SIZES)) + "\n")
    self._server.stdin.flush()
    for line in self._server.stdout:
      if line.startswith(_REPLY):
        reply = json.loads(line[len(_REPLY):])
        if "error" in reply:
          raise AssertionError("serving {} failed: {}".format(
              export_dir, reply["error"]))
        return {name: np.array(value, dtype=object if isinstance(
            _first(value), str) else None)
                for name, value in reply["result"].items()}
    with open(self._stderr.name) as stderr:
      last = stderr.read().strip().splitlines()[-3:]
    raise AssertionError("the serving process ended while serving {}: "
                         "{}".format(export_dir, " | ".join(last)))

  def close(self):
    if self._server is not None and self._server.poll() is None:
      self._server.stdin.close()
      try:
        self._server.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._server.kill()
    if self._server is not None:
      self._stderr.close()


_WHAT = {"train": "checkpoint variables", "eval": "metrics",
         "predict": "prediction keys", "export": "served outputs"}


def _run(estimator, model, cell, model_dir, workspace) -> dict:
  """The estimator's result for the cell's mode, as {name: array}."""
  if cell.mode == "export":
    export_dir = estimator.export_saved_model(
        os.path.join(model_dir, "export"),
        pipelines.serving_receiver(model, cell.pipeline)).decode()
    return workspace.serve(export_dir, pipelines.serving_request(
        model, max(SERVING_SIZES)))
  input_fn, steps, limit = pipelines.input_fn(cell.pipeline, model, cell.rows,
                                              cell.batch, cell.mode)
  if cell.mode == "train":
    estimator.train(input_fn, steps=steps)
    reader = tf.train.load_checkpoint(model_dir)
    return {name: reader.get_tensor(name)
            for name, _ in tf.train.list_variables(model_dir)}
  if cell.mode == "eval":
    return {name: np.asarray(value) for name, value in
            estimator.evaluate(input_fn, steps=steps).items()}
  predictions = list(itertools.islice(estimator.predict(input_fn), limit))
  if not predictions:
    return {}
  if not isinstance(predictions[0], dict):
    predictions = [{"predictions": p} for p in predictions]
  result = {key: np.stack([p[key] for p in predictions])
            for key in predictions[0]}
  result["number of rows"] = np.array(len(predictions))
  return result


def _holds(condition: str, cell: Cell) -> bool:
  if condition == "*":
    return True
  terms = [term.split("=", 1) for term in condition.split("&")]
  return all(getattr(cell, name) == value for name, value in terms)


def _first(value):
  while isinstance(value, list) and value:
    value = value[0]
  return value


_REPLY = "ORACLE-SERVED "

# The serving process: one JSON request a line (an export, raw columns,
# serialized tf.Examples, batch sizes); each export is loaded into a new
# graph and a strict one-CPU session, and every signature is run.
_SERVER = r"""
import base64, json, sys
import numpy as np
import tensorflow as tf

STRICT = tf.compat.v1.ConfigProto(allow_soft_placement=False,
                                  device_count={"CPU": 1})


def listed(value):
  value = np.asarray(value)
  if value.dtype == object or value.dtype.kind == "S":
    return np.vectorize(lambda b: b.decode(), otypes=[object])(value).tolist()
  return value.tolist()


def feed_value(name, info, size, request, examples):
  dtype = tf.as_dtype(info.dtype)
  if name in request["raw"]:
    value = np.array(request["raw"][name][:size])
    if dtype == tf.string:
      return np.vectorize(lambda s: s.encode(), otypes=[object])(value)
    return value.astype(dtype.as_numpy_dtype)
  if dtype == tf.string:
    return np.array(examples[:size], dtype=object)
  raise KeyError("no value for signature input " + name)


def serve(request):
  examples = [base64.b64decode(e) for e in request["examples"]]
  result = {}
  with tf.compat.v1.Session(graph=tf.Graph(), config=STRICT) as session:
    meta_graph = tf.compat.v1.saved_model.load(session, ["serve"],
                                               request["export_dir"])
    for key, signature in sorted(meta_graph.signature_def.items()):
      if key.startswith("__"):
        continue
      for size in request["sizes"]:
        feed = {info.name: feed_value(name, info, size, request, examples)
                for name, info in signature.inputs.items()}
        fetches = {name: info.name for name, info in signature.outputs.items()}
        for name, value in session.run(fetches, feed).items():
          result["{}/{}/{}".format(key, size, name)] = listed(value)
  return result


for line in sys.stdin:
  request = json.loads(line)
  try:
    reply = {"result": serve(request)}
  except Exception as error:  # reported to the test, which fails
    message = str(error).strip().splitlines()
    reply = {"error": "{}: {}".format(type(error).__name__,
                                      message[0] if message else "")}
  print("ORACLE-SERVED " + json.dumps(reply), flush=True)
"""

"""The rows through TF 1 and TF 2 loops: the same facts, the same decisions.

Issue 38, item 2: an op that depends on a tower's rows inside or after a
`tf.while_loop` is classified alike under v1 control flow (Enter / Merge /
Switch / NextIteration / Exit frames in the graph itself, as TF 1
behaviour builds `dynamic_rnn`, `tf.scan`, `tf.map_fn` and TensorArrays)
and v2 (a `While` op calling its body), on batches of known or unknown
size. Every test runs under both control flows (the fixture switches
them), and the module under TF 1 behaviour too (`REPLICATE_TF1_BEHAVIOR=1`).

On f65e512, under v1 control flow, the rows after a loop were lost: a
`dynamic_rnn`'s outputs had no rows (NONE), so a reversal of them passed;
under both, a `tf.map_fn`'s over the rows were UNKNOWN (a reversal of them
passed too); under v2 a summary of a mean over the batch after a
`dynamic_rnn` showed tower 0's rows only; a running sum down the batch
written as a loop passed under both (silently unlike one device), and
`tf.gather(x, i)` in such a loop was refused under v1 only.
"""

import glob
import os
import time

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from conftest import cpus, session_config
from replicate.graph import row_facts
from replicate.graph.row_layout import RowLayout
from replicate.shard.rows import TowerRows

ROWS, TIME, DEPTH = 5, 6, 3


@pytest.fixture(params=["v1", "v2"])
def control_flow(request):
  """v1 (frames in the graph) or v2 (`While` ops) control flow."""
  was_v2 = tf.compat.v1.control_flow_v2_enabled()
  if request.param == "v1":
    tf.compat.v1.disable_control_flow_v2()
  else:
    tf.compat.v1.enable_control_flow_v2()
  try:
    yield request.param
  finally:
    if was_v2:
      tf.compat.v1.enable_control_flow_v2()
    else:
      tf.compat.v1.disable_control_flow_v2()


def _assert_built_with(graph, control_flow):
  types = {op.type for op in graph.get_operations()}
  assert ("Enter" in types) == (control_flow == "v1"), types
  assert bool(types & {"While", "StatelessWhile"}) == (control_flow == "v2")


# ---------------------------------------------------------------------------
# The facts: which axis of a loop's output holds the rows.


def _rnn(x, time_major):
  cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(4)
  if time_major:
    x = tf.transpose(x, [1, 0, 2])
  outputs, state = tf.compat.v1.nn.dynamic_rnn(
      cell, x, dtype=tf.float32, time_major=time_major)
  return outputs, state


def _nested(x):
  """A `tf.scan` over time inside a `tf.while_loop` of two passes."""
  steps = tf.transpose(x, [1, 0, 2])

  def body(k, h):
    out = tf.scan(lambda a, e: tf.tanh(a + e), steps, initializer=h)
    return k + 1, out[-1]

  return tf.while_loop(lambda k, h: k < 2, body,
                       [0, tf.zeros_like(x[:, 0])])[1]


def _reversed_by_loop(x):
  """Row i's sum written at index rows - 1 - i of a TensorArray."""
  rows = tf.shape(x)[0]
  elements = tf.TensorArray(tf.float32, size=rows).unstack(x)

  def body(i, out):
    return i + 1, out.write(rows - 1 - i, tf.reduce_sum(elements.read(i), 0))

  _, out = tf.while_loop(lambda i, out: i < rows, body,
                         [0, tf.TensorArray(tf.float32, size=rows)])
  return out.stack()


# name: (what to build from x [rows, time, depth], {output: (kind, axis)}).
LOOPS = {
    "dynamic_rnn": (lambda x: _rnn(x, False), [("aligned", 0),
                                               ("aligned", 0)]),
    "dynamic_rnn_time_major": (lambda x: _rnn(x, True), [("aligned", 1),
                                                         ("aligned", 0)]),
    "scan_over_time": (lambda x: [tf.scan(
        lambda a, e: a * 0.5 + e, tf.transpose(x, [1, 0, 2]),
        initializer=tf.zeros_like(x[:, 0]))], [("aligned", 1)]),
    # A list of the rows: each step's value is its own row's.
    "map_fn_over_rows": (lambda x: [tf.map_fn(
        lambda r: tf.reduce_sum(r, 0), x)], [("aligned", 0)]),
    # One row's value written at another row's index; a sum carried down
    # the batch: rows along no one axis.
    "rows_written_reversed": (lambda x: [_reversed_by_loop(x)],
                              [("unknown", None)]),
    "scan_down_the_batch": (lambda x: [tf.scan(
        lambda a, r: a + r, x)], [("unknown", None)]),
    "nested_loops": (lambda x: [_nested(x)], [("aligned", 0)]),
}


def _layout(graph, x, static):
  within = frozenset(graph.get_operations())
  return RowLayout(x, within, TowerRows(x, within).depend,
                   ROWS if static else None)


@pytest.mark.parametrize("static", [False, True], ids=["unknown", "static"])
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_loops_outputs_carry_the_rows_on_their_axis(loop, static,
                                                      control_flow):
  build, expected = LOOPS[loop]
  with tf.Graph().as_default() as graph:
    x = tf.compat.v1.placeholder(tf.float32,
                                 [ROWS if static else None, TIME, DEPTH])
    outputs = build(x)
    _assert_built_with(graph, control_flow)
    layout = _layout(graph, x, static)
    assert [tuple(layout.fact(t)[:2]) for t in outputs] == expected


def test_a_loop_variable_whose_rows_move_to_another_axis_is_unknown(
    control_flow):
  """A variable that swaps its two axes of equal size at each step has the
  rows along no one axis: UNKNOWN (an index op on it is not refused, as
  on any value whose rows the analysis lost)."""
  with tf.Graph().as_default() as graph:
    x = tf.compat.v1.placeholder(tf.float32, [ROWS, ROWS])
    _, swapped = tf.while_loop(lambda i, h: i < 3,
                               lambda i, h: (i + 1, tf.transpose(h)),
                               [0, x])
    _assert_built_with(graph, control_flow)
    layout = _layout(graph, x, True)
    assert layout.fact(swapped) == row_facts.UNKNOWN_ROWS


def test_many_loops_one_after_another_are_followed_without_recursion(
    control_flow):
  """Each loop's entries are computed on the caller's explicit stack (a
  model of 300 loops in a row is not a Python recursion 300 deep)."""
  with tf.Graph().as_default() as graph:
    x = tf.compat.v1.placeholder(tf.float32, [None, DEPTH])
    h = x
    for _ in range(300):
      h = tf.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, v * 0.5),
                        [0, h])[1]
    _assert_built_with(graph, control_flow)
    layout = _layout(graph, x, False)
    started = time.process_time()
    assert tuple(layout.fact(h)[:2]) == ("aligned", 0)
    assert time.process_time() - started < 60  # linear, not exponential


# ---------------------------------------------------------------------------
# End to end: wrapped on 2 towers as the unwrapped model_fn on one device.

_rng = np.random.RandomState(12)
X = _rng.rand(ROWS, TIME, DEPTH).astype(np.float32)
LENGTHS = np.array([2, 6, 1, 4, 3], np.int32)
Y = np.array([0, 2, 1, 1, 0], np.int64)


def _last_relevant(outputs, lengths):
  rows = tf.shape(outputs)[0]
  return tf.gather_nd(outputs, tf.stack([tf.range(rows), lengths - 1], 1))


def _rnn_model_fn(time_major):
  """`dynamic_rnn`, each row's last relevant output, a summary of its mean
  over the batch (a value after the loop over every row), predictions and
  metrics of it."""

  def model_fn(features, labels, mode):
    x, lengths = features["x"], features["lengths"]
    if time_major:
      x = tf.transpose(x, [1, 0, 2])
    with tf.compat.v1.variable_scope(
        "rnn", initializer=tf.compat.v1.glorot_uniform_initializer(seed=3)):
      outputs, state = tf.compat.v1.nn.dynamic_rnn(
          tf.compat.v1.nn.rnn_cell.BasicRNNCell(4), x,
          sequence_length=lengths, dtype=tf.float32, time_major=time_major)
    if time_major:
      outputs = tf.transpose(outputs, [1, 0, 2])
    last = _last_relevant(outputs, lengths)
    scores = tf.map_fn(lambda row: tf.reduce_sum(row * row), last)
    tf.compat.v1.summary.scalar("mean_outputs", tf.reduce_mean(outputs))
    tf.compat.v1.summary.scalar("mean_score", tf.reduce_mean(scores))
    tf.compat.v1.summary.scalar("mean_last", tf.reduce_mean(last))
    tf.compat.v1.summary.scalar("max_state", tf.reduce_max(state))
    logits = tf.compat.v1.layers.dense(
        last, 3, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(
            seed=4))
    predictions = {"last": last, "classes": tf.argmax(logits, 1),
                   "scores": scores}
    if mode == tf.estimator.ModeKeys.PREDICT:
      return tf.estimator.EstimatorSpec(mode, predictions=predictions)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5))
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, predictions=predictions,
        train_op=optimizer.minimize(loss,
                                    tf.compat.v1.train.get_global_step()),
        eval_metric_ops={
            "accuracy": tf.compat.v1.metrics.accuracy(
                labels, predictions["classes"]),
            "mean_state": tf.compat.v1.metrics.mean(state)})

  return model_fn


def _input_fn(static):
  data = ({"x": X, "lengths": LENGTHS}, Y)
  if static:
    return lambda: tf.data.Dataset.from_tensors(data).repeat(2)
  return lambda: tf.data.Dataset.from_tensor_slices(data).batch(3)


_TAGS = ("max_state", "mean_last", "mean_outputs", "mean_score")


def _events(directory):
  found = {}
  for path in sorted(glob.glob(os.path.join(directory, "events.out.*"))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag in _TAGS:
          found.setdefault(value.tag, []).append(value.simple_value)
  return found


def _estimator_run(model_fn, towers, static, model_dir):
  if towers:
    model_fn = replicate.replicate_model_fn(model_fn, devices=cpus(towers))
  estimator = tf.estimator.Estimator(model_fn, model_dir=model_dir, config=(
      tf.estimator.RunConfig(session_config=session_config(towers or 1),
                             save_summary_steps=1, log_step_count_steps=None,
                             tf_random_seed=7)))
  estimator.train(_input_fn(static), max_steps=2)
  metrics = estimator.evaluate(_input_fn(static), steps=2)
  predictions = list(estimator.predict(
      lambda: _input_fn(static)().map(lambda x, y: x)))
  return metrics, predictions, _events(model_dir)


@pytest.mark.parametrize("time_major, static", [
    (False, False), (True, True)], ids=["batch_major", "time_major_static"])
def test_a_dynamic_rnns_outputs_train_evaluate_predict_and_summarize_exactly(
    time_major, static, control_flow, tmp_path):
  """Each step's summary of a mean over the batch of the outputs after the
  loop is the whole batch's: on f65e512 it was tower 0's under v1 control
  flow (the outputs had no rows: the mean was built again back to the
  loop's Exit, which it cannot build again) and under v2 (a `While` fed
  its gradient's accumulators, and what came after it counted as the
  backward pass); the metrics and predictions are one device's."""
  model_fn = _rnn_model_fn(time_major)
  expected = _estimator_run(model_fn, 0, static, str(tmp_path / "one"))
  actual = _estimator_run(model_fn, 2, static, str(tmp_path / "two"))
  assert actual[0]["global_step"] == expected[0]["global_step"] == 2
  for key in ("loss", "accuracy", "mean_state"):
    np.testing.assert_allclose(actual[0][key], expected[0][key], rtol=1e-5,
                               err_msg=key)
  assert len(actual[1]) == len(expected[1]) == (ROWS * 2 if static else ROWS)
  for got, want in zip(actual[1], expected[1]):
    for key in ("last", "scores"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
    assert got["classes"] == want["classes"]
  assert sorted(actual[2]) == sorted(expected[2]) == list(_TAGS)
  assert [len(values) for values in expected[2].values()] == [2] * 4
  for tag, values in expected[2].items():
    np.testing.assert_allclose(actual[2][tag], values, rtol=1e-5, atol=1e-6,
                               err_msg=tag)


def _weights():
  return tf.compat.v1.get_variable(
      "w", [DEPTH, DEPTH],
      initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))


def _scan_model_fn(features, labels, mode):
  del mode
  steps = tf.transpose(features["x"], [1, 0, 2])
  w = _weights()
  out = tf.scan(lambda a, e: tf.tanh(tf.matmul(a, w) + e), steps,
                initializer=tf.zeros_like(steps[0]))
  return harness.classifier_spec(tf.reverse(out, [0])[0], labels)  # the last step, by time


def _map_fn_model_fn(features, labels, mode):
  del mode
  w = _weights()
  return harness.classifier_spec(tf.map_fn(lambda r: tf.reduce_sum(tf.matmul(r, w), 0),
                         features["x"]), labels)


def _running_sum_model_fn(pick):
  """A running sum down the batch as a loop over its rows: row i's output
  is the sum of rows 0..i (on a tower, of its own shard's rows only)."""

  def model_fn(features, labels, mode):
    del mode
    x = tf.compat.v1.layers.dense(features["x"][:, 0], 4)
    rows = tf.shape(x)[0]

    def body(i, total, sums):
      total += x[i] if pick == "slice" else tf.gather(x, i)
      return i + 1, total, sums.write(i, total)

    _, _, sums = tf.while_loop(
        lambda i, total, sums: i < rows, body,
        [0, tf.zeros([4]), tf.TensorArray(tf.float32, size=rows)])
    return harness.classifier_spec(sums.stack(), labels)

  return model_fn


def _batches():
  return [{"x": X, "lengths": LENGTHS, "y": Y},
          {"x": X[::-1].copy(), "lengths": LENGTHS, "y": Y}]


@pytest.mark.parametrize("static", [False, True], ids=["unknown", "static"])
@pytest.mark.parametrize("name", ["scan", "map_fn"])
def test_a_scan_and_a_map_fn_train_exactly(name, static, control_flow):
  model_fn = {"scan": _scan_model_fn, "map_fn": _map_fn_model_fn}[name]
  expected, actual = harness.train_both(model_fn, 2, _batches(),
                                        static=static, known_rows=static)
  harness.assert_trained_alike(expected, actual)


@pytest.mark.parametrize("loop", ["dynamic_rnn", "map_fn"])
def test_rows_reversed_after_a_loop_are_refused(loop, control_flow):
  """After a `dynamic_rnn`: refused under v2 before, passed under v1 on
  f65e512; after a `tf.map_fn` over the rows, passed under both (its
  output's rows were UNKNOWN, and a gather of those is not refused)."""

  def model_fn(features, labels, mode):
    del mode
    if loop == "dynamic_rnn":
      values = _rnn(features["x"], False)[0][:, -1]
    else:
      values = tf.map_fn(lambda row: tf.reduce_sum(row, 0), features["x"])
    rows = tf.shape(values)[0]
    return harness.classifier_spec(tf.gather(values, tf.range(rows - 1, -1, -1)), labels)

  with pytest.raises(ValueError, match="GatherV2 op 'GatherV2' combines "
                     "different rows.*Fix: index the whole batch's rows"):
    harness.train(model_fn, _batches(), 2)


@pytest.mark.parametrize("static", [False, True], ids=["unknown", "static"])
@pytest.mark.parametrize("pick", ["slice", "gather"])
def test_a_running_sum_down_the_batch_as_a_loop_is_refused(pick, static,
                                                           control_flow):
  """Unlike one device on 2 towers (each sums its own shard's rows): on
  f65e512 it passed under both control flows with `x[i]`, and with
  `tf.gather(x, i)` under v2; the op named is the body's (v1) or the loop
  naming its body's op (v2)."""
  model_fn = _running_sum_model_fn(pick)
  op = {"slice": "StridedSlice op '{}strided_slice'",
        "gather": "GatherV2 op '{}GatherV2'"}[pick]
  where = (op.format("while/") if control_flow == "v1" else
           "While op 'while' .*its body's " + op.format(""))
  with pytest.raises(ValueError, match=where + ".*On 2 towers.*Fix: "):
    harness.train(model_fn, _batches(), 2, static=static, known_rows=static)


def _rows_meet_in_a_loop_model_fn(meet):
  """Each step of a loop over time lets the rows meet: each row's state
  attends to every row's (`tf.matmul(s, s, transpose_b=True)`), or is
  ranked against the others (`tf.nn.top_k` of one value per row)."""

  def model_fn(features, labels, mode):
    del mode
    w = _weights()

    def step(state, x):
      if meet == "matmul":
        mixed = tf.matmul(tf.nn.softmax(tf.matmul(state, state,
                                                  transpose_b=True)), state)
      else:
        ranks = tf.nn.top_k(tf.reduce_sum(state, 1),
                            k=tf.shape(state)[0]).indices
        mixed = tf.gather(state, ranks)
      return tf.tanh(tf.matmul(mixed, w) + x)

    steps = tf.transpose(features["x"], [1, 0, 2])
    states = tf.scan(step, steps, initializer=steps[0])
    return harness.classifier_spec(states[-1], labels)

  return model_fn


@pytest.mark.parametrize("meet", ["matmul", "top_k"])
def test_rows_meeting_inside_a_loops_body_are_refused(meet, control_flow):
  """Unlike one device on 2 towers (each tower's rows meet its own only).
  On 405e424 a TF 2 loop's body was judged by its index, slice and loop
  rules alone: under v2 control flow both passed, silently; under v1 the
  body's op was refused."""
  op = {"matmul": "MatMul op '{}MatMul(_1)?'",
        "top_k": "TopKV2 op '{}TopKV2'"}[meet]
  where = (op.format("scan/while/") if control_flow == "v1" else
           "While op 'scan/while' .*its body's " + op.format(""))
  with pytest.raises(ValueError, match=where + ".*On 2 towers.*Fix: "):
    harness.train(_rows_meet_in_a_loop_model_fn(meet), _batches(), 2)

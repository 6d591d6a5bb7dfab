"""`replicate.communication.collectives`: keys read from the graph, ops on tower devices.

A graph's reductions each need their own instance key, and a group key
always means one set of devices; rebuilt graphs and sessions open side by
side must not interfere. Everything here runs real sessions on virtual CPU
devices and checks the trained values.
"""

import collections

import numpy as np
import tensorflow as tf

import replicate
from conftest import TRAIN, cpus, session_config
from replicate.communication import collectives

X = np.linspace(-1, 1, 21, dtype=np.float32).reshape(7, 3)
Y = X @ np.array([[1.0], [2.0], [-1.0]], np.float32)
# One SGD step from w = 1 on the whole batch (mean squared error):
# w - 0.1 * 2/7 * X^T (X w - Y), the same for any number of towers.
ONE_STEP = np.ones([3, 1], np.float32) - 0.1 * 2 / 7 * X.T @ (
    X @ np.ones([3, 1], np.float32) - Y)


def _linear_model_fn(scope="linear", counts_steps=True):

  def model_fn(features, labels, mode):
    with tf.compat.v1.variable_scope(scope):
      w = tf.compat.v1.get_variable("w", [3, 1],
                                    initializer=tf.ones_initializer())
      loss = tf.compat.v1.losses.mean_squared_error(labels, features @ w)
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
            loss, global_step=(tf.compat.v1.train.get_global_step()
                               if counts_steps else None))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _ring(model_fn, towers):
  return replicate.replicate_model_fn(
      model_fn, devices=cpus(towers), variable_strategy="replicated",
      all_reduce="ring")


def _keys(graph):
  """(op type, group key, instance key, device) of every collective op."""
  keys = []
  for op in graph.get_operations():
    if op.type.startswith("Collective"):
      group, instance = (int(tf.get_static_value(op.inputs[i]))
                         for i in (2, 3))
      keys.append((op.type, group, instance, op.device))
  return keys


def _initialize(session):
  """As the Scaffold does: the copies (local) start from tower 0's values."""
  session.run(tf.compat.v1.global_variables_initializer())
  session.run(tf.compat.v1.local_variables_initializer())


def _scope_w(scope):
  return [v for v in tf.compat.v1.global_variables()
          if v.op.name == scope + "/w"][0]


def test_200_rebuilt_graphs_start_from_key_1_and_train_right():
  # Alternating 2 and 3 towers: group key 1 means 2 devices in one
  # session and 3 in the next; each session resolves its own groups. Every
  # graph's keys are checked; a session trains the first 4 graphs and every
  # 49th after them (both tower counts, late in the run too): the sessions
  # were a third of this test's CPU time (33 s against 22 s), and each
  # trains the same step.
  trained = 0
  for rebuild in range(200):
    towers = 2 + rebuild % 2
    with tf.Graph().as_default() as graph:
      tf.compat.v1.train.get_or_create_global_step()
      spec = _ring(_linear_model_fn(), towers)(tf.constant(X),
                                               tf.constant(Y), TRAIN)
      assert sorted(_keys(graph)) == [
          ("CollectiveReduceV2", 1, 1, "/device:CPU:{}".format(i))
          for i in range(towers)]
      # The keys live in the ops alone: no collection keeps them.
      assert "replicate" not in " ".join(
          str(key) for key in graph.get_all_collection_keys())
      if rebuild >= 4 and rebuild % 49:
        continue
      with tf.compat.v1.Session(config=session_config(towers)) as session:
        _initialize(session)
        session.run(spec.train_op)
        w, copy = session.run([_scope_w("linear"), [
            v for v in tf.compat.v1.local_variables()
            if v.op.name == "tower_1/linear/w"][0]])
    np.testing.assert_allclose(w, ONE_STEP, rtol=1e-6)
    np.testing.assert_array_equal(copy, w)
    trained += 1
  assert trained == 8  # graphs 0-3, 49, 98, 147 and 196


def _wide_model_fn(features, labels, mode):
  """Two optimizers, a large dense and a sparse gradient: many instances."""
  table = tf.compat.v1.get_variable(
      "table", [40000, 1], initializer=tf.compat.v1.constant_initializer(0.5))
  big = tf.compat.v1.get_variable("big", [3, 20000],
                                  initializer=tf.ones_initializer())
  w = tf.compat.v1.get_variable("w", [3, 1], initializer=tf.ones_initializer())
  ids = tf.cast(tf.abs(features[:, :1]) * 100, tf.int64)
  predicted = (features @ w + tf.reduce_mean(features @ big, axis=1,
                                             keepdims=True) +
               tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1))
  loss = tf.compat.v1.losses.mean_squared_error(labels, predicted)
  first = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.01))
  second = replicate.TowerOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01))
  train_op = tf.group(first.minimize(loss, var_list=[w, table]),
                      second.minimize(loss, var_list=[big, w]))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_every_reduction_in_a_graph_has_its_own_instance_key(graph):
  _ring(_wide_model_fn, 3)(tf.constant(X), tf.constant(Y), TRAIN)
  by_instance = collections.defaultdict(list)
  for op_type, group, instance, device in _keys(graph):
    assert group == 1
    by_instance[instance].append((op_type, device))
  # First call: w packed (1 reduce), table gathered (counts, values and
  # indices: 7 rows split 3, 2, 2 are slices of unequal lengths). Second
  # call: big (60000 floats, alone), w packed: 2 reduces. 6 instances.
  assert sorted(by_instance) == [1, 2, 3, 4, 5, 6]
  for instance, members in by_instance.items():
    assert len({op_type for op_type, _ in members}) == 1, instance
    assert sorted(device for _, device in members) == [
        "/device:CPU:0", "/device:CPU:1", "/device:CPU:2"], instance
  assert collections.Counter(
      members[0][0] for members in by_instance.values()) == {
          "CollectiveReduceV2": 3, "CollectiveGatherV2": 3}


def test_two_graphs_in_two_open_sessions_with_the_same_keys():
  graphs, sessions, specs = [], [], []
  for towers in (2, 3):
    graph = tf.Graph()
    with graph.as_default():
      tf.compat.v1.train.get_or_create_global_step()
      specs.append(_ring(_linear_model_fn(), towers)(tf.constant(X),
                                                     tf.constant(Y), TRAIN))
      sessions.append(tf.compat.v1.Session(config=session_config(towers)))
      _initialize(sessions[-1])
    graphs.append(graph)
  assert {key[1:3] for key in _keys(graphs[0])} == {
      key[1:3] for key in _keys(graphs[1])} == {(1, 1)}
  try:
    for _ in range(2):  # interleaved steps
      for session, spec in zip(sessions, specs):
        session.run(spec.train_op)
    results = []
    for graph, session in zip(graphs, sessions):
      with graph.as_default():
        results.append(session.run(_scope_w("linear")))
  finally:
    for session in sessions:
      session.close()
  # Both trained two steps on the same batch: the same w.
  expected = _unwrapped_linear(steps=2)
  for w in results:
    np.testing.assert_allclose(w, expected, rtol=1e-6)


def _unwrapped_linear(steps):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _linear_model_fn()(tf.constant(X), tf.constant(Y), TRAIN)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for _ in range(steps):
        session.run(spec.train_op)
      return session.run(_scope_w("linear"))


def test_three_replicated_model_fns_in_one_graph(graph):
  # a and c reduce over CPU 0-1, b over CPU 0-2: a and c share group key
  # 1, b gets group key 2; every one gets its own instance key.
  train_ops = []
  for scope, towers in (("a", 2), ("b", 3), ("c", 2)):
    spec = _ring(_linear_model_fn(scope, counts_steps=scope == "a"),
                 towers)(tf.constant(X), tf.constant(Y), TRAIN)
    train_ops.append(spec.train_op)
  keys = _keys(graph)
  groups = collections.defaultdict(set)
  for _, group, instance, device in keys:
    groups[(group, instance)].add(device)
  assert groups == {
      (1, 1): {"/device:CPU:0", "/device:CPU:1"},
      (2, 2): {"/device:CPU:0", "/device:CPU:1", "/device:CPU:2"},
      (1, 3): {"/device:CPU:0", "/device:CPU:1"}}
  with tf.compat.v1.Session(config=session_config(3)) as session:
    _initialize(session)
    session.run(train_ops)
    for scope in "abc":
      np.testing.assert_allclose(session.run(_scope_w(scope)), ONE_STEP,
                                 rtol=1e-6, err_msg=scope)


def test_free_keys_step_over_collective_ops_made_by_others(graph):
  for device in cpus(2):
    with tf.device(device):
      tf.raw_ops.CollectiveReduceV2(
          input=tf.ones([2]), group_size=2, group_key=7, instance_key=40,
          ordering_token=[], merge_op="Add", final_op="Id")
  assert collectives.free_keys(graph, ["/cpu:0", "/CPU:1"]) == (7, 41)
  assert collectives.free_keys(graph, cpus(3)) == (8, 41)
  assert collectives.free_keys(tf.Graph(), cpus(3)) == (1, 1)


def test_one_towers_result_alone_runs_every_towers_op(graph):
  # A collective op waits for its peers; fetching only tower 0's sum must
  # still run tower 1's op, or the run would wait forever.
  tensors = []
  for index, device in enumerate(cpus(2)):
    with tf.device(device):
      tensors.append(tf.constant([1.0, 2.0]) * (index + 1))
  summed = collectives.Collectives(cpus(2), "ring").all_reduce(tensors)
  with tf.compat.v1.Session(config=session_config(2)) as session:
    value = session.run(summed[0], options=tf.compat.v1.RunOptions(
        timeout_in_ms=60000))
  np.testing.assert_array_equal(value, [3.0, 6.0])  # [1, 2] + [2, 4]


def test_nccl_starts_each_devices_collectives_in_order(graph):
  # Built, not run: this machine has no GPU. NCCL needs the same order of
  # reductions on every GPU, so each op waits for its device's previous one;
  # the ring leaves them free to overlap.
  devices = ["/device:GPU:0", "/device:GPU:1"]
  for hint, is_chained in (("nccl", True), ("ring", False)):
    launcher = collectives.Collectives(devices, hint)
    firsts = launcher.all_reduce([tf.ones([4]), tf.ones([4])])
    seconds = launcher.all_reduce([tf.ones([8]), tf.ones([8])])
    for first, second in zip(firsts, seconds):
      first_op = first.op.inputs[0].op  # through the joining identity
      second_op = second.op.inputs[0].op
      assert second_op.type == "CollectiveReduceV2"
      assert (first_op in second_op.control_inputs) == is_chained, hint
      assert second_op.get_attr("communication_hint") == hint.encode()

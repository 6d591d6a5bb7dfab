"""`sync_batch_norm=True`: batch norm on N towers is one device's on the batch.

Each model is trained 3 momentum-SGD steps unwrapped on one device and
wrapped on 2 and 3 towers, on the same batches of 6x6x3 images drawn from
N(1, 2^2): batch 12 (even), 13 (uneven: 7 + 6, 5 + 4 + 4) and 2 on 3 towers
(1 + 1 + a tower on a stand-in row). The logits of every step, the loss,
every variable and every moving statistic must agree to 1e-5 in float32
(1e-12 in the float64 cell). The cells cover every pair of model, towers,
batch and strategy (a pairwise sample of the full product). Per-shard batch
norm misses by 0.06-1.6 on these models, so the tolerance is meaningful
(`test_per_shard_batch_norm_is_not_one_device` checks it).
"""

import json
import socket

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from conftest import EVAL, TRAIN, cpus, session_config
from replicate import _tf

PS, ROUND_ROBIN, REPLICATED = "parameter_server", "round_robin", "replicated"
STEPS = 3
LOGITS = "test_sync_batch_norm.logits"


def _init(seed):
  return tf.compat.v1.glorot_uniform_initializer(seed=seed)


def _keep_logits(logits):
  tf.compat.v1.add_to_collection(LOGITS, logits)
  return logits


def _minimize(loss, optimizer=None, var_list=None, updates=None):
  optimizer = optimizer or tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  updates = (tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
             if updates is None else updates)
  with tf.control_dependencies(updates):
    return replicate.TowerOptimizer(optimizer).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step(),
        var_list=var_list)


def _v1_body(x, fused=True, training=True):
  """conv - BN (fused) - relu - conv/2 - BN (not fused) - flatten."""
  hidden = tf.compat.v1.layers.conv2d(x, 4, 3, padding="same", name="conv1",
                                      kernel_initializer=_init(1))
  hidden = tf.compat.v1.layers.batch_normalization(
      hidden, training=training, fused=fused, momentum=0.5, name="bn1")
  hidden = tf.compat.v1.layers.conv2d(tf.nn.relu(hidden), 5, 3, strides=2,
                                      name="conv2",
                                      kernel_initializer=_init(2))
  hidden = tf.compat.v1.layers.batch_normalization(
      hidden, training=training, fused=False, momentum=0.5, name="bn2")
  return tf.compat.v1.layers.flatten(hidden)


def _v1_cnn_model_fn(features, labels, mode):
  logits = _keep_logits(tf.compat.v1.layers.dense(
      _v1_body(features["x"]), 3, name="logits", kernel_initializer=_init(3)))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=_minimize(loss))


def _keras_model_fn(features, labels, mode):
  """A functional model: Conv2D + BN (fused), Dense + BN (not fused)."""
  inputs = tf.keras.Input([6, 6, 3])
  hidden = tf.keras.layers.Conv2D(4, 3, padding="same",
                                  kernel_initializer=_init(1))(inputs)
  hidden = tf.keras.layers.BatchNormalization(momentum=0.5)(hidden)
  hidden = tf.keras.layers.Flatten()(tf.keras.layers.ReLU()(hidden))
  hidden = tf.keras.layers.Dense(8, kernel_initializer=_init(2))(hidden)
  hidden = tf.keras.layers.BatchNormalization(momentum=0.5)(hidden)
  outputs = tf.keras.layers.Dense(3, kernel_initializer=_init(3))(hidden)
  model = tf.keras.Model(inputs, outputs)
  logits = _keep_logits(model(features["x"], training=True))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = _minimize(loss, updates=model.get_updates_for(features["x"]))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _two_optimizers_model_fn(features, labels, mode):
  """Two losses, two optimizers: bn2 is differentiated through twice.

  Resource variables, also under TF 1 behaviour: with ref variables, the
  first optimizer's in-place update races the second's backward pass
  (through conv2), and the unwrapped model_fn gives 0.4 apart from run
  to run.
  """
  with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(),
                                   use_resource=True,
                                   auxiliary_name_scope=False):
    return _two_optimizers_spec(features, labels, mode)


def _two_optimizers_spec(features, labels, mode):
  body = _v1_body(features["x"])
  logits = _keep_logits(tf.compat.v1.layers.dense(
      body, 3, name="logits", kernel_initializer=_init(3)))
  aux = tf.compat.v1.layers.dense(body, 1, name="aux",
                                  kernel_initializer=_init(4))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  aux_loss = tf.compat.v1.losses.mean_squared_error(
      tf.reduce_mean(features["x"], [1, 2, 3])[:, None], aux)
  variables = lambda *scopes: [v for v in tf.compat.v1.trainable_variables()
                               if v.op.name.split("/")[0] in scopes]
  train_op = tf.group(
      _minimize(loss, var_list=variables("conv2", "bn2", "logits")),
      _minimize(aux_loss, tf.compat.v1.train.GradientDescentOptimizer(0.2),
                var_list=variables("conv1", "bn1", "aux"), updates=[]))
  return tf.estimator.EstimatorSpec(mode, loss=loss + aux_loss,
                                    train_op=train_op)


def _float64_model_fn(features, labels, mode):
  logits = _keep_logits(tf.compat.v1.layers.dense(
      _v1_body(features["x"], fused=False), 3, name="logits",
      kernel_initializer=_init(3)))
  # tf.compat.v1.losses computes in float32; this stays in float64.
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=_minimize(loss))


MODELS = {"v1_cnn": _v1_cnn_model_fn, "keras": _keras_model_fn,
          "two_optimizers": _two_optimizers_model_fn}


def _batches(rows, dtype=np.float32, seed=0):
  rng = np.random.RandomState(seed)
  return [(rng.normal(1.0, 2.0, (rows, 6, 6, 3)).astype(dtype),
           rng.randint(0, 3, rows).astype(np.int32)) for _ in range(STEPS)]


def _train(model_fn, rows, towers=None, dtype=np.float32, static=False,
           **wrap_kwargs):
  """Trains 3 steps: {"logits": per step, "loss": per step, "variables"}.

  `towers=None` is the unwrapped model_fn on one device. `static` feeds
  batches of known size (so shares are exact Python numbers), else
  placeholders of unknown batch size, as an input_fn ending in `.batch()`.
  """
  def fetches(spec):
    graph = tf.compat.v1.get_default_graph()
    return {"logits": tf.concat(graph.get_collection(LOGITS), 0)[:rows],
            "loss": spec.loss}

  run = harness.train(
      model_fn, _batches(rows, dtype), towers, static=static,
      step_fetches=fetches,
      in_graph=lambda: tf.compat.v1.keras.backend.set_floatx(
          np.dtype(dtype).name), **wrap_kwargs)
  result = {"logits": run.per_step("logits"), "loss": run.per_step("loss"),
            "variables": run.variables}
  tf.compat.v1.keras.backend.set_floatx("float32")
  return result


def max_differences(expected, actual):
  """Max |difference|: logits, loss, variables, moving statistics."""
  assert sorted(actual["variables"]) == sorted(expected["variables"])
  diff = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
  by_kind = {"variables": 0.0, "moving": 0.0}
  for name, value in expected["variables"].items():
    kind = "moving" if "moving_" in name else "variables"
    by_kind[kind] = max(by_kind[kind],
                        diff(actual["variables"][name], value))
  return dict(logits=max(diff(a, b) for a, b in zip(actual["logits"],
                                                     expected["logits"])),
              loss=diff(actual["loss"], expected["loss"]), **by_kind)


def _assert_one_device(expected, actual, tolerance=1e-5):
  """Every logit, loss and variable within `tolerance` (absolute and
  relative: moving variances reach 20)."""
  close = lambda a, b, what: np.testing.assert_allclose(
      a, b, rtol=tolerance, atol=tolerance, err_msg=what)
  for step, (a, b) in enumerate(zip(actual["logits"], expected["logits"])):
    close(a, b, "logits of step {}".format(step))
  close(actual["loss"], expected["loss"], "loss")
  assert sorted(actual["variables"]) == sorted(expected["variables"])
  for name, value in expected["variables"].items():
    close(actual["variables"][name], value, name)


# (model, towers, rows, strategy): every pair of values of any two of them.
CELLS = [
    ("v1_cnn", 2, 12, REPLICATED), ("v1_cnn", 3, 13, PS),
    ("v1_cnn", 3, 2, ROUND_ROBIN), ("keras", 3, 12, ROUND_ROBIN),
    ("keras", 2, 13, PS), ("keras", 3, 2, REPLICATED),
    ("two_optimizers", 3, 12, PS), ("two_optimizers", 2, 13, ROUND_ROBIN),
    ("two_optimizers", 3, 2, REPLICATED), ("v1_cnn", 2, 2, PS),
    ("keras", 3, 13, REPLICATED), ("two_optimizers", 3, 13, ROUND_ROBIN),
]
_UNWRAPPED = {}


def unwrapped(model, rows):
  if (model, rows) not in _UNWRAPPED:
    _UNWRAPPED[model, rows] = _train(MODELS[model], rows)
  return _UNWRAPPED[model, rows]


@pytest.mark.parametrize("model,towers,rows,strategy", CELLS,
                         ids=["-".join(map(str, cell)) for cell in CELLS])
def test_synchronized_batch_norm_trains_like_one_device(model, towers, rows,
                                                        strategy):
  actual = _train(MODELS[model], rows, towers, sync_batch_norm=True,
                  variable_strategy=strategy)
  _assert_one_device(unwrapped(model, rows), actual)


def test_float64_is_one_device_to_rounding():
  # Static batches: each tower's share 7/13 is a float64, not a float32.
  expected = _train(_float64_model_fn, 13, dtype=np.float64, static=True)
  actual = _train(_float64_model_fn, 13, 2, dtype=np.float64, static=True,
                  sync_batch_norm=True)
  _assert_one_device(expected, actual, tolerance=1e-12)


def test_per_shard_batch_norm_is_not_one_device():
  actual = _train(_v1_cnn_model_fn, 13, 2, sync_batch_norm=False)
  assert max_differences(unwrapped("v1_cnn", 13), actual)["logits"] > 0.05


def _declared_model_fn(features, labels, mode):
  hidden = tf.keras.layers.Conv2D(4, 3, kernel_initializer=_init(1))(
      features["x"])
  layer = tf.keras.layers.BatchNormalization(momentum=0.5, synchronized=True)
  hidden = layer(hidden, training=True)
  logits = _keep_logits(tf.keras.layers.Dense(3, kernel_initializer=_init(3))(
      tf.keras.layers.Flatten()(hidden)))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(
      loss, updates=layer.updates))


def test_a_layer_declared_synchronized_is_synchronized_without_the_flag():
  expected = _train(_declared_model_fn, 13)
  _assert_one_device(expected, _train(_declared_model_fn, 13, 3))


# EVAL and PREDICT: nothing changes.


def _mode_cnn_model_fn(features, labels, mode):
  logits = tf.compat.v1.layers.dense(
      _v1_body(features["x"], training=mode == TRAIN), 3, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = _minimize(loss) if mode == TRAIN else None
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    predictions={"logits": logits})


def _build(model_fn, towers=2, mode=TRAIN, config=None, **wrap_kwargs):
  """The wrapped model_fn's graph, built on placeholders (nothing run)."""
  wrap_kwargs.setdefault("sync_batch_norm", True)
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [None, 6, 6, 3])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    wrapped = replicate.replicate_model_fn(model_fn, devices=cpus(towers),
                                           **wrap_kwargs)
    wrapped(features={"x": x}, labels=y, mode=mode, config=config)
  return graph


@pytest.mark.parametrize("mode", [EVAL, tf.estimator.ModeKeys.PREDICT])
def test_evaluation_and_prediction_are_unchanged(mode):
  def op_names(sync):
    return [op.name for op in _build(_mode_cnn_model_fn, mode=mode,
                                     sync_batch_norm=sync).get_operations()]
  assert op_names(True) == op_names(False)


def test_nothing_is_left_behind_built_or_refused():
  original_moments = _tf._keras_bn.BatchNormalizationBase.__dict__[
      "_calculate_mean_and_var"]
  original_fused = tf.compat.v1.nn.fused_batch_norm
  graph = _build(_v1_cnn_model_fn)
  with pytest.raises(ValueError):
    _build(_model_fn_with(_v1_bn(), _gradients_by_hand))
  assert not graph.get_collection("replicate.replication_context")
  assert _tf._keras_bn.BatchNormalizationBase.__dict__[
      "_calculate_mean_and_var"] is original_moments
  assert all(module.fused_batch_norm is original_fused
             for module in _tf._FUSED_BATCH_NORM_HOLDERS)


# Refused, with the layer and the fix.


def _model_fn_with(normalize, train=None):
  """A model_fn: conv, `normalize(hidden)`, dense; `train(loss)` or minimize."""

  def model_fn(features, labels, mode):
    hidden = tf.compat.v1.layers.conv2d(features["x"], 4, 3, name="conv")
    hidden = tf.compat.v1.layers.flatten(normalize(hidden))
    logits = tf.compat.v1.layers.dense(hidden, 3, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = (train or _minimize)(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _v1_bn(fused=True, training=True, name="bn"):
  return lambda hidden: tf.compat.v1.layers.batch_normalization(
      hidden, training=training() if callable(training) else training,
      fused=fused, name=name)


def _in_tower(index):
  scope = tf.compat.v1.get_default_graph().get_name_scope()
  if index == 0:
    return not scope.startswith("tower_")
  return scope.startswith("tower_{}".format(index))


def _training_tensor():
  # Not a constant, which batch norm would read when building: a tf.cond.
  return tf.compat.v1.placeholder_with_default(True, [])


def _gradients_by_hand(loss):
  variables = tf.compat.v1.trainable_variables()
  return replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).apply_gradients(
          zip(tf.gradients(loss, variables), variables))


def _extra_pass_in(index):
  def train(loss):
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))
    train_op = optimizer.minimize(loss)
    if _in_tower(index):
      optimizer.compute_gradients(loss)  # a backward pass the others lack
    return train_op
  return train


def _extra_layer_in_tower_0(hidden):
  hidden = _v1_bn()(hidden)
  return _v1_bn(name="extra")(hidden) if _in_tower(0) else hidden


def _swapped_layers_in_tower_1(hidden):
  names = ["bn_b", "bn_a"] if _in_tower(1) else ["bn_a", "bn_b"]
  for name in names:
    hidden = _v1_bn(name=name)(hidden)
  return hidden


def _in_tf_function(fused):
  def normalize(hidden):
    layer = tf.keras.layers.BatchNormalization(fused=fused)
    layer.build(hidden.shape)
    return tf.function(lambda h: layer(h, training=True))(hidden)
  return normalize


def _keras_bn(**kwargs):
  call_kwargs = {"mask": kwargs.pop("mask")} if "mask" in kwargs else {}
  return lambda hidden: tf.keras.layers.BatchNormalization(
      name="bn", **kwargs)(hidden, training=True, **call_kwargs)


def _masked(hidden):
  flat = tf.compat.v1.layers.flatten(hidden)
  return _keras_bn(fused=False, mask=tf.reduce_max(flat, 1) > 0)(flat)


REFUSALS = {
    "tensor_training_fused": (
        _model_fn_with(_v1_bn(training=_training_tensor)),
        r"batch norm 'bn.*tf\.cond.*Python bool"),
    "tf_function_fused": (_model_fn_with(_in_tf_function(True)),
                          r"tf\.function.*Python bool"),
    "tf_function_not_fused": (_model_fn_with(_in_tf_function(False)),
                              r"batch norm 'batch_normalization.*tf\.function"),
    "mask": (_model_fn_with(_masked), r"batch norm 'bn' is called with a mask"),
    "virtual_batch_size": (
        _model_fn_with(_keras_bn(virtual_batch_size=2, fused=False)),
        r"batch norm 'bn' has virtual_batch_size=2.*remove virtual_batch"),
    "tf_gradients": (_model_fn_with(_v1_bn(), _gradients_by_hand),
                     r"batch norm 'bn'.*outside TowerOptimizer.*Fix: use "
                     r"TowerOptimizer\.compute_gradients"),
    "extra_pass_in_tower_0": (_model_fn_with(_v1_bn(), _extra_pass_in(0)),
                              r"different numbers of backward passes through "
                              r"the synchronized batch norm 'bn' \(tower 0: 2, "
                              r"tower 1: 1\)"),
    "extra_pass_in_the_last_tower": (
        _model_fn_with(_v1_bn(), _extra_pass_in(1)),
        r"different numbers of backward passes.*'bn'"),
    # Refused where the towers' gradients are matched, before the sites
    # are (compute_gradients returns the whole batch's sums since issue 30).
    "extra_layer_in_tower_0": (_model_fn_with(_extra_layer_in_tower_0),
                               r"no gradient for 'extra/gamma'.*each "
                               r"tower's loss must depend on the same "
                               r"variables"),
    "layers_swapped_in_tower_1": (
        _model_fn_with(_swapped_layers_in_tower_1),
        r"Tower 1's synchronized batch norm 'bn_b' \(its number 1\) has no "
        r"counterpart in tower 0"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_cannot_be_synchronized_is_refused(case):
  model_fn, message = REFUSALS[case]
  with pytest.raises(ValueError, match=message):
    _build(model_fn)


def test_sync_batch_norm_must_be_a_bool():
  with pytest.raises(ValueError, match="sync_batch_norm must be True .* "
                     "Received: 'yes'"):
    replicate.replicate_model_fn(_v1_cnn_model_fn, sync_batch_norm="yes")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


_PS_CLUSTER = {job: ["127.0.0.1:{}".format(_free_port())]
               for job in ("chief", "worker", "ps")}


def _ps_cluster_config(monkeypatch):
  """The chief of a ps cluster, its server running (the towers are its
  devices, asked of it; it goes with the test process)."""
  monkeypatch.setenv("TF_CONFIG", json.dumps({
      "cluster": _PS_CLUSTER, "task": {"type": "chief", "index": 0}}))
  if not _CHIEF_SERVER:
    _CHIEF_SERVER.append(tf.distribute.Server(
        tf.train.ClusterSpec(_PS_CLUSTER), job_name="chief", task_index=0,
        config=session_config(2)))
  return tf.estimator.RunConfig(session_config=session_config(2))


_CHIEF_SERVER = []


def test_a_ps_cluster_of_several_workers_is_refused(monkeypatch):
  # Its workers step on their own (a synchronous cluster, without ps,
  # synchronizes across tasks: test_sync_multiworker.py). Refused at the
  # first batch norm, with the default too.
  config = _ps_cluster_config(monkeypatch)
  for wrap_kwargs in ({}, {"sync_batch_norm": True}):
    with pytest.raises(ValueError, match="batch norm 'bn1' is synchronized "
                       r"by sync_batch_norm=True \(the default\), but this "
                       "RunConfig's cluster has 2 training tasks .* and ps "
                       "tasks.*Fix: sync_batch_norm=False.*or a synchronous "
                       "cluster"):
      _build(_v1_cnn_model_fn, config=config, **wrap_kwargs)
  with pytest.raises(ValueError, match="batch norm 'bn' is declared "
                     "synchronized=True, but .* 2 training tasks"):
    _build(_model_fn_with(_keras_bn(synchronized=True)), config=config,
           sync_batch_norm=False)


def _dense_model_fn(features, labels, mode):
  logits = tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(
      features["x"]), 3, kernel_initializer=_init(1))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(loss))


def test_a_ps_cluster_trains_a_model_without_batch_norm_by_default(
    monkeypatch):
  # On 2c8ec8c an explicit sync_batch_norm=True was refused here for every
  # model; with True the default, a model without batch norm must build.
  graph = _build(_dense_model_fn, config=_ps_cluster_config(monkeypatch),
                 sync_batch_norm=True)
  assert "tower_1/dense/MatMul" in [op.name for op in graph.get_operations()]


@pytest.mark.parametrize("sync", [True, False])
def test_a_tensor_training_argument_never_updates_per_tower(sync):
  # Non-fused: the moments are taken outside the tf.cond and synchronized,
  # but the moving statistics are written inside it, once per tower, where
  # they cannot be combined: refused, as is the per-shard layer.
  model_fn = _model_fn_with(_v1_bn(fused=False, training=_training_tensor))
  with pytest.raises(ValueError, match="Python bool as training"):
    _build(model_fn, sync_batch_norm=sync)

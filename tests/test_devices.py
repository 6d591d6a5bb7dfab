"""Device strings, local device discovery and variable placement."""

import pytest
import tensorflow as tf

from conftest import session_config
from replicate import _tf
from replicate.call import colocation
from replicate.call import devices
from replicate.variables import strategies


def test_any_spelling_is_normalised():
  assert devices.normalize_devices(
      ["/gpu:0", "/device:GPU:1", "cpu:1", "/job:worker/task:2/gpu:0"]) == [
          "/device:GPU:0", "/device:GPU:1", "/device:CPU:1",
          "/job:worker/task:2/device:GPU:0"
      ]
  assert devices.normalize_devices(None) is None


@pytest.mark.parametrize("bad, expected", [
    (["/gpu:0", "/GPU:0"], r"contains '/GPU:0' twice \(as '/device:GPU:0'\)"),
    ([], "devices is empty"),
    (["/gpu:0", "foo"], "contains 'foo', which TensorFlow cannot parse"),
    ([""], "contains '', which names no device type"),
    (["/gpu:0", 1], "1 is a int"),
    ("/gpu:0", "must be a list of device strings"),
    # A wildcard would become the one tower '/device:CPU:0'.
    (["/cpu:*"], r"contains '/cpu:\*', a wildcard; replicate_model_fn builds "
     r"one tower per device listed, so list each device, e.g. \['/cpu:0', "
     r"'/cpu:1'\], or pass devices=None"),
    (["/gpu:0", "/device:GPU:*"], r"contains '/device:GPU:\*', a wildcard"),
])
def test_bad_devices_are_named_in_the_error(bad, expected):
  with pytest.raises(ValueError, match=expected):
    devices.normalize_devices(bad)


@pytest.mark.parametrize("listed, expected", [
    (["/job:foo/cpu:0", "/job:foo/cpu:1"],
     r"contains '/job:foo/device:CPU:0', which names job 'foo'; but this "
     r"RunConfig has no cluster \(no TF_CONFIG\), so the session is local, "
     r"whose devices are '/job:localhost/replica:0/task:0/\.\.\.' only\. "
     r"Name devices without a job, replica or task, e.g\. '/cpu:0'"),
    (["/task:3/cpu:0", "/task:3/cpu:1"],
     r"contains '/task:3/device:CPU:0', which names task 3; but this "
     r"RunConfig has no cluster"),
    (["/cpu:0", "/job:worker/replica:1/task:2/cpu:1"],
     r"contains '/job:worker/replica:1/task:2/device:CPU:1', which names job "
     r"'worker' and replica 1 and task 2"),
])
def test_another_job_or_task_than_the_local_sessions_is_refused(listed,
                                                                 expected):
  config = tf.estimator.RunConfig(session_config=session_config(2))
  with pytest.raises(ValueError, match=expected):
    devices.tower_devices(devices.normalize_devices(listed), config)


def test_the_local_sessions_own_job_and_task_are_accepted():
  listed = devices.normalize_devices(
      ["/job:localhost/replica:0/task:0/cpu:0", "/task:0/cpu:1"])
  config = tf.estimator.RunConfig(session_config=session_config(2))
  assert devices.tower_devices(listed, config) == listed


def test_local_devices_counts_what_the_session_config_gives():
  # No GPU here: every local CPU device, as many as device_count asks for.
  assert devices.local_devices(session_config(3)) == [
      "/device:CPU:0", "/device:CPU:1", "/device:CPU:2"
  ]


_STRATEGIES = {"parameter_server": strategies.ParameterServer,
               "round_robin": strategies.RoundRobin}


def _placed(strategy, tower_devices, variable_names):
  """Creates variables in tower 0's device scope; returns their devices."""
  chooser = _STRATEGIES[strategy](tower_devices).variable_device
  with tf.Graph().as_default() as graph:
    with graph.device(devices.tower_device_function(tower_devices[0],
                                                    chooser)):
      variables = [tf.compat.v1.get_variable(name, []) for name in
                   variable_names]
      op = tf.identity(variables[0])
  return [v.op.device for v in variables], op.device


def test_parameter_server_puts_variables_on_cpu_0_with_several_devices():
  placed, op_device = _placed(
      "parameter_server", ["/device:GPU:0", "/device:GPU:1"], ["a", "b"])
  assert placed == ["/device:CPU:0", "/device:CPU:0"]
  assert op_device == "/device:GPU:0"  # the tower's own ops stay on its device


def test_parameter_server_with_one_device_keeps_variables_there():
  placed, _ = _placed("parameter_server", ["/device:GPU:1"], ["a"])
  assert placed == ["/device:GPU:1"]


def test_round_robin_places_variables_in_creation_order():
  placed, _ = _placed("round_robin", ["/device:CPU:0", "/device:CPU:1"],
                      ["a", "b", "c"])
  assert placed == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:0"]


def test_a_device_the_model_fn_sets_itself_is_kept():
  chooser = strategies.ParameterServer(
      ["/device:GPU:0", "/device:GPU:1"]).variable_device
  with tf.Graph().as_default() as graph:
    with graph.device(devices.tower_device_function("/device:GPU:1", chooser)):
      with tf.device("/cpu:0"):
        pinned = tf.constant(1.0)
  assert pinned.op.device == "/device:CPU:0"


def test_a_colocation_group_that_cannot_settle_is_refused_naming_replicate():
  # What TensorFlow's placer refuses at the first session without soft
  # placement (reported by the Estimator as a checkpoint mismatch): two
  # ops a group is named after, on two devices.
  with tf.Graph().as_default() as graph:
    with tf.device("/job:localhost/cpu:0"):
      params = tf.ones([3], name="params")
    with tf.device("/cpu:1"):
      other = tf.ones([3], name="other")
    with tf.compat.v1.colocate_with(params):
      agreeing = tf.identity(params, name="agreeing")
      with graph.device("/cpu:0"):  # ignored under the colocation
        shape = tf.shape(params, name="shape")
    colocation.place_colocated(graph, [params.op, agreeing.op, shape.op])
    with tf.compat.v1.colocate_with(params), \
        tf.compat.v1.colocate_with(other):
      both = tf.identity(other, name="both")
    with pytest.raises(ValueError, match=(
        r"replicate_model_fn built ops colocated with each other on several "
        r"devices: 'agreeing' on '/job:localhost/device:CPU:0', 'both' on "
        r"'/device:CPU:1', 'other' on '/device:CPU:1', 'params' on "
        r"'/job:localhost/device:CPU:0', \.\.\..*"
        r"allow_soft_placement=True")):
      colocation.place_colocated(graph, [agreeing.op, shape.op, both.op])


def test_a_split_group_with_no_variable_goes_where_its_named_op_is():
  with tf.Graph().as_default() as graph:
    with tf.device("/cpu:0"):
      params = tf.ones([3], name="params")
    with tf.compat.v1.colocate_with(params):
      shape = tf.shape(params, name="shape")
    _tf.set_device(shape.op, "/cpu:1")  # as a later placement would
    colocation.place_colocated(graph, [shape.op])
  assert shape.op.device == params.op.device


def test_a_group_split_over_two_devices_goes_where_its_variable_lives():
  # A tower's op (on /cpu:1) and a variable (on /cpu:0) that one gradient
  # op is colocated with both, as tf.gradients builds it.
  with tf.Graph().as_default() as graph:
    with tf.device("/cpu:0"):
      variable = tf.compat.v1.Variable([1.0, 2.0], name="table",
                                       use_resource=False)
    with tf.device("/cpu:1"):
      gather = tf.gather(variable, [1], name="gather")
    with tf.compat.v1.colocate_with(gather.op), \
        tf.compat.v1.colocate_with(variable.op):
      shape = tf.shape(variable, name="shape")
    colocation.place_colocated(graph, [gather.op, shape.op])
  assert gather.op.device == shape.op.device == variable.op.device


def test_ops_in_a_function_get_a_colocation_group_of_their_function():
  # A gradient op built in a cond's gradient function is colocated with
  # its forward op by that op's name; the name is the function's own, so
  # every tower's would meet in one group (and one device would not).
  with tf.Graph().as_default() as graph:
    x = tf.compat.v1.placeholder(tf.float32, [None])
    with graph.device(devices.tower_device_function("/cpu:1",
                                                    lambda op: "/cpu:0")):
      y = tf.cond(tf.reduce_sum(x) > 0,
                  lambda: tf.gather(tf.reshape(x, [-1]), [0]),
                  lambda: x[:1])
      tf.gradients(y, x)
  groups = {node.name: list(node.attr["_class"].list.s)
            for function in graph.as_graph_def().library.function
            if function.signature.name.startswith("cond_true")
            for node in function.node_def
            if node.name in ("Reshape", "gradients/GatherV2_grad/Shape")}
  # The gather's params (the Reshape) and its gradient's Shape.
  assert groups["Reshape"][0].startswith(b"loc:@cond_true")
  assert groups["Reshape"][0] in groups["gradients/GatherV2_grad/Shape"]
